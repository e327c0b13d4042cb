"""``attnlab inspect`` and the loader behind it: attnlab checkpoints, local Hugging Face directories,
``--model gpt2`` from an offline Hugging Face cache; the numbers it prints against the library's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from attnlab.cli import main
from attnlab.interpret import HEAD_KINDS, ablation_effect, all_head_scores, logit_lens, rollout, trace
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.loading import load, load_demo, load_pretrained
from shared_data import GPT2_BPE_DIR, gpt2_bpe_missing
from test_interpret import role_model

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install 'attnlab[hf]')")
transformers.logging.set_verbosity_error()

LETTERS = "abcdefghijklmnop"  # the role model's 16 token ids as characters


@pytest.fixture(scope="module")
def role_checkpoint(tmp_path_factory):
    """The model of test_interpret whose heads play known roles, saved with a 16-character tokenizer."""
    model = role_model()
    d = model.save(tmp_path_factory.mktemp("role") / "ckpt")
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(LETTERS).to_dict()))
    return d, model


def _section(out: str, title: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start + 1 : end]


def test_report_of_a_checkpoint_prints_the_librarys_numbers(role_checkpoint, capsys):
    ckpt, model = role_checkpoint
    prompt = "abcdefgabcdefg"
    assert (
        main(
            [
                "inspect",
                "--checkpoint",
                str(ckpt),
                "--prompt",
                prompt,
                "--position",
                "3",
                "--token",
                "9",
                "--ablate",
                "1.0",
                "--top",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("ckpt: 2 layers x 3 heads, 14 tokens")
    roles = all_head_scores(model)
    grid = _section(out, "Head roles")
    for k, kind in enumerate(HEAD_KINDS):  # each role: a header line, then one line per layer
        assert grid[3 * k].split()[0] == kind
        for layer in range(2):
            got = [float(x) for x in grid[3 * k + 1 + layer].split()[2:]]
            assert got == pytest.approx(roles[kind][layer].tolist(), abs=0.005)
    strongest = {line.split()[0]: line.split()[1] for line in _section(out, "Strongest heads")}
    assert strongest == {
        "previous-token": "0.0",
        "first-token": "0.1",
        "self": "0.2",
        "duplicate-token": "1.1",
        "induction": "1.0",
    }
    idx = torch.tensor([CharTokenizer(LETTERS).encode(prompt)])
    tr = trace(model, idx, stages=True)
    lens = logit_lens(model, tr, k=3)
    rows = _section(out, "Logit lens at position 3 (d)")
    assert len(rows) == 3 and "(= output)" in rows[-1]
    for layer, row in enumerate(rows):
        pairs = re.findall(r"(\S+) (\d\.\d{3})", row.split(")", 1)[-1] if "(= output)" in row else row[28:])
        assert [LETTERS.index(t) for t, _ in pairs] == lens.tokens[layer, 0, 3].tolist()
        assert [float(p) for _, p in pairs] == pytest.approx(lens.probs[layer, 0, 3].tolist(), abs=5e-4)
    (row,) = _section(out, "Rollout row of token 9 (c)")
    shown = {int(j): float(v) for j, v in re.findall(r"(\d+):\S+ (\d\.\d{3})", row)}
    want = rollout(tr)[0, 9]
    assert len(shown) == 6 and all(want[j] == pytest.approx(v, abs=5e-4) for j, v in shown.items())
    assert min(shown.values()) >= float(torch.sort(want, descending=True).values[5]) - 5e-4  # the largest six
    effect = ablation_effect(model, idx, [(1, 0)])
    line = _section(out, "Ablating 1.0 (zero):")[0]
    assert f"loss {effect.loss_before:.4f} -> {effect.loss_after:.4f}" in line
    assert f"({effect.loss_change:+.4f})" in line and f"{float(effect.kl[0]):.4f}" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give --checkpoint DIR or --model NAME"),
        (["--prompt", "abc"], "give --checkpoint DIR or --model NAME"),
        (["--checkpoint", "CKPT"], "--prompt TEXT is required"),
        (["--checkpoint", "CKPT", "--prompt", "abc", "--ablate", "2.0"], "head 2.0 does not exist"),
        (["--checkpoint", "CKPT", "--prompt", "abc", "--ablate", "1-0"], "'L.H' strings"),
        (["--checkpoint", "CKPT", "--prompt", "abc", "--ablate", " "], "--ablate needs heads"),
        (["--checkpoint", "CKPT", "--prompt", "abc", "--position", "3"], "--position 3 is out of range"),
        (["--checkpoint", "CKPT", "--prompt", "abc", "--top", "0"], "--top must be >= 1"),
        (["--checkpoint", "CKPT", "--prompt", "a" * 40], "context_length=32"),
        (["--checkpoint", "CKPT", "--prompt", "xyz"], "is not in the char tokenizer's vocabulary"),
        (["--checkpoint", "nowhere", "--prompt", "abc"], "no such directory"),
        (["--model", "./nowhere", "--prompt", "abc"], "no such directory"),
        (["--model", __file__, "--prompt", "abc"], "a file that is not a GGUF file"),  # not sent to the Hub
        (["--model", "CKPT", "--prompt", "abc"], "an attnlab model directory"),  # not read as a GPT-2's
    ],
)
def test_inspect_reports_bad_input_in_one_line(role_checkpoint, argv, message, capsys):
    argv = [str(role_checkpoint[0]) if a == "CKPT" else a for a in argv]
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab inspect: error:") and message in err and len(err.splitlines()) == 1


def test_a_saved_model_whose_tokenizer_has_more_ids_is_refused_on_load(role_checkpoint, tmp_path, capsys):
    d = shutil.copytree(role_checkpoint[0], tmp_path / "wide")
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(LETTERS + "qrstuvwxyz").to_dict()))
    assert main(["inspect", "--checkpoint", str(d), "--prompt", "abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has 26 ids, more than the model's vocab_size=16" in err and len(err.splitlines()) == 1, err


def test_a_hugging_face_directory_given_as_checkpoint_points_to_model(tmp_path, capsys):
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=99, n_embd=8, n_layer=1, n_head=1)).save_pretrained(
        tmp_path / "hf"
    )
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")  # Hugging Face's file, not attnlab's description
    capsys.readouterr()  # (transformers' progress bar)
    assert main(["inspect", "--checkpoint", str(tmp_path / "hf"), "--prompt", "abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a Hugging Face model directory" in err and "use --model" in err and len(err.splitlines()) == 1, err


def test_checkpoint_and_model_are_exclusive(role_checkpoint, capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--checkpoint", str(role_checkpoint[0]), "--model", "gpt2", "--prompt", "a"])
    assert "not allowed with argument" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Hugging Face GPT-2: a local directory and the offline cache
# --------------------------------------------------------------------------------------------
def tiny_hf_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """A GPT-2 with GPT-2's vocabulary (so GPT-2's tokenizer reads it) but tiny widths."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.normal_(0, 0.5)
    return model


needs_bpe = pytest.mark.skipif(bool(gpt2_bpe_missing()), reason=gpt2_bpe_missing() or "")


@needs_bpe
def test_local_hugging_face_directory(tmp_path, capsys, gpt2):
    hf = tiny_hf_gpt2()
    hf.save_pretrained(tmp_path / "hfdir", safe_serialization=True)
    assert (tmp_path / "hfdir" / "model.safetensors").is_file()
    loaded = load_pretrained(str(tmp_path / "hfdir"), bpe_dir=GPT2_BPE_DIR)
    assert loaded.metadata == {"source": "local", "name": "hfdir (gpt2)"}  # its name and family, not its path
    prompt = "The cat sat on the mat"
    idx = torch.tensor([gpt2.encode(prompt)])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)
        want = hf(idx).logits[0, -1].argmax().item()
    argv = ["inspect", "--model", str(tmp_path / "hfdir"), "--bpe-dir", str(GPT2_BPE_DIR), "--prompt", prompt]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lens_rows = _section(out, "Logit lens at position 5")
    assert lens_rows[-1].split("(= output)")[1].split()[0] == gpt2.decode([want]).replace(" ", "␣")
    # The tokenizer's files beside the weights are found without --bpe-dir.
    for name in ("encoder.json", "vocab.bpe"):
        (tmp_path / "hfdir" / name).write_bytes((GPT2_BPE_DIR / name).read_bytes())
    assert load_pretrained(str(tmp_path / "hfdir")).tokenizer.encode(prompt) == idx[0].tolist()
    # A GPT-2 whose vocabulary is not GPT-2's cannot be read with GPT-2's tokenizer.
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=99, n_embd=8, n_layer=1, n_head=1)).save_pretrained(
        tmp_path / "small"
    )
    with pytest.raises(ValueError, match="fewer than GPT-2's tokenizer"):
        load_pretrained(str(tmp_path / "small"), bpe_dir=GPT2_BPE_DIR)


@needs_bpe
@pytest.mark.slow
def test_model_gpt2_works_offline_from_the_hugging_face_cache(tmp_path, subprocess_env):
    """``--model gpt2`` with the network off (HF_HUB_OFFLINE=1): the weights come from the cache."""
    repo = tmp_path / "hf" / "hub" / "models--openai-community--gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    tiny_hf_gpt2(seed=1).save_pretrained(repo / "snapshots" / "0123abcd", safe_serialization=True)
    env = {
        **subprocess_env,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "ATTNLAB_GPT2_BPE_DIR": str(GPT2_BPE_DIR),
    }
    cmd = [sys.executable, "-m", "attnlab", "inspect", "--model", "gpt2", "--prompt", "Hello world. Hello"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpt2: 2 layers x 2 heads, 4 tokens")
    page = tmp_path / "p.html"
    cmd = [sys.executable, "-m", "attnlab", "viz", "--model", "gpt2", "--prompt", "Hello world", "--out", str(page)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "the inspector" in done.stdout and page.stat().st_size > 10_000
    # Not in the cache: one line saying what to do, exit 2.
    env["HF_HOME"] = str(tmp_path / "empty")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "could not get the weights" in done.stderr and "local directory" in done.stderr


def test_loader_picks_one_source_and_the_demo_is_the_tutorials(tmp_path):
    with pytest.raises(ValueError, match="give one of --checkpoint DIR"):
        load()
    with pytest.raises(ValueError, match="give one of --checkpoint DIR"):
        load(tmp_path, "gpt2")
    state = torch.get_rng_state()
    demo = load_demo()
    assert torch.equal(torch.get_rng_state(), state)
    assert demo.words == ["Your", "journey", "starts", "with", "one", "step"]
    assert [name for name, _ in demo.modules][1:3] == ["SelfAttention_v2 (seed 789)", "CausalAttention (seed 789)"]
    torch.testing.assert_close(demo.modules[1][1].W_query.weight, demo.modules[2][1].W_query.weight)


def test_inspect_is_listed_in_the_help(capsys):
    assert main([]) == 0
    assert "inspect" in capsys.readouterr().out


@pytest.mark.slow
def test_python_m_attnlab_inspect_runs(role_checkpoint, subprocess_env):
    cmd = [sys.executable, "-m", "attnlab", "inspect", "--checkpoint", str(role_checkpoint[0]), "--prompt", "abcab"]
    done = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Strongest heads" in done.stdout and done.stderr == ""


# --------------------------------------------------------------------------------------------
# attnlab viz: the inspector page of a model
# --------------------------------------------------------------------------------------------
def test_viz_writes_the_inspector_of_a_checkpoint(role_checkpoint, tmp_path, capsys):
    from attnlab.interpret import read_page_data

    ckpt, model = role_checkpoint
    prompt = "abcdabcd"
    out = tmp_path / "page.html"
    argv = ["viz", "--checkpoint", str(ckpt), "--prompt", prompt, "--out", str(out), "--temperature", "0.8"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}: 6 attention maps in 2 rows, 8 tokens; the inspector")
    assert "8 generated tokens" in printed
    data = read_page_data(out.read_text(encoding="utf-8"))
    idx = torch.tensor([CharTokenizer(LETTERS).encode(prompt)])
    tr = trace(model, idx, stages=True)
    for layer in range(2):
        torch.testing.assert_close(data["layers"][layer]["weights"], tr.weights[layer, 0], atol=0, rtol=0)
    assert [(h["row"], h["head"]) for h in data["steps"]["heads"]] == [(r, h) for r in range(2) for h in range(3)]
    roles = all_head_scores(model)
    for kind in HEAD_KINDS:
        torch.testing.assert_close(data["roles"]["scores"][kind], roles[kind])
    want = model.generate(idx, 8, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert data["generation"]["tokens"] == want[0].tolist()
    assert data["generation"]["settings"] == {"temperature": 0.8, "top_k": None, "top_p": None}
    assert data["lens"]["ids"].shape == (3, 8, 5) and data["next"]["ids"].shape == (8, 16)


def test_viz_inspector_options(role_checkpoint, tmp_path, capsys):
    from attnlab.interpret import read_page_data

    ckpt, _ = role_checkpoint
    out = tmp_path / "page.html"
    base = ["viz", "--checkpoint", str(ckpt), "--prompt", "abcabc", "--out", str(out)]
    assert main([*base, "--steps", "1.0", "--generate", "0"]) == 0
    data = read_page_data(out.read_text(encoding="utf-8"))
    assert [(h["row"], h["head"]) for h in data["steps"]["heads"]] == [(1, 0)] and data["generation"] is None
    assert data["steps"]["omitted"] == 5 and "--steps" in data["steps"]["hint"]
    assert main([*base, "--layer", "-1", "--head", "0,2", "--steps", "1.2", "--generate", "2"]) == 0
    data = read_page_data(out.read_text(encoding="utf-8"))
    assert [(entry["layer"], entry["heads"]) for entry in data["layers"]] == [(1, [0, 2])]
    assert [(h["row"], h["head"]) for h in data["steps"]["heads"]] == [(0, 2)]
    assert data["roles"]["scores"]["induction"].shape == (2, 3)  # the other views cover the whole model
    capsys.readouterr()
    for argv, message in [
        (["--steps", "0.0", "--layer", "1"], "--steps 0.0: not among the heads shown"),
        (["--steps", "5.0"], "head 5.0 does not exist"),
        (["--generate", "-1"], "argument --generate: expected an integer from 0 to 4,096, got -1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--layer", "4"], "--layer 4 is out of range"),
    ]:
        try:
            code = main([*base, *argv])
        except SystemExit as exc:  # (argparse's own refusal of a flag's value)
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_viz_draws_and_prints_a_model_as_before(role_checkpoint, tmp_path, capsys):
    ckpt, _ = role_checkpoint
    assert main(["viz", "--checkpoint", str(ckpt), "--prompt", "abca", "--layer", "0", "--head", "0"]) == 0
    out = capsys.readouterr().out
    assert "layer 0 · head 0" in out and "1.0000" in out  # the previous-token head, as numbers
    pytest.importorskip("matplotlib")
    assert main(["viz", "--checkpoint", str(ckpt), "--prompt", "abca", "--out", str(tmp_path / "m.png")]) == 0
    assert "6 attention maps in 2 rows, 4 tokens" in capsys.readouterr().out
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
