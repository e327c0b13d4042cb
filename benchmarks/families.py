"""Each model family against transformers: logit and attention-weight agreement, greedy decoding speed.

The models are the small seeded ones of ``tests/test_families.py`` (imported from there, so the
figures are those of the configurations the tests check), one per family, float32 on the CPU:

* agreement: the largest ``|attnlab - transformers|`` of the logits of a (2, 17) batch and of the
  attention weights (attnlab's traced weights against transformers' eager ``output_attentions``);
* speed: greedy continuation of a 5-token prompt by ``--new`` tokens, attnlab (KV cache) against
  ``generate`` of transformers (its cache), interleaved round by round; medians, and the ratio.

    python benchmarks/families.py              # 3 rounds, 64 new tokens
    python benchmarks/families.py --rounds 5 --new 128
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

from attnlab import hardware
from attnlab.interpret import trace
from attnlab.model import GPT
from attnlab.tools.bench import interleave

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_families import CASES, V, build  # (the tests' configurations)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="attnlab's model families against transformers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64, help="tokens to generate")
    args = ap.parse_args(argv)
    print(hardware.header("cpu"), flush=True)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"load average {os.getloadavg()[0]:.1f}; {args.rounds} interleaved rounds, medians"
    )
    head = f"{'family':<16} {'max|logit diff|':>16} {'max|weight diff|':>17} {'attnlab tok/s':>14} {'HF tok/s':>9}"
    print(head + " ratio")
    for name in CASES:
        hf = build(name, seed=1)
        ours = GPT.from_hf(hf)
        idx = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            logit_diff = (ours(idx) - hf(idx).logits).abs().max().item()
            want = torch.stack(hf(idx[:1, :11], output_attentions=True).attentions)
        weight_diff = (trace(ours, idx[:1, :11]).weights - want).abs().max().item()
        prompt = idx[:1, :5]
        hf.generation_config.eos_token_id = None
        mask = torch.ones_like(prompt)

        def theirs(hf=hf, prompt=prompt, mask=mask) -> None:
            with torch.no_grad():
                hf.generate(prompt, attention_mask=mask, max_new_tokens=args.new, do_sample=False, pad_token_id=0)

        def attnlab(ours=ours, prompt=prompt) -> None:
            ours.generate(prompt, args.new, temperature=0)

        t = interleave({"attnlab": attnlab, "transformers": theirs}, args.rounds, warmup=1, alternate=True)
        tps = {k: args.new / (statistics.median(v.times_ms) / 1000) for k, v in t.items()}
        print(
            f"{name:<16} {logit_diff:>16.1e} {weight_diff:>17.1e} {tps['attnlab']:>14.0f} {tps['transformers']:>9.0f} "
            f"{tps['attnlab'] / tps['transformers']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
