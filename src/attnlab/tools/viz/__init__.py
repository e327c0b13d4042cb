"""``attnlab viz``: look at attention. Heatmaps (PNG) and a self-contained HTML viewer.

Two sources of attention: without ``--checkpoint``, the tutorials' six-word example through the
modules of "A simple self-attention mechanism" under its seeds; with ``--checkpoint DIR`` or
``--model NAME`` and ``--prompt TEXT``, a GPT, one heatmap per layer and head (as HTML, the full
inspector of :mod:`attnlab.interpret`). The weights are the model's own (see :mod:`.view`).

The modules: :mod:`.view` (capturing the weights), :mod:`.png` (heatmaps), :mod:`.page` (the HTML
page), :mod:`.inspector` (a model's inspector page), :mod:`.text` (numbers in the terminal).

Library use::

    from attnlab.tools.viz import attention_maps, save_png, save_html, AttentionView
    maps = attention_maps(model, idx)  # [(H, T, T) per attention module]
"""

from attnlab.tools.viz.inspector import encode_prompt, model_inspector
from attnlab.tools.viz.page import ASSETS, read_asset, render_html, save_html, view_to_dict
from attnlab.tools.viz.png import save_png
from attnlab.tools.viz.text import format_text
from attnlab.tools.viz.view import (
    ATTENTION_TYPES,
    AttentionView,
    LayerMaps,
    attention_maps,
    capture_attention,
    demo_view,
    model_view,
    token_label,
)

__all__ = [
    "ASSETS",
    "ATTENTION_TYPES",
    "AttentionView",
    "LayerMaps",
    "attention_maps",
    "capture_attention",
    "demo_view",
    "encode_prompt",
    "format_text",
    "model_inspector",
    "model_view",
    "read_asset",
    "render_html",
    "save_html",
    "save_png",
    "token_label",
    "view_to_dict",
]
