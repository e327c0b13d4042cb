"""The inspector page: one self-contained HTML file that works offline, built from the files in ``assets/``.

The viewer is three package data files, kept as what they are so they can be read, linted and
edited: ``viewer.html`` (the markup, a :class:`string.Template`), ``viewer.css`` and ``viewer.js``
(``showInspector(source)`` draws every view from a *source* of data; ``showAttention(data)`` wraps
embedded data in one). The code never contains the data: the template has slots for how the
styles, the data and the scripts reach the page, and :func:`render_page` fills them for an offline
file (everything inline, a Content-Security-Policy that allows no network at all). A local server
can fill the same slots with ``<link>``/``<script src>`` tags and give the page a source that
fetches the JSON of :func:`attnlab.interpret.inspector_data` instead.

Template slots: ``$csp`` (the policy), ``$title`` (escaped text), ``$styles``, ``$data`` and
``$scripts`` (markup).

The patching view has files of its own (``patching.js``, ``patching.css``; ``patching.html`` holds
the view alone, for Jupyter: :mod:`attnlab.interpret.patch_view`): a page with a ``patching``
section inlines them too, ``patching.js`` first (it registers the view that ``showInspector`` adds).
So does a page with a ``features`` section (SAE latents): ``features.{js,css}`` and the latent
dashboard's drawing, ``sae_dashboard.js``.
"""

from __future__ import annotations

import html
import json
import os
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from attnlab.files import atomic_write_text
from attnlab.interpret.codec import to_json, unpack

__all__ = ["ASSETS", "OFFLINE_CSP", "notebook_html", "read_asset", "read_page_data", "render_page", "save_page"]

ASSETS = (
    "viewer.html",
    "viewer.css",
    "viewer.js",
    "patching.html",
    "patching.css",
    "patching.js",
    "patch_report.html",
    "features.css",
    "features.js",
    "sae_dashboard.js",
)

# The offline page loads nothing: inline styles and scripts, canvases as data: images, no requests.
OFFLINE_CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


def read_asset(name: str) -> str:
    """The text of one of the viewer's files (:data:`ASSETS`), read from the installed package."""
    if name not in ASSETS:
        raise ValueError(f"name must be one of {', '.join(ASSETS)}, got {name!r}")
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def json_for_script(obj: object) -> str:
    """JSON safe to put inside ``<script type="application/json">``: ``<``, ``>`` and ``&`` become
    ``\\u003c`` etc., so no token text can close the script element (``</script>``) or open a comment;
    ``JSON.parse`` reads them back unchanged."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def inline(tag: str, text: str) -> str:
    """``<tag>text</tag>``, refusing text that would end the element early (an edit to an asset)."""
    if f"</{tag}" in text.lower() or "<!--" in text:
        raise ValueError(f"viewer asset text cannot be inlined in <{tag}>: it contains '</{tag}' or '<!--'")
    return f"<{tag}>\n{text}</{tag}>"


def render_page(data: dict[str, Any], *, read: Any = None) -> str:
    """The page as a string: inline CSS and JS, the data as JSON (arrays in one compressed blob), no
    network access at all. ``data`` is what :func:`~attnlab.interpret.inspector_data` (or
    :func:`~attnlab.interpret.records_data`, :func:`~attnlab.interpret.maps_data`) returns."""
    read = read_asset if read is None else read
    styles, scripts = inline("style", read("viewer.css")), inline("script", read("viewer.js"))
    if data.get("patching") is not None:  # the patching view (attnlab.interpret.patch_view): its own files
        styles += "\n" + inline("style", read("patching.css"))
        scripts = inline("script", read("patching.js")) + "\n" + scripts
    if data.get("features"):  # the Features view (SAE latents: attnlab.interpret.sae_view.features_section)
        styles += "\n" + inline("style", read("features.css"))
        features = [inline("script", read(name)) for name in ("sae_dashboard.js", "features.js")]
        scripts = "\n".join([*features, scripts])
    return Template(read("viewer.html")).substitute(
        csp=OFFLINE_CSP,
        title=html.escape(data.get("title") or "attention"),
        styles=styles,
        data=f'<script type="application/json" id="attn-data">{_page_json(data)}</script>',
        scripts=scripts,
    )


def _page_json(data: dict[str, Any]) -> str:
    """:func:`json_for_script` of the page's data with its arrays in one blob. The blob's base64 text
    (tens of MB; letters, digits, ``+/=``: nothing to escape for JSON or HTML) is spliced in after the
    rest is encoded, instead of being scanned by the encoder and the escaping passes."""
    payload = to_json(data, blob=True)
    b64, payload["blob"]["b64"] = payload["blob"]["b64"], ""
    text = json_for_script(payload)
    at = text.rindex('"b64":""')  # the blob's, the last key written (no other "b64" key: arrays hold refs)
    return text[:at] + '"b64":"' + b64 + text[at + len('"b64":"') :]


def save_page(data: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write :func:`render_page` atomically to ``path``."""
    atomic_write_text(path, render_page(data))
    return Path(path)


def notebook_html(data: dict[str, Any], *, height: int = 900) -> str:
    """The page for a Jupyter cell: an ``<iframe srcdoc>`` holding the whole offline page."""
    return iframe(render_page(data), "inspector", height)


def iframe(page: str, name: str, height: int) -> str:
    """``page`` in an ``<iframe srcdoc>`` of class ``attnlab-{name}`` for a Jupyter cell: its own document,
    so its CSP, ids and styles cannot clash with the notebook's; scripts only, no network."""
    return (
        f'<iframe class="attnlab-{name}" sandbox="allow-scripts" style="width: 100%; height: {int(height)}px; '
        f'border: 1px solid #d9dee5;" srcdoc="{html.escape(page, quote=True)}"></iframe>'
    )


def read_page_data(page: str) -> dict[str, Any]:
    """The data embedded in a page written by :func:`render_page`, arrays back as tensors."""
    start = page.index('id="attn-data">') + len('id="attn-data">')
    return unpack(json.loads(page[start : page.index("</script>", start)]))
