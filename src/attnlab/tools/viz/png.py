"""Heatmaps with matplotlib: a grid of panels (rows = layers, columns = heads) as PNG, SVG or PDF.

matplotlib is imported when a picture is drawn, not before: the rest of ``attnlab viz`` works
without it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from attnlab.files import atomic_open
from attnlab.tools.viz.view import AttentionView, token_label

__all__ = ["save_png"]


def save_png(view: AttentionView, path: str | os.PathLike, *, dpi: int = 110) -> Path:
    """Draw a grid of heatmaps (rows = layers, columns = heads) and write it atomically.

    Each panel has the query tokens down the side and the key tokens along the bottom. Each row
    has its own colour bar from 0 to that row's largest weight, so a layer's heads compare
    directly and a flat layer still shows its structure. With at most 8 tokens the weights are
    printed in the cells, as the tutorials print them. The format follows the suffix (``.png``,
    ``.svg``, ``.pdf``).
    """
    # A bare Figure renders with Agg on savefig: no pyplot, no GUI backend, no global state.
    from matplotlib.figure import Figure

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    T = len(view.tokens)
    n_rows = len(view.layers)
    n_cols = max(layer.weights.shape[0] for layer in view.layers)
    many = n_rows * n_cols > 16
    label_all = not many and T <= 32  # else token labels only on the outer panels
    cell = min(max(0.30 * T + 1.0, 2.4), 7.0) if not many else min(max(0.16 * T + 0.9, 1.6), 4.0)
    # Font from the row pitch (points per token); below 3.5 pt only every k-th token is labelled.
    fontsize = min(9.0, 0.75 * cell * 72.0 / T)
    every = max(1, math.ceil(3.5 / fontsize))
    fontsize = max(fontsize, 3.5)
    title_size = 8.0 if not many else 7.0
    ticks = list(range(0, T, every))
    tick_labels = [token_label(view.tokens[k]).replace("$", r"\$") for k in ticks]  # "$" would start mathtext

    fig = Figure(figsize=(n_cols * cell + 2.2, n_rows * (cell + 0.5) + 0.6), layout="constrained")
    title = view.title if len(view.title) <= 90 else view.title[:87] + "..."
    fig.suptitle(title.replace("$", r"\$"), fontsize=12, fontweight="bold")
    rows = fig.subfigures(n_rows, 1, squeeze=False)[:, 0]
    for r, (row, layer) in enumerate(zip(rows, view.layers, strict=True)):
        w = layer.weights.float().numpy()  # (H, T, T)
        vmax = float(w.max()) or 1.0
        row.suptitle(layer.name.replace("$", r"\$"), fontsize=title_size + 1, x=0.02, ha="left")
        axes = row.subplots(1, n_cols, squeeze=False)[0]
        image = None
        for c, ax in enumerate(axes):
            if c >= w.shape[0]:
                ax.set_axis_off()
                continue
            image = ax.imshow(w[c], cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest", aspect="equal")
            ax.set_title(f"head {layer.heads[c]}", fontsize=title_size)
            # Key labels on every panel, or only where no panel sits below (the grid can be ragged);
            # unlabelled axes get no ticks at all (thousands of tick artists make a large grid slow).
            below = view.layers[r + 1].weights.shape[0] if r + 1 < n_rows else 0
            show_x = label_all or c >= below
            show_y = label_all or c == 0
            ax.set_xticks(ticks if show_x else [], tick_labels if show_x else [], rotation=90, fontsize=fontsize)
            ax.set_yticks(ticks if show_y else [], tick_labels if show_y else [], fontsize=fontsize)
            ax.tick_params(length=0)
            if show_x:
                ax.set_xlabel("key (attended to)", fontsize=title_size)
            if show_y:
                ax.set_ylabel("query (attending)", fontsize=title_size)
            if T <= 8:
                for i in range(T):
                    for j in range(T):
                        v = float(w[c, i, j])
                        dark = v < 0.6 * vmax  # viridis is dark at the bottom: white text there
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6.5,
                                color="white" if dark else "black")  # fmt: skip
        used = [ax for c, ax in enumerate(axes) if c < w.shape[0]]
        if image is not None:
            row.colorbar(image, ax=used, shrink=0.85, aspect=15, label="attention weight")

    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=fmt, dpi=dpi)
    return path
