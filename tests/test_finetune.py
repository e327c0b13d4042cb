"""``attnlab train --init-from``: fine-tuning a pretrained model, with every weight or LoRA adapters."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from attnlab import GPT, GPTConfig
from attnlab.cli import main
from attnlab.files import current_umask
from attnlab.tokenizers import ByteTokenizer
from attnlab.tools.loading import load_model
from attnlab.training.checkpoint import load_checkpoint
from attnlab.training.lora import LoRASettings, adapter_state, apply_lora, merge_lora

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 60


def llama_like(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=256, context_length=64, emb_dim=32, n_heads=4, n_kv_heads=2, n_layers=2,
                    drop_rate=0.0, pos="rope", mlp="swiglu", norm="rmsnorm", bias=False)  # fmt: skip
    return GPT(cfg).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small pretrained model as a GPT.save() directory with its tokenizer, and a text."""
    d = tmp_path_factory.mktemp("base")
    llama_like().save(d / "model")
    (d / "model" / "tokenizer.json").write_text(json.dumps(ByteTokenizer().to_dict()))
    (d / "text.txt").write_text(TEXT)
    return d


def train(base: Path, out: Path, *extra: str) -> int:
    args = ["train", "--init-from", str(base / "model"), "--data", str(base / "text.txt"), "--out", str(out),
            "--context-length", "32", "--batch-size", "4", "--eval-every", "3", "--checkpoint-every", "3",
            "--eval-batches", "2", "--sample-tokens", "0", "--no-progress", "--device", "cpu", "--precision", "fp32",
            "--warmup-steps", "1"]  # fmt: skip
    return main([*args, *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("targets", [["q", "k", "v", "o"], ["v", "up", "down"]])
def test_a_merged_model_computes_the_adapted_models_logits(targets) -> None:
    model = llama_like()
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    base_logits = model(x)
    n = apply_lora(model, LoRASettings.make(4, 8, targets))
    assert n == sum(t.numel() for t in adapter_state(model).values()) > 0
    assert torch.equal(model(x), base_logits)  # B starts at zero: the adapted model starts as the base
    with torch.no_grad():  # as after training: B nonzero
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    adapted = model(x)
    assert not torch.allclose(adapted, base_logits, atol=1e-3)
    merged = merge_lora(copy.deepcopy(model))
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(merged(x), adapted, rtol=1e-5, atol=1e-5)


def test_lora_trains_only_the_adapters_and_resumes_exactly(base, tmp_path, capsys) -> None:
    flags = ["--lora-rank", "4", "--lora-targets", "q,v", "--seed", "5"]
    assert train(base, tmp_path / "full", *flags, "--max-steps", "6") == 0
    log = capsys.readouterr().err
    # 2 layers x (q: 4 x (32 + 32), v: 4 x (32 + 16)) adapter parameters
    n_train = 2 * (4 * (32 + 32) + 4 * (32 + 16))
    n_total = llama_like().num_parameters() + n_train
    assert f"{n_train:,} of {n_total:,} parameters train" in log, log
    # The checkpoint keeps the frozen base and the adapters; the base is the pretrained model's.
    ckpt = load_checkpoint(tmp_path / "full", load_optimizer=False)
    assert ckpt.metadata["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]}
    step_dir = ckpt.path
    assert (step_dir / "adapters.safetensors").is_file()
    base_model = GPT.load(base / "model")
    saved_base = GPT.load(step_dir)  # model.safetensors alone: the plain base
    for (k, a), b in zip(base_model.state_dict().items(), saved_base.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert any(t.abs().sum() > 0 for k, t in adapter_state(ckpt.model).items() if k.endswith("lora_B"))
    # Stopped at 3 (its step-3 checkpoint alone) and resumed: the same losses, bit for bit.
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-00000003", half / "checkpoints" / "step-00000003")
    (half / "latest.json").write_text(
        json.dumps({"format": "attnlab-checkpoint", "step": 3, "path": "checkpoints/step-00000003"})
    )
    assert train(base, half, "--resume") == 0
    full, half = metrics(tmp_path / "full"), metrics(tmp_path / "half")
    assert [r["loss"] for r in half] == [r["loss"] for r in full[3:]]
    # Another rank on resume (whose --init-from comes from the checkpoint): the checkpoint's is named.
    capsys.readouterr()
    other = ["train", "--out", str(tmp_path / "half"), "--resume", "--lora-rank", "8", "--max-steps", "7"]
    assert main([*other, "--no-progress", "--sample-tokens", "0"]) == 2
    assert "--lora-rank 8 differs from the 4 of the checkpoint" in capsys.readouterr().err
    # Readers get the adapted function: the checkpoint (merged on load) equals the adapted model.
    x = torch.tensor([list(b"the quick brown")])
    adapted = load_checkpoint(tmp_path / "full", load_optimizer=False).model.eval()
    read = load_model(tmp_path / "full").model
    torch.testing.assert_close(read(x), adapted(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(read(x), base_model(x), atol=1e-4)  # training moved it


def test_merge_writes_a_plain_model_that_every_reader_takes(base, tmp_path, capsys) -> None:
    out, merged = tmp_path / "run", tmp_path / "merged"
    assert train(base, out, "--lora-rank", "2", "--max-steps", "3", "--merge", str(merged)) == 0
    assert not (merged / "adapters.safetensors").exists()
    plain = GPT.load(merged)  # GPT.load refuses unknown (adapter) weights
    x = torch.tensor([list(b"pack my box")])
    torch.testing.assert_close(plain(x), load_model(out).model(x), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(merged), "--prompt", "the", "--max-new-tokens", "4",
                 "--temperature", "0", "--device", "cpu"]) == 0  # fmt: skip
    a = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(out), "--prompt", "the", "--max-new-tokens", "4",
                 "--temperature", "0", "--device", "cpu"]) == 0  # fmt: skip
    assert capsys.readouterr().out == a
    # A merged model is a model to start from again.
    again = ["train", "--init-from", str(merged), "--data", str(base / "text.txt"), "--out", str(tmp_path / "again")]
    assert main([*again, "--max-steps", "1", "--batch-size", "2", "--sample-tokens", "0", "--no-progress"]) == 0


def test_full_fine_tuning_starts_from_the_pretrained_weights(base, tmp_path) -> None:
    assert train(base, tmp_path / "run", "--max-steps", "3", "--lr", "1e-9", "--grad-clip", "0") == 0
    # With a vanishing learning rate the trained model is still the pretrained one.
    trained = load_model(tmp_path / "run").model
    x = torch.tensor([list(b"lazy dog")])
    torch.testing.assert_close(trained(x), GPT.load(base / "model")(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora-rank", "0", "--lora-alpha", "4"], "--lora-alpha and --lora-targets go with --lora-rank"),
        (["--lora-rank", "-1"], "--lora-rank must be a positive integer (0: no adapters)"),
        (["--lora-rank", "5000"], "--lora-rank must be an integer in [1, 4096]"),
        (["--lora-rank", "17"], "--lora-rank must be in [1, 16] for this model"),  # W_key: (16, 32) with 2 kv heads
        (["--lora-rank", "4", "--lora-targets", "q,attn"], "--lora-targets must be distinct names among"),
        (["--lora-rank", "4", "--optimizer", "muon"], "--lora-rank trains the adapters with AdamW"),
        (["--tokenizer", "gpt2"], "--tokenizer gpt2 disagrees with --init-from"),
        (["--preset", "gpt2-xl"], "--preset does not go with --init-from"),
        (["--dropout", "0.5"], "--dropout does not go with --init-from"),
        (["--context-length", "65"], None),
    ],
)
def test_bad_fine_tuning_flags_are_one_line(base, tmp_path, capsys, extra, message) -> None:
    code = train(base, tmp_path / "run", *extra, "--max-steps", "1")
    err = capsys.readouterr().err
    if message is None:  # rope: a window longer than the pretrained context is allowed
        assert code == 0
        return
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_the_api_names_a_wrong_type() -> None:
    """Python callers get a TypeError naming the argument and the type that came, not an AttributeError
    from deep inside."""
    from attnlab.training.lora import LoRASettings, apply_lora
    from attnlab.training.trainer import Trainer

    for call, message in (
        (lambda: Trainer(None), "config must be a TrainConfig, got NoneType"),
        (lambda: Trainer({}), "config must be a TrainConfig, got dict"),
        (lambda: apply_lora("x", LoRASettings.make(2, None, None)), "model must be an attnlab GPT, got str"),
        (lambda: load_model(123), "directory must be a directory's path (str or os.PathLike), got int"),
        (lambda: GPT.from_gguf(123), "path must be a GGUF file's path (str or os.PathLike), got int"),
    ):
        with pytest.raises(TypeError, match=re.escape(message)):
            call()


def test_init_from_a_missing_model_is_one_line(tmp_path, capsys) -> None:
    code = main(["train", "--init-from", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--init-from" in err, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
        (["--lora-rank", "-1"], "--lora-rank must be a positive integer"),
        (["--lora-rank", "8", "--lora-alpha", "nan"], "--lora-alpha must be a positive number"),
    ],
)
def test_a_bad_flag_is_named_before_the_model_is_read_or_merge_made(tmp_path, capsys, monkeypatch, extra, message):
    # (the missing model was named first, or a real one read for 5.8 s; --merge's parents were made)
    monkeypatch.setattr("attnlab.cli.train.load_init", lambda *a, **k: pytest.fail("the model was read"))
    merge = tmp_path / "m" / "sub" / "merged"
    argv = ["train", "--init-from", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"), "--merge", str(merge)]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "m").exists()


def byte_level_tokenizer_json(path: Path) -> None:
    """A Hugging Face tokenizer.json with 256 byte-level tokens (ids match llama_like's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def test_a_run_and_its_merge_from_an_hf_tokenizer_outlive_the_base_model(tmp_path, capsys) -> None:
    """The fine-tuned checkpoint and the --merge directory carry the base's tokenizer.json: moving the
    base model away changes nothing (generation, encoding, --resume)."""
    pytest.importorskip("tokenizers")
    from attnlab.tokenizers import HFTokenizer

    base = tmp_path / "base"
    byte_level_tokenizer_json(base / "hf" / "tokenizer.json")
    llama_like().save(base / "model")
    hf = HFTokenizer(base / "hf" / "tokenizer.json")
    (base / "model" / "tokenizer.json").write_text(json.dumps(hf.to_dict()))  # an absolute path, as before
    data = tmp_path / "data.txt"  # not in the base directory: --resume reads it again
    data.write_text(TEXT)
    out, merged = tmp_path / "run", tmp_path / "merged"
    assert train(base, out, "--lora-rank", "2", "--max-steps", "3", "--merge", str(merged), "--data", str(data)) == 0
    text = "pack my box with five dozen ümlauts"
    gen = ["--prompt", "the", "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]

    def outputs() -> tuple[list, list, str, str]:
        ids = [load_model(d).tokenizer.encode(text) for d in (out, merged)]
        toks = [load_model(d).tokenizer for d in (out, merged)]
        assert all(isinstance(t, HFTokenizer) and t == hf for t in toks)
        texts = []
        for d in (out, merged):
            capsys.readouterr()
            assert main(["generate", "--checkpoint", str(d), *gen]) == 0
            texts.append(capsys.readouterr().out)
        return ids, [t.sha256 for t in toks], *texts

    before = outputs()
    assert before[0] == [hf.encode(text)] * 2
    shutil.move(base, tmp_path / "moved")
    assert outputs() == before
    shutil.rmtree(tmp_path / "moved")
    assert outputs() == before
    # --resume reads the tokenizer from the checkpoint too.
    resume = ["train", "--out", str(out), "--resume", "--max-steps", "6", "--data", str(data)]
    assert main([*resume, "--no-progress", "--sample-tokens", "0"]) == 0
    assert load_checkpoint(out).step == 6
    assert load_model(out).tokenizer == hf


def test_an_hf_tokenizer_recorded_by_absolute_path_still_loads(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    from attnlab.tokenizers import HFTokenizer, tokenizer_from_dict

    byte_level_tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    hf = HFTokenizer(tmp_path / "hf")
    old = {"name": "hf", "path": str(hf.path), "sha256": hf.sha256, "eot_id": None, "bos_id": None}
    for base_dir in (None, tmp_path / "elsewhere"):
        again = tokenizer_from_dict(old, base_dir=base_dir)
        assert again == hf and again.path == hf.path and again.encode("héllo") == hf.encode("héllo")
    with pytest.raises(ValueError, match="relative"):
        tokenizer_from_dict(old | {"path": "hf_tokenizer.json"})
    with pytest.raises(ValueError, match="inside"):
        tokenizer_from_dict(old | {"path": "../hf/tokenizer.json"}, base_dir=tmp_path / "x")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION, N_NEW = "Hi", 8  # (the rendered prompt and the answer fit the 64-token window)


def varied_instruct_base() -> tuple[GPT, list[int]]:
    """A base "instruct" model whose greedy answer to QUESTION is varied, and stop ids it meets only after
    a few tokens. (llama_like's small tied init only repeats the prompt's last token, "\n": with "\n" a
    stop id the answer was empty, and the comparisons below compared empty strings.)"""
    model = llama_like()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights far larger than the init: peaked distributions, which two steps of
        for name, p in model.named_parameters():  # fine-tuning leave with the same greedy tokens
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g))
    prompt = ByteTokenizer().encode(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")  # CHATML's
    free = model.generate(torch.tensor([prompt]), N_NEW, temperature=0)[0, len(prompt) :].tolist()
    new = [i for i, t in enumerate(free) if t not in free[:i] and t != 10 and i >= 3]  # first seen at token 3+
    assert new, free
    return model, [10, free[new[-1]], free[new[0]]]  # "\n" stays a stop id; the answer stops at token new[0]


@pytest.mark.parametrize("data", ["text", "chat"])
def test_a_model_fine_tuned_from_an_instruct_model_chats_from_its_checkpoint(tmp_path, capsys, monkeypatch, data):
    """The run's checkpoints and its --merge directory keep the base's chat template and stop ids:
    attnlab chat --checkpoint and generate --checkpoint --chat answer as the library does, stopping there."""
    import io
    import sys

    from attnlab.generation import SamplingConfig
    from attnlab.tools.chat import ChatSession, prompt_ids

    base = tmp_path / "base"
    model, stops = varied_instruct_base()
    model.save(base / "model")
    (base / "model" / "tokenizer.json").write_text(json.dumps(ByteTokenizer().to_dict()))
    chat = {"chat_template": {"source": CHATML, "bos_token": "", "eos_token": ""}, "stop_ids": stops}
    (base / "model" / "chat.json").write_text(json.dumps(chat))  # as --merge writes it
    assert load_model(base / "model").stop_ids == tuple(stops)
    (base / "text.txt").write_text(TEXT)
    extra = (
        []
        if data == "text"
        else ["--data", str(Path(__file__).resolve().parents[1] / "examples" / "chat_example.jsonl")]
    )
    out, merged = tmp_path / "run", tmp_path / "merged"
    assert train(base, out, "--max-steps", "2", "--context-length", "64", "--merge", str(merged), *extra) == 0
    assert load_checkpoint(out).metadata["stop_ids"] == stops
    question, n = QUESTION, N_NEW
    loaded = load_model(out)
    assert loaded.chat_template.source == CHATML and loaded.stop_ids == tuple(stops)
    answer = ChatSession(loaded, sampling=SamplingConfig(temperature=0.0), max_new_tokens=n).ask(question)
    text = "".join(answer)
    # The reference: the rendered template continued greedily, cut at the first stop id.
    idx = torch.tensor([prompt_ids(loaded, [{"role": "user", "content": question}])])
    raw = [int(t[0]) for t in loaded.model.stream(idx, n, temperature=0.0)]
    assert any(t in stops for t in raw), raw  # the answer does stop at a stop id
    cut = raw[: next(i for i, t in enumerate(raw) if t in stops)]
    assert len(cut) >= 3 and answer.ids == cut, (raw, stops)  # a few tokens: the comparisons below mean something
    assert text == loaded.tokenizer.decode(cut) and text.strip("\n")
    gen = ["--max-new-tokens", str(n), "--temperature", "0", "--device", "cpu"]
    for d in (out, merged):
        monkeypatch.setattr(sys, "stdin", io.StringIO(question + "\n"))
        capsys.readouterr()
        assert main(["chat", "--checkpoint", str(d), *gen]) == 0
        assert capsys.readouterr().out.strip("\n") == text.strip("\n"), d
        assert main(["generate", "--checkpoint", str(d), "--chat", "--prompt", question, *gen]) == 0
        assert capsys.readouterr().out == text + "\n", d


def test_chatting_with_a_checkpoint_without_a_chat_template_is_one_line(base, tmp_path, capsys, monkeypatch) -> None:
    import io
    import sys

    out = tmp_path / "run"
    assert train(base, out, "--max-steps", "1") == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    for argv in (["chat", "--checkpoint", str(out)], ["generate", "--checkpoint", str(out), "--chat"]):
        capsys.readouterr()
        assert main([*argv, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has no chat template" in err, err


def test_merge_is_written_whole_or_not_at_all(base, tmp_path, monkeypatch, capsys) -> None:
    # The merged directory was written file by file: a stop half-way left a DIR that no reader took and
    # that a second --merge refused as not empty. A place it cannot be written is found before training.
    import attnlab.cli.train as cli_train

    out, merged = tmp_path / "run", tmp_path / "merged"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert train(base, out, "--lora-rank", "2", "--max-steps", "1", "--merge", str(blocker / "merged")) == 2
    assert "cannot make its directory" in capsys.readouterr().err and not out.exists()
    # --merge naming the new --out: refused before training (it trained, then failed to rename)
    assert train(base, out, "--lora-rank", "2", "--max-steps", "1", "--merge", str(out)) == 2
    assert "is the run's --out" in capsys.readouterr().err and not out.exists()

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_train, "atomic_write_json", stopped)  # (after model.save: the tokenizer's file)
    assert train(base, out, "--lora-rank", "2", "--max-steps", "1", "--merge", str(merged)) == 130  # (Ctrl-C)
    assert not merged.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".merged")] == []
    monkeypatch.undo()
    assert train(base, out, "--resume", "--max-steps", "2", "--merge", str(merged)) == 0
    assert GPT.load(merged) is not None and (merged / "tokenizer.json").is_file()
    assert oct(merged.stat().st_mode & 0o777) == oct(0o777 & ~current_umask())


def test_apply_lora_checks_settings_not_made_by_make() -> None:
    # A plain dict gave KeyError 'targets'; LoRASettings(rank=0, ...) a ZeroDivisionError.
    def model() -> GPT:
        return GPT(GPTConfig(vocab_size=37, context_length=16, emb_dim=24, n_heads=4, n_layers=2))

    m = model()
    apply_lora(m, {"rank": 4})
    assert m.lora_settings == LoRASettings.make(4)
    with pytest.raises(ValueError, match=r"--lora-rank must be an integer in \[1, "):
        apply_lora(model(), LoRASettings(rank=0, alpha=1.0, targets=["q"]))
    with pytest.raises(TypeError, match=r"settings must be LoRASettings\.make"):
        apply_lora(model(), None)
