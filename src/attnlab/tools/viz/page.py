"""The HTML viewer: one self-contained page that works offline, built from the files in ``assets/``.

The viewer is three package data files, kept as what they are so they can be read, linted and
edited: ``viewer.html`` (the markup, a :class:`string.Template`), ``viewer.css`` and ``viewer.js``
(``showAttention(data)`` draws a view from its JSON). The code never contains the data: the
template has slots for how the styles, the data and the scripts reach the page, and
:func:`render_html` fills them for an offline file (everything inline, a Content-Security-Policy
that allows no network at all). A page served by a local server can fill the same slots with
``<link>``/``<script src>`` tags and fetch :func:`view_to_dict`'s JSON instead.

Template slots: ``$csp`` (the policy), ``$title`` (escaped text), ``$styles``, ``$data`` and
``$scripts`` (markup).
"""

from __future__ import annotations

import html
import json
import os
from importlib import resources
from pathlib import Path
from string import Template

from torch import Tensor

from attnlab.files import atomic_write_text
from attnlab.tools.viz.view import AttentionView, token_label

__all__ = ["ASSETS", "read_asset", "render_html", "save_html", "view_to_dict"]

ASSETS = ("viewer.html", "viewer.css", "viewer.js")

# The offline page loads nothing: inline styles and scripts, canvases as data: images, no requests.
OFFLINE_CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


def read_asset(name: str) -> str:
    """The text of one of the viewer's files (:data:`ASSETS`), read from the installed package."""
    if name not in ASSETS:
        raise ValueError(f"name must be one of {', '.join(ASSETS)}, got {name!r}")
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def _json_for_script(obj: object) -> str:
    """JSON safe to put inside ``<script type="application/json">``.

    ``<``, ``>`` and ``&`` become ``\\u003c`` etc., so no token text can close the script element
    (``</script>``) or open a comment; ``JSON.parse`` reads them back unchanged.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _inline(tag: str, text: str) -> str:
    """``<tag>text</tag>``, refusing text that would end the element early (an edit to an asset)."""
    if f"</{tag}" in text.lower() or "<!--" in text:
        raise ValueError(f"viewer asset text cannot be inlined in <{tag}>: it contains '</{tag}' or '<!--'")
    return f"<{tag}>\n{text}</{tag}>"


def view_to_dict(view: AttentionView, *, decimals: int = 4) -> dict:
    """The data ``showAttention`` draws, as JSON-ready values (weights rounded to ``decimals`` places)."""
    scale = 10**decimals

    def rows(m: Tensor) -> list[list[float]]:
        return [[round(float(v) * scale) / scale for v in row] for row in m.tolist()]

    return {
        "title": view.title,
        "text": view.text,
        "note": view.note,
        "tokens": list(view.tokens),
        "labels": [token_label(t) for t in view.tokens],
        "layers": [
            {"name": layer.name, "heads": list(layer.heads), "weights": [rows(h) for h in layer.weights.float()]}
            for layer in view.layers
        ],
    }


def render_html(view: AttentionView) -> str:
    """The page as a string: inline CSS and JS, the data as JSON, no network access at all."""
    return Template(read_asset("viewer.html")).substitute(
        csp=OFFLINE_CSP,
        title=html.escape(view.title or "attention"),
        styles=_inline("style", read_asset("viewer.css")),
        data=f'<script type="application/json" id="attn-data">{_json_for_script(view_to_dict(view))}</script>',
        scripts=_inline("script", read_asset("viewer.js")),
    )


def save_html(view: AttentionView, path: str | os.PathLike) -> Path:
    """Write :func:`render_html` atomically to ``path``."""
    atomic_write_text(path, render_html(view))
    return Path(path)
