"""LoRA adapters written in PEFT's layout: ``peft.PeftModel.from_pretrained`` on the Hugging Face
model of the same weights computes what the adapted attnlab model does, for families whose
matrices map one to one (Llama), stack (the gated MLP's gate and up) or fuse q, k and v (GPT-2's
transposed ``c_attn``, Phi-3's ``qkv_proj``, GPT-NeoX's per-head ``query_key_value``)."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.formats.families import to_hf_state_dict
from attnlab.model import GPT
from attnlab.training.lora import LoRASettings, apply_lora, base_weights, peft_adapter, save_peft_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
CASES = {  # model_type -> (config, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
}


def hf_model(model_type: str) -> torch.nn.Module:
    cfg_cls, model_cls, extra = CASES[model_type]
    if model_type == "gpt2":
        config = transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    else:
        config = getattr(transformers, cfg_cls)(**SIZES, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


@pytest.mark.parametrize("targets", ["q,k,v,o,up,down", "v,up"])
@pytest.mark.parametrize("model_type", list(CASES))
def test_peft_loads_the_adapters_and_computes_the_same_logits(model_type, targets, tmp_path):
    hf = hf_model(model_type)
    ours = GPT.from_hf(hf)
    apply_lora(ours, LoRASettings.make(4, 16.0, targets))
    with torch.no_grad():  # B starts at zero (no update): random, so every adapter changes the logits
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3)
    idx = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(idx)
        base = hf(idx).logits
    save_peft_adapter(ours, model_type, tmp_path / "adapter")
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = adapted(idx).logits
    assert (expected - base).abs().max() > 1e-2  # (the adapters matter)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0


def test_a_model_without_adapters_or_of_another_family_is_refused():
    ours = GPT.from_hf(hf_model("llama"))
    with pytest.raises(ValueError, match="model has no LoRA adapters"):
        peft_adapter(ours, "llama")
    apply_lora(ours, LoRASettings.make(2))
    with pytest.raises(ValueError, match="model_type must be one of"):
        peft_adapter(ours, "bert")
    with pytest.raises(ValueError):  # a Llama's switches are not GPT-NeoX's
        peft_adapter(ours, "gpt_neox")


def test_bad_arguments_are_named(tmp_path):
    hf = hf_model("llama")
    ours = GPT.from_hf(hf)
    apply_lora(ours, LoRASettings.make(2))
    with pytest.raises(TypeError, match="model must be an attnlab GPT with LoRA adapters, got LlamaForCausalLM"):
        save_peft_adapter(hf, "llama", tmp_path / "a")
    with pytest.raises(ValueError, match="model_type must be one of"):
        save_peft_adapter(ours, ["llama"], tmp_path / "a")  # (unhashable: a TypeError from the dict)
    for directory in ("", None):  # ("" wrote into the working directory)
        with pytest.raises(TypeError, match="directory must be a directory's path"):
            save_peft_adapter(ours, "llama", directory)
    (tmp_path / "file").write_text("x")
    for directory in (tmp_path / "file", tmp_path / "file" / "under"):
        with pytest.raises(ValueError, match="is a file, or lies under one"):
            save_peft_adapter(ours, "llama", directory)
    assert not (tmp_path / "a").exists()


def test_the_base_of_an_adapted_model_exports_inside_base_weights():
    hf = hf_model("llama")
    ours = GPT.from_hf(hf)
    apply_lora(ours, LoRASettings.make(2))
    with pytest.raises(ValueError, match="model has LoRA adapters: export its base inside"):
        to_hf_state_dict(ours, "llama")  # (said "it is not a llama model")
    with base_weights(ours):
        exported = to_hf_state_dict(ours, "llama")
    for name, t in hf.state_dict().items():
        torch.testing.assert_close(exported[name], t, rtol=0, atol=0)
