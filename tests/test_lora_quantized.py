"""LoRA on a frozen quantized base: the dense model's loss and adapter gradients, while autograd keeps
no dense copy of an adapted weight (an 8B model's q, k, v and o would be 5 GB in float32)."""

from __future__ import annotations

import gguf
import pytest
import torch

from attnlab import GPT, GPTConfig
from attnlab.quantized import QuantizedTensor, is_quantized
from attnlab.training.lora import LoRASettings, LowRankUpdated, apply_lora, merge_lora

Q8 = gguf.GGMLQuantizationType.Q8_0


def twins(seed: int = 0) -> tuple[GPT, GPT]:
    """A tiny Llama-like GPT with its matrices in Q8_0 blocks, and its dense twin of the same values."""
    cfg = GPTConfig.preset("tiny", drop_rate=0.0, vocab_size=512)
    torch.manual_seed(seed)
    dense = GPT(cfg)
    quant = GPT(cfg)
    quant.load_state_dict(dense.state_dict())
    for name, p in dense.named_parameters():
        if p.dim() == 2 and "emb" not in name and p.shape[1] % 32 == 0:
            raw = gguf.quants.quantize(p.detach().numpy(), Q8)
            values = gguf.quants.dequantize(raw, Q8).reshape(p.shape)
            with torch.no_grad():
                p.copy_(torch.from_numpy(values))
            module_name, _, attr = name.rpartition(".")
            setattr(quant.get_submodule(module_name), attr, torch.nn.Parameter(
                QuantizedTensor.from_blocks("Q8_0", raw, tuple(p.shape)), requires_grad=False))  # fmt: skip
    return dense, quant


def test_lora_on_quantized_weights_is_the_dense_models_and_keeps_no_dense_weight():
    dense, quant = twins()
    settings = LoRASettings.make(4, targets="q,k,v,o,up,down")
    apply_lora(dense, settings)
    apply_lora(quant, settings)
    mine = [p for p in dense.parameters() if p.requires_grad]
    theirs = [p for p in quant.parameters() if p.requires_grad]
    with torch.no_grad():  # the same adapters; B made nonzero, so the update counts in the forward
        for a, b in zip(mine, theirs, strict=True):
            b.copy_(torch.nn.init.normal_(a, std=0.1))
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    adapted = [m.weight for m in quant.modules() if hasattr(m, "parametrizations")]
    assert adapted and all(isinstance(w, LowRankUpdated) for w in adapted)
    big = {tuple(w.shape) for w in adapted}
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_q = quant.loss(idx[:, :-1], idx[:, 1:])
    loss_d = dense.loss(idx[:, :-1], idx[:, 1:])
    loss_q.backward()
    loss_d.backward()
    torch.testing.assert_close(loss_q, loss_d, rtol=1e-5, atol=1e-6)
    assert mine and all(b.grad is not None for b in theirs)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
    assert not big & set(saved), f"autograd kept a dense adapted weight: {sorted(big & set(saved))}"


@pytest.mark.parametrize("targets", ["up,down", "q,k,v,o,up,down"])
def test_lora_on_a_quantized_base_under_bfloat16_autocast_is_the_dense_models(targets):
    # Regression: q, k and v left quantized are concatenated for one product, and autocast refused the
    # float16 scales of their blocks ("Unexpected floating ScalarType"): --precision bf16 (the default on
    # bf16 CPUs and GPUs) crashed on the first step unless q, k and v were adapted.
    dense, quant = twins(2)
    settings = LoRASettings.make(2, targets=targets)
    apply_lora(dense, settings)
    apply_lora(quant, settings)
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (dense, quant):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.detach().float())
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=0.0)  # (bfloat16's products: 8 bits)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in quant.parameters() if p.requires_grad)


def test_merging_adapters_of_a_quantized_base_gives_the_dense_merge():
    dense, quant = twins(1)
    settings = LoRASettings.make(2, targets="q,o,down")
    apply_lora(dense, settings)
    apply_lora(quant, settings)
    with torch.no_grad():
        for a, b in zip(*([p for p in m.parameters() if p.requires_grad] for m in (dense, quant)), strict=True):
            b.copy_(torch.nn.init.normal_(a, std=0.1))
    idx = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    merge_lora(dense.eval())
    merge_lora(quant.eval())
    merged = [quant.trf_blocks[0].att.W_query.weight, quant.trf_blocks[0].att.out_proj.weight]
    assert all(type(w) is torch.nn.Parameter and type(w.data) is torch.Tensor for w in merged)
    with torch.no_grad():
        torch.testing.assert_close(quant(idx), dense(idx), rtol=1e-5, atol=1e-5)


def test_the_head_and_neuron_hook_points_of_an_adapted_quantized_model_are_the_dense_models():
    """``attn.hook_result`` splits the output projection's weight by head and ``mlp.hook_post`` reads the
    neurons: on quantized weights with adapters, the same values as the dense twin's."""
    from attnlab.interpret import run_with_cache

    dense, quant = twins(seed=1)
    settings = LoRASettings.make(4, targets="o,down")
    apply_lora(dense, settings)
    apply_lora(quant, settings)
    with torch.no_grad():
        for a, b in zip(
            [p for p in dense.parameters() if p.requires_grad],
            [p for p in quant.parameters() if p.requires_grad],
            strict=True,
        ):
            b.copy_(torch.nn.init.normal_(a, std=0.1))
    idx = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    names = ["blocks.0.attn.hook_result", "blocks.1.mlp.hook_post", "blocks.1.hook_mlp_out"]
    (logits_q, cache_q), (logits_d, cache_d) = run_with_cache(quant, idx, names), run_with_cache(dense, idx, names)
    for name in names:
        torch.testing.assert_close(cache_q[name], cache_d[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits_q, logits_d, rtol=1e-5, atol=1e-5)


def test_fine_tuning_a_gguf_file_trains_every_weight_or_lora_beside_its_blocks(tmp_path, capsys):
    """``train --init-from FILE.gguf``: without LoRA every weight trains (the file loads dense; its blocks
    would be frozen); with ``--lora-rank`` the base keeps its blocks. The library's Trainer refuses a
    quantized model to train in full, by name, rather than train its norms alone."""
    from attnlab.cli import main
    from attnlab.tools.loading import load_pretrained
    from attnlab.training import TrainConfig, Trainer
    from gguf_files import write_gguf

    path = write_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    data = tmp_path / "text.txt"
    data.write_text("the cat sat on the mat and the dog sat on the log. " * 40, encoding="utf-8")
    base = ["train", "--init-from", str(path), "--data", str(data), "--max-steps", "1", "--batch-size", "2"]
    base += ["--context-length", "16", "--no-progress"]
    for extra, want in [([], " parameters, context"), (["--lora-rank", "2"], "with LoRA rank 2")]:
        capsys.readouterr()
        assert main([*base, *extra, "--out", str(tmp_path / f"run{len(extra)}")]) == 0
        out, err = capsys.readouterr()
        assert want in out + err
    init = load_pretrained(str(path))  # (its blocks kept)
    config = TrainConfig(init_from=str(path), data=str(data), max_steps=1, batch_size=2, out=str(tmp_path / "lib"))
    with pytest.raises(ValueError, match="keeps weights in a GGUF file's blocks, which are frozen"):
        Trainer(config, init=init)


def test_a_lora_run_on_a_gguf_file_resumes_on_its_blocks_exactly(tmp_path):
    # The checkpoint held the base dequantized; resuming on that dense copy summed in another order
    # (losses apart in the 7th digit) with five times the memory. It now holds the file's blocks.
    import json
    import shutil

    from attnlab.cli import main
    from attnlab.training.checkpoint import load_checkpoint
    from gguf_files import write_gguf

    path = write_gguf(tmp_path / "m.gguf", qtype="Q4_0")
    data = tmp_path / "text.txt"
    data.write_text("the cat sat on the mat and the dog sat on the log. " * 40, encoding="utf-8")

    def train(out, *extra):
        args = ["train", "--init-from", str(path), "--data", str(data), "--out", str(out), "--batch-size", "2"]
        args += ["--context-length", "16", "--no-progress", "--precision", "fp32", "--lora-rank", "2", "--seed", "3"]
        args += ["--eval-every", "2", "--checkpoint-every", "2", "--eval-batches", "1", "--sample-tokens", "0"]
        assert main([*args, *extra]) == 0

    train(tmp_path / "full", "--max-steps", "4")
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-00000002", half / "checkpoints" / "step-00000002")
    (half / "latest.json").write_text(
        json.dumps({"format": "attnlab-checkpoint", "step": 2, "path": "checkpoints/step-00000002"})
    )
    train(half, "--resume", "--max-steps", "4")
    rows = [
        [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (tmp_path / "full", half)
    ]
    assert [r["loss"] for r in rows[1]] == [r["loss"] for r in rows[0][2:]]
    assert [r.get("val_loss") for r in rows[1]] == [r.get("val_loss") for r in rows[0][2:]]
    # The resumed run's base is the file's blocks, and so is what a reader of the checkpoint gets.
    from attnlab.training import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(out=str(half), resume=True, max_steps=6), given={"max_steps"})
    try:
        assert any(is_quantized(p) for p in trainer.raw_model.parameters())
    finally:
        trainer.close()
    assert any(is_quantized(p) for p in load_checkpoint(half, load_optimizer=False).model.parameters())
    weights = half / "checkpoints" / "step-00000004" / "model.safetensors"
    assert weights.stat().st_size < 1.5 * path.stat().st_size  # (the dense float32 base: about 5x)


def test_a_merge_of_a_lora_run_on_a_gguf_file_keeps_its_blocks_and_trains_again_in_full(tmp_path, capsys):
    # Checkpoints and --merge keep a GGUF base's blocks: --init-from that directory without LoRA
    # must make them dense to train every weight (it was refused as a model kept in a file's blocks).
    from attnlab.cli import main
    from attnlab.training.checkpoint import load_checkpoint
    from gguf_files import write_gguf

    path = write_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    data = tmp_path / "text.txt"
    data.write_text("the cat sat on the mat and the dog sat on the log. " * 40, encoding="utf-8")
    args = ["--data", str(data), "--max-steps", "1", "--batch-size", "2", "--context-length", "16", "--no-progress"]
    args += ["--sample-tokens", "0", "--precision", "fp32"]
    merged = tmp_path / "merged"
    assert main(["train", "--init-from", str(path), *args, "--lora-rank", "2", "--out", str(tmp_path / "a"),
                 "--merge", str(merged)]) == 0  # fmt: skip
    model = GPT.load(merged)
    assert any(is_quantized(p) for p in model.parameters())  # (the layers LoRA did not adapt)
    idx = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_checkpoint(tmp_path / "a", load_optimizer=False, merge_adapters=True).model.eval()(idx)
        torch.testing.assert_close(model.eval()(idx), want, rtol=0, atol=1e-6)
        dense = GPT.load(merged).dequantize_()
        assert not any(is_quantized(p) or not p.requires_grad for p in dense.parameters())
        assert dense.out_head.weight is dense.tok_emb.weight or not dense.config.tie_embeddings
        torch.testing.assert_close(dense.eval()(idx), want, rtol=0, atol=1e-5)
    assert main(["train", "--init-from", str(merged), *args, "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
