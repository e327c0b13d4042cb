"""The logit lens on a model whose unembedding is quantized: the dense model's lens, from slices of the
blocks (never a dense copy of the whole matrix: an 8B model's head is 2 GB in float32)."""

from __future__ import annotations

import gguf
import torch

from attnlab import GPT, GPTConfig
from attnlab.interpret import logit_lens, trace
from attnlab.quantized import QuantizedTensor


def quantized_head(model: GPT) -> tuple[QuantizedTensor, torch.Tensor]:
    """``model.out_head.weight`` in Q8_0 blocks (gguf's quantizer), and those blocks' dense values."""
    w = model.out_head.weight.detach().numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    q = QuantizedTensor.from_blocks("Q8_0", raw, tuple(w.shape))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape).copy())
    return q, dense


def test_the_lens_of_a_quantized_head_equals_the_dense_heads_without_a_whole_copy(monkeypatch):
    cfg = GPTConfig.preset("tiny", vocab_size=2 * 8192 + 64, drop_rate=0.0)  # (the head in slices of 8192 rows)
    torch.manual_seed(0)
    dense = GPT(cfg).eval()
    q, values = quantized_head(dense)
    with torch.no_grad():
        dense.out_head.weight.copy_(values)
    quant = GPT(cfg).eval()
    quant.load_state_dict(dense.state_dict())
    quant.out_head.weight = torch.nn.Parameter(q, requires_grad=False)
    whole = []
    original = QuantizedTensor.dequantize
    monkeypatch.setattr(
        QuantizedTensor, "dequantize", lambda self, dtype=None: whole.append(self.shape[0]) or original(self, dtype)
    )
    idx = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = logit_lens(quant, trace(quant, idx, stages=True), k=5)
        ref = logit_lens(dense, trace(dense, idx, stages=True), k=5)
    assert torch.equal(ours.tokens, ref.tokens)
    torch.testing.assert_close(ours.probs, ref.probs, rtol=1e-4, atol=1e-6)
    assert cfg.vocab_size not in whole, "the whole unembedding was dequantized at once"
