"""Where the tests find the project's test data: ``../shared/data`` beside the checkout.

The files are never copied into the repository; tests that need one skip, saying which, when
it is absent. The GPT-2 tokenizer built from them is the ``gpt2`` fixture of ``conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GPT2_BPE_DIR = SHARED_DATA / "gpt2"  # encoder.json + vocab.bpe: tiktoken's gpt2 encoding, offline
SEEDS = SHARED_DATA.parent / "seeds"  # the tutorials' texts, where their printed numbers come from


def gpt2_bpe_missing() -> str | None:
    """Why the GPT-2 BPE files cannot be used (a skip reason), or None when both are there."""
    if (GPT2_BPE_DIR / "encoder.json").is_file() and (GPT2_BPE_DIR / "vocab.bpe").is_file():
        return None
    return f"GPT-2 BPE files (encoder.json, vocab.bpe) not found in {GPT2_BPE_DIR}"
