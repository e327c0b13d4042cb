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
    python examples/badlm_v2.py --gpt2-dir DIR    # DIR holds GPT-2's encoder.json + vocab.bpe
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from attnlab import MultiHeadAttention

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
# Data: the exercise's dataset and loader
# --------------------------------------------------------------------------------------------
class MyData(Dataset):
    """Sliding windows: inputs ``ids[i : i+L]`` and targets shifted by one, every ``stride`` tokens."""

    def __init__(self, text, tokenizer, context_length, stride=1):
        self.input_ids = []
        self.target_ids = []
        token_ids = tokenizer.encode(text)
        for i in range(0, len(token_ids) - context_length, stride):
            self.input_ids.append(torch.tensor(token_ids[i : i + context_length]))
            self.target_ids.append(torch.tensor(token_ids[i + 1 : i + context_length + 1]))

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, idx):
        return self.input_ids[idx], self.target_ids[idx]


def my_batch(text, tokenizer, batch_size, context_length, stride, shuffle=True, drop_last=True, num_workers=0):
    """The exercise's ``my_batch``, with the tokenizer passed in (so it can be built offline)."""
    dataset = MyData(text, tokenizer, context_length, stride)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, num_workers=num_workers)


def gpt2_tokenizer(local_dir: Path | None):
    """tiktoken's GPT-2 BPE; built from a local ``encoder.json`` + ``vocab.bpe`` when offline."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network and nothing cached
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        d = local_dir or SHARED_DATA / "gpt2"
        if not (d / "encoder.json").is_file() or not (d / "vocab.bpe").is_file():
            sys.exit(
                f"cannot download GPT-2's tokenizer ({type(e).__name__}) and {d} lacks encoder.json + vocab.bpe; "
                f"go online once or pass --gpt2-dir"
            )
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(d / "vocab.bpe"), encoder_json_file=str(d / "encoder.json")
        )
        # GPT-2's pre-tokenisation regex (tiktoken's r50k pattern) and its one special token.
        pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
        return tiktoken.Encoding(
            name="gpt2", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
        )


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps after the exercise (0: skip)")
    ap.add_argument("--text", type=Path, default=SHARED_DATA / "the-verdict.txt", help="training text")
    ap.add_argument("--gpt2-dir", type=Path, default=None, help="directory with encoder.json + vocab.bpe")
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args(argv)
    tokenizer = gpt2_tokenizer(args.gpt2_dir)

    # 1. The exercise, as written: an untrained model's argmax predictions on a tiny sentence.
    torch.manual_seed(args.seed)
    text = "This is a very useless sentence that talks about itself."
    batch_size, context_length, vocab_size = 2, 4, 50257
    loader = my_batch(text, tokenizer, batch_size, context_length, 1)
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
    if not args.text.is_file():
        sys.exit(f"{args.text} not found; pass --text FILE or --steps 0")

    # 3. Train a smaller BadLM_V2 for a few steps and let it write.
    torch.manual_seed(args.seed)
    ctx = 32
    corpus = args.text.read_text(encoding="utf-8")
    loader = my_batch(corpus, tokenizer, batch_size=8, context_length=ctx, stride=ctx // 2)
    lm = BadLM_V2(ctx, tokenizer.n_vocab, 64, 64, 4)
    opt = torch.optim.AdamW(lm.parameters(), lr=5e-3, weight_decay=0.01)
    step, t0 = 0, time.perf_counter()
    print(f"\ntraining on {args.text.name}: {len(loader.dataset)} windows of {ctx} tokens")
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
