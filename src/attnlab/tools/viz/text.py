"""The weights as text in the terminal (``attnlab viz`` without ``--out``), as the tutorials print them."""

from __future__ import annotations

from attnlab.tools.viz.view import AttentionView, token_label

__all__ = ["format_text"]


def format_text(view: AttentionView, width: int = 80) -> str:
    """The weights as tables when they fit ``width`` columns, otherwise each query's strongest key."""
    T = len(view.tokens)
    labels = [token_label(t) for t in view.tokens]
    lw = min(10, max(len(s) for s in labels))
    fits = lw + 1 + 7 * T <= width
    lines = [view.title, ""]
    for layer in view.layers:
        for h, w in zip(layer.heads, layer.weights, strict=True):
            lines.append(f"{layer.name} · head {h}  (rows: queries, columns: keys)")
            if fits:
                lines.append(" " * (lw + 1) + "".join(f"{s[:6]:>7}" for s in labels))
                lines += [f"{labels[i][:lw]:>{lw}} " + "".join(f"{float(v):7.4f}" for v in w[i]) for i in range(T)]
            else:
                for i in range(T):
                    j = int(w[i].argmax())
                    lines.append(f"  {i:>4} {labels[i][:12]:<12} -> {j:>4} {labels[j][:12]:<12} {float(w[i, j]):.3f}")
            lines.append("")
    return "\n".join(lines)
