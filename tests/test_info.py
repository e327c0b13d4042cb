"""``attnlab info``: the kernels it lists are the ones that run, and they compute attention.

``available_sdpa_kernels`` is checked against ``F.scaled_dot_product_attention`` itself: each
listed backend, forced with ``sdpa_kernel``, must compute causal attention equal to explicit
float64 loops (on other inputs than the probe's), and each backend it leaves out must refuse.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlab import causal_mask
from attnlab.cli import main
from attnlab.tools.info import available_sdpa_kernels

# The devices the probe can be checked on here; (device, dtype, tolerance against float64).
CASES = [("cpu", torch.float32, 1e-5)]
if torch.cuda.is_available():
    CASES += [("cuda", torch.float32, 1e-3), ("cuda", torch.bfloat16, 2e-2)]  # float32 may use TF32


@pytest.mark.parametrize(("device", "dtype", "tol"), CASES)
def test_listed_kernels_compute_causal_attention(device, dtype, tol, ref):
    listed = available_sdpa_kernels(device, dtype)
    assert "math" in listed  # the reference kernel runs everywhere
    assert len(set(listed)) == len(listed) and set(listed) <= {n.lower() for n in SDPBackend.__members__}
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 5, 64, generator=g) for _ in range(3))  # (B, H, T, hd)
    want, _ = ref.loop_attention_nd(q, k, v, allowed=causal_mask(5))
    for name in listed:
        with sdpa_kernel(SDPBackend.__members__[name.upper()]):
            got = F.scaled_dot_product_attention(*(t.to(device, dtype) for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol, msg=f"{name} on {device}")


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch says why each refused kernel cannot run
@pytest.mark.parametrize(("device", "dtype", "tol"), CASES)
def test_unlisted_kernels_refuse(device, dtype, tol):
    del tol
    listed = available_sdpa_kernels(device, dtype)
    q = torch.randn(1, 2, 8, 64, device=device, dtype=dtype)
    unlisted = [b for name, b in SDPBackend.__members__.items() if name != "ERROR" and name.lower() not in listed]
    for backend in unlisted:
        with pytest.raises(RuntimeError), sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_info_prints_versions_and_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert "SDPA kernels on cpu (float32): " + ", ".join(available_sdpa_kernels("cpu", torch.float32)) in out


@pytest.mark.parametrize("native", [False, True])
def test_info_prints_what_the_cpu_does_natively_and_what_auto_picks(native, capsys, monkeypatch):
    from attnlab import hardware

    monkeypatch.setattr(hardware, "bf16_native", lambda device="cpu": native)
    assert main(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cpu: "))
    want = "bfloat16" if native else "float32"
    assert f", {hardware.cpu_capability()}, native bf16: {'yes' if native else 'no'} -> " in line
    assert f"training --precision auto = {want} " in line and line.endswith(f"bf16 weights run in {want}")


# --------------------------------------------------------------------------------------------
# attnlab info --kv-memory
# --------------------------------------------------------------------------------------------
def test_kv_formula_reproduces_llms_from_scratch():
    """LLMs-from-scratch's GQA memory estimator prints, for emb_dim 4096, 32 heads, 32 layers,
    32,768 tokens, bf16: 'MHA total KV cache : 17.18 GB', 'GQA total KV cache : 4.29 GB' (8 KV heads)."""
    from attnlab.model import GPTConfig
    from attnlab.tools.info import format_bytes, kv_memory_rows

    cfg = GPTConfig(vocab_size=32000, context_length=32768, emb_dim=4096, n_heads=32, n_layers=32)
    rows = kv_memory_rows(cfg, context=32768, batch=1, dtype="bf16", kv_heads=8)
    assert format_bytes(rows[0].total) == "17.18 GB"
    assert format_bytes(rows[1].total) == "4.29 GB"
    assert rows[0].total == 4 * rows[1].total and rows[0].per_layer * 32 == rows[0].total


@pytest.mark.parametrize(
    "overrides,batch",
    [
        (dict(), 3),  # GPT-2: plain caches of the context
        (dict(pos="rope", n_kv_heads=2, window=5, sinks=2), 2),  # rolling caches of window + sinks
        (dict(pos="alibi", window=4), 1),
        (dict(pos="rope", n_kv_heads=2, window=5, window_layers=[0, 2]), 2),  # Gemma 2: window and global layers
    ],
)
def test_kv_table_equals_the_caches_attnlab_allocates(overrides, batch):
    """The table's bytes are the bytes of the KVCache buffers GPT.new_kv_caches allocates."""
    from attnlab.model import GPT, GPTConfig
    from attnlab.tools.info import kv_memory_rows

    cfg = GPTConfig(vocab_size=11, context_length=16, emb_dim=16, n_heads=4, n_layers=3, **overrides)
    caches = GPT(cfg).new_kv_caches(batch)
    allocated = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    rows = kv_memory_rows(cfg, batch=batch, dtype="fp32")
    if cfg.window is None:
        assert rows[0].total == allocated  # MHA over the whole context
    else:
        row = rows[3] if cfg.kv_heads < cfg.n_heads else rows[2]  # its own heads, window + sinks slots
        assert row.total == allocated and row.kv_heads == cfg.kv_heads
        assert row.tokens == cfg.window + cfg.sinks


def test_kv_memory_cli_prints_the_table(capsys, tmp_path):
    assert main(["info", "--kv-memory", "--preset", "llama3-8b", "--context", "32768", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    mha, gqa = (next(line for line in out.splitlines() if line.startswith(p)) for p in ("MHA  ", "GQA ("))
    assert mha.split()[1:] == ["32", "32,768", "16.38", "kB", "536.87", "MB", "17.18", "GB"]
    assert gqa.split()[-2:] == ["4.29", "GB"] and " 8 " in gqa
    assert all(len(line) <= 80 for line in out.splitlines())
    # --model: a directory with a Hugging Face config.json (Llama family), no weights needed
    (tmp_path / "config.json").write_text(
        '{"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8, '
        '"max_position_embeddings": 128}'
    )
    assert main(["info", "--kv-memory", "--model", str(tmp_path), "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "GQA + window 8 " in out and "(window:" not in out


def test_info_describes_a_preset_with_transformers_parameter_count(capsys):
    """``attnlab info --preset llama3-8b``: the parameters transformers' Llama of the published config has
    (built on the meta device: nothing allocated), and its grouped heads."""
    transformers = pytest.importorskip("transformers")
    published = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**published))
    assert main(["info", "--preset", "llama3-8b"]) == 0
    name, shapes, switches = capsys.readouterr().out.splitlines()
    assert name == "llama3-8b"
    assert shapes.startswith(f"{sum(p.numel() for p in hf.parameters()):,} parameters: 32 layers, width 4096, ")
    assert "32 heads of 128 (8 key/value heads)" in shapes and "tie_embeddings=False" in switches


def test_info_names_a_hugging_face_directory_by_its_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        '{"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8, '
        '"max_position_embeddings": 128}'
    )
    assert main(["info", "--model", str(tmp_path)]) == 0
    name, shapes, switches = capsys.readouterr().out.splitlines()
    assert name == f"{tmp_path.name} (mistral)"
    assert "2 layers, width 64, 4 heads of 16 (2 key/value heads)" in shapes and "window=8" in switches


def test_info_counts_an_untied_gpt2_directory_as_from_pretrained_builds_it(tmp_path, capsys):
    # Regression: the GPT-2 config's tie_word_embeddings (and resid_pdrop) went unread: 64,000 too few.
    from attnlab import GPT, GPTConfig
    from attnlab.formats.hf import to_hf_gpt2

    pytest.importorskip("transformers")
    cfg = GPTConfig(vocab_size=1000, context_length=32, emb_dim=64, n_heads=4, n_layers=2, tie_embeddings=False)
    to_hf_gpt2(GPT(cfg)).save_pretrained(tmp_path)
    want = GPT.from_pretrained(str(tmp_path)).num_parameters()
    assert main(["info", "--model", str(tmp_path)]) == 0
    assert f"{want:,} parameters" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["info", "--kv-memory"], "needs --preset NAME or --model"),
        (["info", "--context", "8"], "go with --kv-memory"),
        (["info", "--batch", "4"], "go with --kv-memory"),
        (["info", "--dtype", "fp32"], "go with --kv-memory"),
        (["info", "--kv-memory", "--preset", "gpt9"], "unknown preset 'gpt9'"),
        (["info", "--kv-memory", "--preset", "tiny", "--kv-heads", "3"], "kv_heads must divide the 4 query heads"),
    ],
)
def test_kv_memory_bad_arguments_are_one_line_errors(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_the_kv_table_keeps_its_columns_with_long_labels():
    """A window on some layers makes a long row label ('MHA + window 5 on 2 of 4 layers'): the numbers
    stay in their columns, each ending where the header's does."""
    from attnlab.model import GPTConfig
    from attnlab.tools.info import format_kv_memory, kv_memory_rows

    cfg = GPTConfig(
        vocab_size=11, context_length=64, emb_dim=32, n_heads=4, n_layers=4, pos="rope", window=5, window_layers=[0, 2]
    )
    rows = kv_memory_rows(cfg, batch=1, dtype="bf16")
    assert any(len(r.label) > 22 for r in rows)
    lines = format_kv_memory("m", cfg, rows, batch=1, dtype="bf16").splitlines()
    table = lines[lines.index(next(ln for ln in lines if "K/V heads" in ln)) :][: len(rows) + 1]
    assert len({len(line) for line in table}) == 1, table  # every row as wide as the header
    heads = table[0].index("K/V heads") + len("K/V heads")  # the column's right edge
    assert all(line[heads - 1] != " " and line[heads] == " " for line in table), table
