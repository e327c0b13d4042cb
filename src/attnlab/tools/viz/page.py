"""The HTML page of ``attnlab viz``: the inspector of :mod:`attnlab.interpret` (its package data, the
page Jupyter and ``attnlab serve`` show too), one self-contained offline file. This module turns an
:class:`AttentionView` into the page's data; a GPT's full inspector comes from
:func:`attnlab.tools.viz.inspector.model_inspector`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from attnlab.files import atomic_write_text
from attnlab.interpret import maps_data, records_data, render_page
from attnlab.interpret.page import ASSETS, read_asset
from attnlab.tools.viz.view import AttentionView

__all__ = ["ASSETS", "read_asset", "render_html", "save_html", "view_to_dict"]


def view_to_dict(view: AttentionView) -> dict[str, Any]:
    """The page's data for a view: its weights, and with the tutorials' modules (``view.records``)
    the tutorials' steps of every head (arrays packed: see :mod:`attnlab.interpret.codec`)."""
    if view.records is not None:
        rows = [(layer.name, rec, layer.heads) for layer, rec in zip(view.layers, view.records, strict=True)]
        return records_data(rows, view.tokens, title=view.title, text=view.text, note=view.note)
    rows = [(layer.name, layer.heads, layer.weights) for layer in view.layers]
    return maps_data(rows, view.tokens, title=view.title, text=view.text, note=view.note)


def render_html(view: AttentionView | dict[str, Any]) -> str:
    """The page as a string: inline CSS and JS, the data embedded, no network access at all.

    ``view`` is an :class:`AttentionView` or page data (:func:`attnlab.interpret.inspector_data`)."""
    data = view if isinstance(view, dict) else view_to_dict(view)
    return render_page(data, read=lambda name: read_asset(name))  # looked up per call (tests patch it)


def save_html(view: AttentionView | dict[str, Any], path: str | os.PathLike) -> Path:
    """Write :func:`render_html` atomically to ``path``."""
    atomic_write_text(path, render_html(view))
    return Path(path)
