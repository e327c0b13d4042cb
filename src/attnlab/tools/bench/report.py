"""The benchmarks' reports: ``attnlab bench``'s directory (``report.md``, ``results.json``, PNG plots
drawn with matplotlib) and the goal benchmark's text tables (``benchmarks/attention.py``)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from attnlab.errors import UserError
from attnlab.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from attnlab.tools.bench.registry import IMPLEMENTATIONS

__all__ = ["PLOT_NAMES", "format_attention_report", "format_markdown", "require_plotting", "table", "write_report"]

PLOT_NAMES = ("attention_time.png", "attention_memory.png", "generation.png", "training.png")


def require_plotting() -> None:
    """Fail early, before minutes of measuring, when matplotlib (the ``viz`` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "the report's plots need matplotlib, which is not installed: pip install 'attnlab[viz]'"
        ) from None


def table(header: list[str], rows: list[list[str]], *, markdown: bool = False, align: str | None = None) -> list[str]:
    """A table's lines: Markdown, or text columns two spaces apart.

    ``align`` has one ``l`` or ``r`` per column (default: the first left, the others right).
    """
    align = align or "l" + "r" * (len(header) - 1)
    if markdown:
        rule = "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"
        return ["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True)).rstrip()
        for r in [header, *rows]
    ]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.2g}%"


def _label(name: str) -> str:
    return IMPLEMENTATIONS[name].label


# -- Plots -----------------------------------------------------------------------------------
class Panel(NamedTuple):
    """One set of axes: log-2 x (the measured lengths), log y, one line per series."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str | None, tuple[list[int], list[float]]]  # label -> (xs, ys)
    legend: bool = True


def _figure(path: Path, panels: list[Panel], title: str | None = None) -> None:
    # A bare Figure renders with Agg on savefig: no pyplot, no GUI backend, no global state.
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullLocator

    def minor(v: float, _pos: object) -> str:  # label 2, 5, 20, 50, ... between the powers of ten
        return f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""

    fig = Figure(figsize=(6.2 * len(panels), 4.4), layout="constrained")
    for ax, p in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for label, (xs, ys) in p.series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set(xlabel=p.xlabel, ylabel=p.ylabel, title=p.title)
        # Labelled at the measured lengths only, and plain numbers, not 6x10^1-style labels.
        ticks = sorted({x for xs, _ in p.series.values() for x in xs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(minor))
        if p.legend and len(p.series) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


def _plots(result: Mapping, out: Path) -> list[str]:
    """Draw the plots of the sections ``result`` has; returns their file names."""
    panels: dict[str, tuple[list[Panel], str | None]] = {}
    att = result["attention"]

    def series(key: str, scale: float = 1.0) -> dict[str | None, tuple[list[int], list[float]]]:
        s: dict[str | None, tuple[list[int], list[float]]] = {}
        for row in att["rows"]:
            for n, r in row["results"].items():
                xs, ys = s.setdefault(_label(n), ([], []))
                xs.append(row["seq_len"])
                ys.append(scale * r[key])
        return s

    tokens = "sequence length (tokens)"
    timing = Panel("time of forward+backward", tokens, "ms (median)", series("median_ms"))
    rate = f"fraction of the matmul rate ({result['peak_gflops']:.0f} GFLOP/s)"
    fraction = Panel(rate, tokens, "% of measured matmul rate", series("fraction_of_matmul", 100.0), legend=False)
    title = f"one causal attention layer: d={att['d_model']}, {att['num_heads']} heads, batch {att['batch']}"
    panels["attention_time.png"] = ([timing, fraction], title)
    mem = result.get("memory")
    if mem:
        # A log axis cannot show 0: anything under 0.1 MB is drawn at 0.1 (the table has the figure).
        s = {
            _label(n): (sorted(map(int, pts)), [max(0.1, pts[t]["forward_mb"]) for t in sorted(pts, key=int)])
            for n, pts in mem["results"].items()
            if pts
        }
        ylabel = "MB above the process baseline"
        panels["attention_memory.png"] = ([Panel("peak memory of one forward (no_grad)", tokens, ylabel, s)], None)
    gen = result.get("generation")
    if gen and gen["rows"]:
        xs = [r["total_len"] for r in gen["rows"]]
        s = {
            "with KV cache": (xs, [r["cached_ms_per_token"] for r in gen["rows"]]),
            "without (re-run window)": (xs, [r["uncached_ms_per_token"] for r in gen["rows"]]),
        }
        title = f"greedy generation, GPT '{gen['preset']}' ({gen['parameters'] / 1e6:.2f}M parameters)"
        panels["generation.png"] = ([Panel(title, "total tokens (prompt + generated)", "ms per new token", s)], None)
    tr = result.get("training")
    if tr and tr["rows"]:
        xs = [r["seq_len"] for r in tr["rows"]]
        ms = {None: (xs, [r["median_ms"] for r in tr["rows"]])}
        pct = {None: (xs, [100 * r["fraction_of_matmul"] for r in tr["rows"]])}
        step = Panel(f"training step, batch {tr['rows'][0]['batch']}", tokens, "ms per step", ms)
        flops = Panel("model FLOP/s as a fraction of matmul rate", tokens, "% of measured matmul rate", pct)
        panels["training.png"] = ([step, flops], f"GPT '{tr['preset']}': forward, loss, backward, AdamW step")
    for name, (ps, title) in panels.items():
        _figure(out / name, ps, title)
    return list(panels)


# -- attnlab bench: report.md ----------------------------------------------------------------
def _section(title: str, intro: str, header: list[str], rows: list[list[str]], notes: list[str], plot: str | None):
    lines = [f"## {title}", "", intro, "", *table(header, rows, markdown=True), ""]
    lines += [*notes, ""] if notes else []
    return lines + ([f"![{title}]({plot})", ""] if plot else [])


def format_markdown(result: Mapping, plots: list[str]) -> str:
    """``report.md``: the tables of every measurement of :func:`~attnlab.tools.bench.suites.run_all`,
    with the plots linked."""

    def plot(name: str) -> str | None:
        return name if name in plots else None

    L = _markdown_intro(result)
    L += _attention_markdown(result, plot("attention_time.png"))
    if result.get("memory"):
        L += _memory_markdown(result["memory"], plot("attention_memory.png"))
    if result.get("generation"):
        L += _generation_markdown(result["generation"], result["config"], plot("generation.png"))
    if result.get("training"):
        L += _training_markdown(result["training"], result["config"], plot("training.png"))
    return "\n".join(L).rstrip() + "\n"


def _markdown_intro(result: Mapping) -> list[str]:
    """The title, the machine and the run, and the matmul rate every percentage is of."""
    m, cfg, mm, end = result["machine"], result["config"], result["matmul"], result["matmul_end"]
    return [
        "# attnlab benchmark report",
        "",
        f"{m['date']}, {'quick' if cfg['is_quick'] else 'full'} run, {result['seconds']:.0f} s. torch {m['torch']}, "
        f"{m['torch_threads']} thread(s) on {m['cpus']} CPUs ({m['processor']}), Python {m['python']}, "
        f"{m['platform']}; {m.get('hardware', 'CPU class not recorded')}. "
        f"Load average {m['load_average_start'] or 0:.1f} at the start, "
        f"{m['load_average_end'] or 0:.1f} at the end (other processes competing for the cores slow every figure; "
        "competitors are interleaved so they share it).",
        "",
        "## The machine's matmul rate",
        "",
        f"`torch.mm` of two {mm['n']} x {mm['n']} float32 matrices on {m['torch_threads']} thread(s): "
        f"**{result['peak_gflops']:.1f} GFLOP/s**, the best of {mm['gflops_best']:.1f} (start of the run, median "
        f"{mm['gflops_median']:.1f}) and {end['gflops_best']:.1f} (end, median {end['gflops_median']:.1f}). "
        'Every "% of matmul" below is a measured FLOP rate divided by this best rate: the fraction of what these '
        "cores can do.",
        "",
    ]


def _attention_markdown(result: Mapping, plot: str | None) -> list[str]:
    att, cfg = result["attention"], result["config"]
    rows = att["rows"]
    names = [n for n in IMPLEMENTATIONS if any(n in r["results"] for r in rows)]
    cells = [
        [_label(n)]
        + [
            f"{r['median_ms']:.1f} ms, best {r['min_ms']:.1f} ({_pct(r['fraction_of_matmul'])})" if r else "—"
            for r in (row["results"].get(n) for row in rows)
        ]
        for n in names
    ]
    ratios = "; ".join(
        f"T={row['seq_len']}: "
        + ", ".join(f"{k} {v['of_medians']:.2f} (paired {v['paired']:.2f})" for k, v in row["ratios"].items())
        for row in rows
    )
    worst = max(max(row["max_abs_diff"].values()) for row in rows)
    return _section(
        "One causal attention layer: forward + backward",
        f"d_model {att['d_model']}, {att['num_heads']} heads, batch {att['batch']}, float32, dropout 0. Median of "
        f"{cfg['repeats']} interleaved rounds after {cfg['warmup']} warm-up; median ms, the best round's ms, and the "
        "median's FLOP rate as % of the matmul rate (FLOPs counted densely: 3 x forward). The loop runs only up to "
        f"{att['loop_max_len']} tokens (O(T^2) Python steps). The one-head rows compute one head of width "
        "d_model; the wrapper has no output projection.",
        ["implementation"] + [f"T={row['seq_len']}" for row in rows],
        cells,
        [
            f"Time ratios (lower = attnlab faster; of medians, and the median of per-round ratios): {ratios}.",
            "Outputs agree before timing: largest |difference| between implementations of the same function "
            f"{worst:.1e}.",
        ],
        plot,
    )


def _memory_markdown(mem: Mapping, plot: str | None) -> list[str]:
    lens = sorted({int(t) for pts in mem["results"].values() for t in pts})
    cells = [
        [_label(n)] + [f"{pts[str(t)]['forward_mb']:.1f}" if str(t) in pts else "—" for t in lens]
        for n, pts in mem["results"].items()
        if pts
    ]
    return _section(
        "Peak memory of one forward",
        f"MB above the process's baseline during one `torch.no_grad()` forward, batch {mem['batch']}, each point "
        "in a fresh process (after a tiny warm-up forward, so one-off library costs are in the baseline).",
        ["implementation"] + [f"T={t}" for t in lens],
        cells,
        [f"Skipped {key}: {why}." for key, why in mem["skipped"].items()],
        plot,
    )


def _generation_markdown(gen: Mapping, cfg: Mapping, plot: str | None) -> list[str]:
    cells = [
        [
            str(r["total_len"]),
            f"{r['cached_ms_per_token']:.2f}",
            f"{r['uncached_ms_per_token']:.2f}",
            f"{r['speedup']:.1f}x",
            "yes" if r["same_tokens"] else "NO",
        ]
        for r in gen["rows"]
    ]
    return _section(
        "Generation with and without the KV cache",
        f"Greedy decoding from a {gen['prompt_tokens']}-token prompt with GPT preset '{gen['preset']}' "
        f"({gen['parameters'] / 1e6:.2f}M parameters); median of {cfg['gen_repeats']} interleaved runs.",
        ["total tokens", "ms/token, cache", "ms/token, no cache", "speed-up", "same tokens"],
        cells,
        [],
        plot,
    )


def _training_markdown(tr: Mapping, cfg: Mapping, plot: str | None) -> list[str]:
    cells = [
        [
            f"{r['batch']} x {r['seq_len']}",
            f"{r['median_ms']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['gflops']:.1f}",
            _pct(r["fraction_of_matmul"]),
        ]
        for r in tr["rows"]
    ]
    return _section(
        "Training step",
        f"GPT preset '{tr['preset']}' ({tr['non_embedding_parameters'] / 1e6:.2f}M non-embedding parameters): "
        f"zero_grad, forward, cross-entropy, backward, AdamW step; median of {cfg['train_repeats']} steps after "
        "one warm-up. Model FLOPs = 6 N B T + 12 L d B T^2.",
        ["batch x tokens", "ms/step", "tokens/s", "GFLOP/s", "% of matmul"],
        cells,
        [],
        plot,
    )


def write_report(result: Mapping, out: str | os.PathLike) -> Path:
    """Write ``results.json``, the PNG plots and ``report.md`` into ``out`` (created if needed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", result)
    plots = _plots(result, out)
    # A plot an earlier run left here that this run did not draw would contradict report.md.
    for stale in set(PLOT_NAMES) - set(plots):
        (out / stale).unlink(missing_ok=True)
    atomic_write_text(out / "report.md", format_markdown(result, plots))
    return out / "report.md"


# -- benchmarks/attention.py: the goal benchmark's tables ------------------------------------
def format_attention_report(result: Mapping) -> str:
    """The tables of :func:`~attnlab.tools.bench.suites.attention_benchmark`'s result, as the script prints them."""
    lines = [*_attention_timings(result), "", *_attention_ratios(result)]
    if result.get("memory"):
        lines += _attention_memory(result)
    return "\n".join(lines)


def _attention_timings(result: Mapping) -> list[str]:
    """The run's settings and one row of times per competitor."""
    cfg, m, timings = result["config"], result["config"]["machine"], result["timings"]
    load = cfg["load_average"]
    lines = [
        "attnlab attention benchmark: forward+backward of one causal attention layer",
        f"  batch {cfg['batch']} x {cfg['seq_len']} tokens, d_model {cfg['d_model']}, {cfg['num_heads']} heads, "
        f"dropout 0, {cfg['dtype']}, {cfg['device']}; torch {m['torch']}, {m['torch_threads']} threads, "
        f"{m['cpus']} CPUs" + (f", load average {load[0]:.1f} -> {load[1]:.1f}" if None not in load else ""),
        f"  {cfg['repeats']} interleaved rounds (A,B,C,A,B,C,...) after {cfg['warmup']} warm-up; "
        "same weights in every competitor",
        f"  malloc: {cfg['allocator']}; faults = median minor page faults per step",
        "  outputs agree (max |y - y_reference|): "
        + ", ".join(f"{k} {v:.1e}" for k, v in result["max_abs_diff"].items()),
        "",
    ]
    faults = lambda t: "-" if t["median_page_faults"] is None else f"{t['median_page_faults']:.0f}"
    ms = ("median_ms", "iqr_ms", "min_ms", "max_ms")
    rows = [
        [t["label"], *(f"{t[k]:.1f}" for k in ms), f"{t['median_cpu_ms'] or 0.0:.0f}", faults(t)]
        for t in timings.values()
    ]
    text = table(["competitor", "median ms", "IQR ms", "min ms", "max ms", "CPU ms", "faults"], rows)
    if "attnlab-core" in timings:
        text.insert(
            1 + list(timings).index("attnlab-core"),
            "attention alone (packed q, k, v in, no projections; same interleaving):",
        )
    return lines + text


def _attention_ratios(result: Mapping) -> list[str]:
    """The time ratios, each against its goal (judged only at the shape the goals are set for)."""
    goals, shape = result["goals"], result["goal_shape"]
    time_goal = (
        f"(goal is for batch {shape['batch']} x {shape['seq_len']}, d {shape['d_model']}, {shape['num_heads']} heads)"
    )
    rows = []
    for key, r in result["ratios"].items():
        if key.startswith("memory"):
            continue
        goal = goals.get(key)
        if goal is None or not result["goals_apply"]["time"]:
            verdict = "" if goal is None else time_goal
        else:
            verdict = "met" if r["of_medians"] <= goal else "MISSED"
        ratios = [f"{r[k]:.2f}" for k in ("of_medians", "paired", "cpu")]
        rows.append([key, *ratios, "-" if goal is None else f"<= {goal:.2f}", verdict])
    return table(["ratio (lower = attnlab faster)", "medians", "paired", "CPU", "goal", ""], rows, align="lrrrrl")


def _attention_memory(result: Mapping) -> list[str]:
    """The peak memory of each competitor's forward, and the memory ratio against its goal."""
    mem, shape = result["memory"], result["goal_shape"]
    lines = [
        "",
        f"peak memory of one forward (torch.no_grad), batch {mem['batch']} x {mem['seq_len']} tokens, "
        "each in a fresh process",
    ]
    mb = ("forward_mb", "baseline_mb", "peak_mb")
    rows = [
        [_label(name), *(f"{r[k]:.0f}" for k in mb), f"{r['seconds']:.1f}", "" if r["exact"] else "(upper bound)"]
        for name, pts in mem["results"].items()
        for r in pts.values()
    ]
    lines += table(["competitor", "forward MB", "baseline MB", "peak MB", "time s", ""], rows, align="lrrrrl")
    if mem["results"].get("torch"):
        lines.append(
            "  (torch.nn.MultiheadAttention in eval mode under no_grad takes its inference fast path, "
            "which forms the masked scores)"
        )
    lines += [f"{_label(key.split('@')[0])}: skipped: {why}" for key, why in mem["skipped"].items()]
    r = result["ratios"].get("memory attnlab/tutorial")
    if r is not None:
        goal = result["goals"]["memory attnlab/tutorial"]
        verdict = "met" if r <= goal else "MISSED"
        if not result["goals_apply"]["memory"]:
            verdict = (
                f"(goal is for {shape['memory_seq_len']} tokens, d {shape['d_model']}, {shape['num_heads']} heads)"
            )
        lines.append(f"ratio attnlab / tutorial: {r:.3f}   goal <= {goal:.2f}  {verdict}")
    return lines
