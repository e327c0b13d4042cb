"""The attention-review exercises' ``BadLM_V2``, rebuilt on attnlab, with its position bug fixed.

The exercises ("Concept Questions" / "Attention Review") end with a toy language model: token
embeddings + position embeddings -> multi-head attention -> a linear layer to vocabulary logits,
fed by a sliding-window dataset of GPT-2 BPE tokens. This script runs that pipeline on attnlab's
``MultiHeadAttention``, then trains a small one for a few steps and samples from it.

The bug. The original builds the position embedding as ``nn.Embedding(vocab_size, emb_dim)``:
one vector per *token id* (50257 of them) instead of one per *position* (``context_length``).
It still runs, because positions ``0..context_length-1`` are valid rows of the bigger table, so the
mistake is silent: it adds 50257 x 768 = 38.6M parameters of which only ``context_length`` rows
are ever used or trained. Its forward pass also adds ``pos_embs(torch.arange(self.context_length))``
whatever the input length, so a batch shorter than ``context_length`` fails with a shape error, and
the ``arange`` is created on the CPU even when the model is on a GPU. The fixed version sizes the
table by ``context_length`` and indexes it with ``arange(N, device=x.device)`` for ``N`` input tokens.

Run (offline is fine: GPT-2's tokenizer is built from local files when it cannot be downloaded)::

    python examples/badlm_v2.py                   # the exercise, then 100 training steps
    python examples/badlm_v2.py --steps 0         # just the exercise
    python examples/badlm_v2.py --bpe-dir DIR     # DIR holds GPT-2's encoder.json + vocab.bpe
    python examples/badlm_v2.py --text FILE       # train on FILE (default: the-verdict.txt when the
                                                  # repository's test data is there, else Python's docs)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from attnlab import MultiHeadAttention
from attnlab.data import builtin_corpus, create_dataloader
from attnlab.tokenizers import TokenizerLoadError, get_tokenizer

HERE = Path(__file__).resolve()
SHARED_DATA = HERE.parents[2] / "shared" / "data"  # checkout at X/main, test data at X/shared/data


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
class BadLM_V2(nn.Module):
    """Embeddings -> one multi-head causal attention layer -> vocabulary logits.

    Same constructor as the exercise. Input ``x (B, N)`` token ids with ``N <= context_length``;
    output ``(B, N, vocab_size)`` logits.
    """

    def __init__(self, context_length, vocab_size, emb_dim, att_dim, num_heads, *, buggy=False):
        super().__init__()
        self.context_length = context_length
        self.emb_dim = emb_dim
        self.att_dim = att_dim
        self.num_heads = num_heads
        self.vocab_size = vocab_size
        self.token_embs = nn.Embedding(vocab_size, emb_dim)
        # FIX: one learned vector per position 0..context_length-1. The exercise wrote
        # nn.Embedding(vocab_size, emb_dim) (kept behind buggy=True to measure the damage).
        self.pos_embs = nn.Embedding(vocab_size if buggy else context_length, emb_dim)
        # The exercise's MultiHeadAttentionOneModule(emb_dim, att_dim, num_heads, context_length),
        # as attnlab's MultiHeadAttention: keyword arguments, since the tutorials order them differently.
        self.att = MultiHeadAttention(
            d_in=emb_dim, d_out=att_dim, num_heads=num_heads, context_length=context_length, dropout=0.0
        )
        self.prediction_layer = nn.Linear(att_dim, vocab_size)
        self.buggy = buggy

    def forward(self, x):
        # x is B x N
        # The exercise's line, torch.arange(self.context_length), always makes context_length
        # positions, on the CPU. FIX: as many positions as there are tokens, where the tokens are.
        n = self.context_length if self.buggy else x.shape[1]
        positions = torch.arange(n, device=None if self.buggy else x.device)  # (N,)
        embedding = self.token_embs(x) + self.pos_embs(positions)  # (B, N, emb_dim)
        context_embedding = self.att(embedding)  # (B, N, att_dim)
        prediction = self.prediction_layer(context_embedding)  # (B, N, vocab_size)
        return prediction


# --------------------------------------------------------------------------------------------
# Data: the exercise's MyData / my_batch are attnlab.data.create_dataloader (same sliding windows)
# --------------------------------------------------------------------------------------------
def gpt2_tokenizer(bpe_dir: Path | None):
    """GPT-2's BPE (attnlab's tiktoken wrapper); from ``bpe_dir``'s ``encoder.json`` + ``vocab.bpe``
    when given, else downloaded (once, then cached), else from the repository's test data."""
    try:
        return get_tokenizer("gpt2", bpe_dir=bpe_dir)
    except TokenizerLoadError as e:  # offline and nothing cached
        local = SHARED_DATA / "gpt2"
        if bpe_dir is None and (local / "encoder.json").is_file() and (local / "vocab.bpe").is_file():
            return get_tokenizer("gpt2", bpe_dir=local)
        sys.exit(str(e))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps after the exercise (0: skip)")
    ap.add_argument(
        "--text",
        type=Path,
        default=None,
        help="training text (default: the-verdict.txt from the test data if present, else the built-in corpus)",
    )
    ap.add_argument(
        "--bpe-dir",
        "--gpt2-dir",
        dest="gpt2_dir",
        type=Path,
        default=None,
        help="directory with encoder.json + vocab.bpe",
    )
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args(argv)
    tokenizer = gpt2_tokenizer(args.gpt2_dir)

    # 1. The exercise, as written: an untrained model's argmax predictions on a tiny sentence.
    torch.manual_seed(args.seed)
    text = "This is a very useless sentence that talks about itself."
    batch_size, context_length, vocab_size = 2, 4, 50257
    # The exercise's my_batch(text, batch_size, context_length, stride): same windows and order.
    loader = create_dataloader(
        text, batch_size=batch_size, context_length=context_length, stride=1, tokenizer=tokenizer
    )
    model = BadLM_V2(context_length, vocab_size, 768, 768, 3)
    predictions = []
    with torch.no_grad():
        for inputs, _target in loader:
            output = model(inputs)  # (2, 4, 50257)
            predictions.append(torch.argmax(output, dim=-1))
    print("untrained predictions (random weights: noise, as in the exercise):")
    print(predictions)

    # 2. What the bug cost.
    buggy = BadLM_V2(context_length, vocab_size, 768, 768, 3, buggy=True)
    n_fixed = sum(p.numel() for p in model.parameters())
    n_buggy = sum(p.numel() for p in buggy.parameters())
    print(
        f"\nposition table sized by vocab_size: {n_buggy:,} parameters; by context_length: {n_fixed:,} "
        f"({(n_buggy - n_fixed) / 1e6:.1f}M never-used rows removed)"
    )
    short = torch.tensor([[464, 3290]])  # 2 tokens, fewer than context_length=4
    try:
        buggy(short)
    except RuntimeError as e:
        print(f"buggy model on a 2-token input: {type(e).__name__}: {str(e).splitlines()[0]}")
    print(f"fixed model on a 2-token input: logits {tuple(model(short).shape)}")

    if args.steps <= 0:
        return 0
    if args.text is not None and not args.text.is_file():
        sys.exit(f"{args.text} not found; pass --text FILE or --steps 0")
    verdict = SHARED_DATA / "the-verdict.txt"
    if args.text is not None:
        corpus, corpus_name = args.text.read_text(encoding="utf-8"), args.text.name
    elif verdict.is_file():
        corpus, corpus_name = verdict.read_text(encoding="utf-8"), verdict.name
    else:  # users have no shared/ test data: Python's own documentation topics
        corpus, corpus_name = builtin_corpus(), "the built-in corpus"

    # 3. Train a smaller BadLM_V2 for a few steps and let it write.
    torch.manual_seed(args.seed)
    ctx = 32
    loader = create_dataloader(corpus, batch_size=8, context_length=ctx, stride=ctx // 2, tokenizer=tokenizer)
    lm = BadLM_V2(ctx, tokenizer.vocab_size, 64, 64, 4)
    opt = torch.optim.AdamW(lm.parameters(), lr=5e-3, weight_decay=0.01)
    step, t0 = 0, time.perf_counter()
    print(f"\ntraining on {corpus_name}: {len(loader.dataset)} windows of {ctx} tokens")
    while step < args.steps:
        for inputs, targets in loader:
            logits = lm(inputs)  # (8, 32, vocab)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step == 1 or step % 25 == 0 or step == args.steps:
                print(f"step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f}s)")
            if step == args.steps:
                break

    ids = torch.tensor([tokenizer.encode("I had always thought")])
    lm.eval()
    with torch.no_grad():
        for _ in range(30):  # greedy; one attention layer has little to say, but it has learnt words
            nxt = lm(ids[:, -ctx:])[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    print("sample:", repr(tokenizer.decode(ids[0].tolist())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
