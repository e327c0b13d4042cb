"""``attnlab viz``: the weights it shows, the PNG and the HTML it writes, and its command line.

The weights are checked against the tutorials' printed numbers, against explicit float64 loops
(``conftest.loop_attention``) fed with each layer's real input, and against
``torch.nn.MultiheadAttention``. The page itself is driven in a browser in test_viz_browser.py.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import MultiHeadAttention, causal_mask
from attnlab.cli import main
from attnlab.interpret import read_page_data
from attnlab.interpret.codec import unpack
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import ByteTokenizer
from attnlab.tools.viz import (
    ASSETS,
    AttentionView,
    LayerMaps,
    attention_maps,
    capture_attention,
    demo_view,
    model_view,
    read_asset,
    render_html,
    save_html,
    save_png,
    token_label,
)
from tutorial_numbers import CAUSAL_WEIGHTS, SA_V2_WEIGHTS, WEIGHTS


def tiny_gpt(seed: int = 0, drop_rate: float = 0.0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=256, context_length=32, emb_dim=16, n_heads=2, n_layers=2, drop_rate=drop_rate)
    cfg.update(kw)
    model = GPT(GPTConfig(**cfg))
    with torch.no_grad():  # sharper attention than GPT-2's 0.02 init, so the heads differ
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.5)
            block.att.W_key.weight.normal_(0, 0.5)
    return model


# --------------------------------------------------------------------------------------------
# The weights
# --------------------------------------------------------------------------------------------
# Printed in "A simple self-attention mechanism": softmax(x x^T), SelfAttention_v2 under seed 789,
# and the same weights with the causal mask applied before the softmax.
TUTORIAL_PANELS = (WEIGHTS, SA_V2_WEIGHTS, CAUSAL_WEIGHTS)


def test_demo_view_shows_the_tutorials_numbers_and_leaves_the_rng_alone():
    torch.manual_seed(42)
    state = torch.get_rng_state()
    view = demo_view()
    assert torch.equal(torch.get_rng_state(), state)
    assert view.tokens == ["Your", "journey", "starts", "with", "one", "step"]
    assert [layer.weights.shape[0] for layer in view.layers] == [1, 1, 1, 2, 2]
    for layer, printed in zip(view.layers[:3], TUTORIAL_PANELS, strict=True):
        torch.testing.assert_close(layer.weights[0], torch.tensor(printed), atol=1e-4, rtol=0)
    for layer in view.layers[2:]:  # causal rows: nothing above the diagonal, each row sums to 1
        assert torch.all(layer.weights.triu(1) == 0)
        torch.testing.assert_close(layer.weights.sum(-1), torch.ones(layer.weights.shape[:2]))


def _loop_layer_inputs(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """The normalised input each attention layer sees, by running the blocks ourselves."""
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[-1]))  # (1, T, C)
    inputs = []
    for block in model.trf_blocks:
        inputs.append(block.norm1(x)[0])  # (T, C)
        x = block(x)
    return inputs


def test_attention_maps_of_a_gpt_match_explicit_loops(ref):
    model = tiny_gpt(n_layers=2, n_heads=2).eval()
    idx = torch.tensor([3, 141, 59, 26, 5, 35, 89])
    maps = attention_maps(model, idx)
    assert [tuple(m.shape) for m in maps] == [(2, 7, 7)] * 2
    with torch.no_grad():
        for m, h, block in zip(maps, _loop_layer_inputs(model, idx.unsqueeze(0)), model.trf_blocks, strict=True):
            att = block.att
            hd = att.head_dim
            q = (h @ att.W_query.weight.T).view(7, 2, hd).transpose(0, 1)  # (H, T, hd)
            k = (h @ att.W_key.weight.T).view(7, 2, hd).transpose(0, 1)
            v = (h @ att.W_value.weight.T).view(7, 2, hd).transpose(0, 1)
            _, want = ref.loop_attention_nd(q, k, v, allowed=causal_mask(7))
            torch.testing.assert_close(m.double(), want, atol=1e-5, rtol=1e-4)


def test_attention_maps_match_torch_multihead_attention():
    torch.manual_seed(1)
    d, H, T = 12, 3, 5
    ours = MultiHeadAttention(d, d, T, 0.0, num_heads=H, qkv_bias=True)
    theirs = nn.MultiheadAttention(d, H, bias=True, batch_first=True)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.W_query.weight, ours.W_key.weight, ours.W_value.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.W_query.bias, ours.W_key.bias, ours.W_value.bias]))
    x = torch.randn(1, T, d)
    (got,) = attention_maps(ours, x)
    _, want = theirs(x, x, x, attn_mask=~causal_mask(T), need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)  # (1, H, T, T)


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    T=st.integers(1, 9),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_captured_weights_are_distributions_and_do_not_change_the_output(heads, T, causal, seed):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(8, 8, 16, 0.0, num_heads=heads, causal=causal).eval()
    x = torch.randn(2, T, 8)
    plain = mha(x)
    with capture_attention(mha) as captured:
        hooked = mha(x)  # the caller still gets a tensor, not (out, weights)
    assert isinstance(hooked, torch.Tensor)
    torch.testing.assert_close(hooked, plain)
    (w,) = captured
    assert w.shape == (2, heads, T, T)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, heads, T))
    if causal:
        assert torch.all(w.triu(1) == 0)
    assert not mha._forward_hooks and not mha._forward_pre_hooks


def test_capture_keeps_a_callers_own_return_weights_and_removes_hooks_on_error():
    torch.manual_seed(0)
    mha = MultiHeadAttention(4, 4, 3, 0.0, num_heads=2)
    x = torch.randn(1, 3, 4)
    with capture_attention(mha) as captured:
        _, w = mha(x, return_weights=True)
    assert torch.equal(captured[0], w)
    with pytest.raises(ValueError, match="context_length"), capture_attention(mha):
        mha(torch.randn(1, 9, 4))  # too long: the forward raises inside the block
    assert not mha._forward_hooks and not mha._forward_pre_hooks


def test_attention_maps_turn_dropout_off_and_restore_training_mode():
    model = tiny_gpt(drop_rate=0.5)
    model.train()
    idx = torch.tensor([1, 2, 3, 4, 5])
    a = attention_maps(model, idx)
    b = attention_maps(model, idx)
    assert model.training
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)  # deterministic: no dropout on the weights
        torch.testing.assert_close(x.sum(-1), torch.ones(x.shape[:2]))


def test_attention_maps_refuse_a_model_without_attention():
    with pytest.raises(ValueError, match="no attnlab attention module"):
        attention_maps(nn.Linear(3, 3), torch.randn(2, 3))
    with pytest.raises(TypeError, match="model must be"):
        attention_maps("gpt", torch.tensor([1]))


def test_select_layers_and_heads_and_errors():
    view = model_view(tiny_gpt(n_layers=3, n_heads=4), [1, 2, 3], ["a", "b", "c"], title="t")
    sub = view.select([-1], [0, 3])
    assert [layer.name for layer in sub.layers] == ["layer 2"]
    assert sub.layers[0].heads == [0, 3]
    torch.testing.assert_close(sub.layers[0].weights, view.layers[2].weights[[0, 3]])
    with pytest.raises(ValueError, match=r"--layer 3 is out of range: there are 3"):
        view.select([3], None)
    with pytest.raises(ValueError, match=r"--head 4 is out of range"):
        view.select([0], [4])
    # The tutorial view mixes 1- and 2-head rows: --head 1 keeps the rows that have a head 1.
    demo = demo_view().select(None, [1])
    assert [layer.weights.shape[0] for layer in demo.layers] == [1, 1]
    assert all(layer.heads == [1] for layer in demo.layers)


def test_view_validates_shapes():
    with pytest.raises(ValueError, match="expected"):
        AttentionView("t", ["a", "b"], [LayerMaps("x", torch.ones(1, 3, 3))])
    with pytest.raises(ValueError, match="heads, queries, keys"):
        LayerMaps("x", torch.ones(3, 3))


def test_token_label_makes_whitespace_visible():
    assert token_label(" the") == "␣the"
    assert token_label("\n") == "↵"
    assert token_label("a\tb\x00") == "a⇥b\\x00"
    assert token_label("") == "∅"
    assert token_label("\xa0") == "⍽"  # (SmolLM2's no-break space token was a blank row of inspect's lens)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------
def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.slow
def test_save_png_draws_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")

    path = save_png(demo_view(), tmp_path / "demo.png")
    w, h = _png_size(path)
    assert w > 400 and h > 1000  # five rows of readable panels
    img = torch.frombuffer(bytearray(Image.open(path).convert("L").tobytes()), dtype=torch.uint8).float()
    assert img.std() > 20  # not blank
    assert [p.name for p in tmp_path.iterdir()] == ["demo.png"]  # no temporary file left

    # Many heads, long prompt, tokens that look like mathtext or markup: still one readable file.
    model = tiny_gpt(n_layers=5, n_heads=4)
    tokens = ["$x$", "<b>", "\n", " "] * 3
    view = model_view(model, list(range(12)), tokens, title="$not math$")
    w, h = _png_size(save_png(view, tmp_path / "gpt.png"))
    assert h > w > 500


def test_save_svg_follows_the_suffix(tmp_path):
    pytest.importorskip("matplotlib")
    path = save_png(demo_view().select([0]), tmp_path / "demo.svg")
    assert path.read_text().lstrip().startswith("<?xml")


class _Scripts(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.data: dict[int, str] = {}

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        if self.tags and self.tags[-1][0] == "script":
            self.data[len(self.tags) - 1] = self.data.get(len(self.tags) - 1, "") + data


EVIL = '</script><script>alert(1)</script><!-- <img src=x onerror=alert(2)> & "quotes" \u2028'


def test_html_is_self_contained_and_embeds_the_weights_safely(tmp_path):
    model = tiny_gpt()
    tokens = [*EVIL[:10], "</script>", "<!--"]
    view = model_view(model, list(range(12)), tokens, title=EVIL, text=EVIL)
    page = render_html(view)
    parser = _Scripts()
    parser.feed(page)
    # No network: no external URL, no src/href attributes, no @import or url(). (The URL search skips the
    # data's JSON, whose packed arrays are base64, with "/" among its letters: "//x" may occur by chance.
    # Its strings are checked below to be the title and tokens given.)
    outside = re.sub(r'(<script type="application/json" id="attn-data">).*?</script>', r"\1", page, flags=re.S)
    assert len(outside) < len(page) - 1000  # (the data went)
    assert not re.search(r"https?://|//[a-z]", outside.replace("http-equiv", ""))
    assert not [(t, a) for t, a in parser.tags if {"src", "href"} & set(a)]
    assert not re.search(r"@import|url\(", page.split('id="attn-data"')[0])
    scripts = [(i, a) for i, (t, a) in enumerate(parser.tags) if t == "script"]
    assert len(scripts) == 2 and all("src" not in a for _, a in scripts)
    assert not any(t == "img" for t, _ in parser.tags)  # the prompt's <img> stayed text
    (data_i, attrs), _ = scripts
    assert attrs == {"type": "application/json", "id": "attn-data"}
    data = unpack(json.loads(parser.data[data_i]))  # the weights are packed binary (attnlab.interpret.codec)
    assert data["title"] == EVIL and data["tokens"] == tokens
    assert data["labels"] == [token_label(t) for t in tokens]
    assert len(data["layers"]) == 2
    for layer, got in zip(view.layers, data["layers"], strict=True):
        torch.testing.assert_close(got["weights"], layer.weights, atol=5e-5, rtol=0)
    assert "<title>&lt;/script&gt;" in page

    path = save_html(view, tmp_path / "v.html")
    assert path.read_text(encoding="utf-8") == page


def test_page_is_built_from_the_asset_files():
    from importlib import resources

    assets = resources.files("attnlab.interpret").joinpath("assets")
    files = {name: assets.joinpath(name).read_text(encoding="utf-8") for name in ASSETS}
    assert {name: read_asset(name) for name in ASSETS} == files
    page = render_html(demo_view())
    # The template is the page around its slots; the style and the code go into them verbatim.
    parts = re.split(r"\$(csp|title|styles|data|scripts)\b", files["viewer.html"])
    slots = parts[1::2]
    assert sorted(slots) == ["csp", "data", "scripts", "styles", "title"]
    pattern = "(.*?)".join(re.escape(text) for text in parts[::2])
    filled = dict(zip(slots, re.fullmatch(pattern, page, re.DOTALL).groups(), strict=True))
    assert filled["csp"].startswith("default-src 'none';")
    assert filled["title"] == "Your journey starts with one step"
    assert filled["styles"] == "<style>\n" + files["viewer.css"] + "</style>"
    assert filled["scripts"] == "<script>\n" + files["viewer.js"] + "</script>"
    assert filled["data"].startswith('<script type="application/json" id="attn-data">{')
    # The code reads its data; it holds none of it.
    assert "Your journey" not in files["viewer.js"] and "function showAttention(data)" in files["viewer.js"]
    with pytest.raises(ValueError, match="name must be one of"):
        read_asset("../__init__.py")


def test_an_asset_that_would_close_its_element_is_refused(monkeypatch):
    import attnlab.tools.viz.page as page

    real = page.read_asset
    monkeypatch.setattr(page, "read_asset", lambda n: real(n) + ("// </SCRIPT>" if n == "viewer.js" else ""))
    with pytest.raises(ValueError, match="cannot be inlined in <script>"):
        render_html(demo_view())


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def test_cli_prints_the_tutorial_example(capsys):
    assert main(["viz", "--layer", "0"]) == 0
    out = capsys.readouterr().out
    assert "Your journey starts with one step" in out
    assert "0.2098" in out and "0.1896" in out  # the tutorial's first and last weights
    assert max(len(line) for line in out.splitlines()) <= 80


def test_cli_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["viz", "--out", str(tmp_path / "a.png"), "--layer", "3,4", "--head", "1"]) == 0
    assert "2 attention maps in 2 rows, 6 tokens" in capsys.readouterr().out
    _png_size(tmp_path / "a.png")


def test_cli_writes_html(tmp_path, capsys):
    assert main(["viz", "--out", str(tmp_path / "a.html")]) == 0
    assert f"wrote {tmp_path / 'a.html'}: 7 attention maps in 5 rows, 6 tokens" in capsys.readouterr().out
    assert "Your journey starts with one step" in (tmp_path / "a.html").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x.jpg"], "--out must end in one of"),
        (["--prompt", "hi"], "--prompt needs --checkpoint"),
        (["--checkpoint", "nowhere"], "--checkpoint needs --prompt"),
        (["--checkpoint", "nowhere", "--prompt", "hi"], "no such directory"),
        (["--layer", "7"], "--layer 7 is out of range"),
        (["--head", "2"], "no selected layer has that head"),
    ],
)
def test_cli_reports_bad_input_in_one_line(argv, message, capsys):
    assert main(["viz", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_layer_must_be_an_int(capsys):
    with pytest.raises(SystemExit):
        main(["viz", "--layer", "first"])
    assert "expected an index" in capsys.readouterr().err


def test_cli_on_a_saved_gpt(tmp_path, capsys):
    model = tiny_gpt(n_layers=2, n_heads=2)
    ckpt = model.save(tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_text(json.dumps(ByteTokenizer().to_dict()))
    prompt = "héllo"  # é is two bytes: each shown as \xNN, not as a replacement character
    assert main(["viz", "--checkpoint", str(ckpt), "--prompt", prompt, "--out", str(tmp_path / "g.html")]) == 0
    page = (tmp_path / "g.html").read_text(encoding="utf-8")
    data = read_page_data(page)
    assert data["tokens"] == ["h", "\\xc3", "\\xa9", "l", "l", "o"]
    want = attention_maps(model.eval(), torch.tensor(ByteTokenizer().encode(prompt)))
    for layer, w in zip(data["layers"], want, strict=True):
        torch.testing.assert_close(layer["weights"], w, atol=5e-5, rtol=0)

    assert main(["viz", "--checkpoint", str(ckpt), "--prompt", "x" * 40]) == 2
    assert "context_length=32" in capsys.readouterr().err


def test_cli_on_a_training_checkpoint(tmp_path):
    from attnlab.training.checkpoint import save_checkpoint

    model = tiny_gpt(n_layers=2, n_heads=2)
    save_checkpoint(
        tmp_path / "run", step=1, model=model, optimizer=None, metadata={"tokenizer": ByteTokenizer().to_dict()}
    )
    out = tmp_path / "t.html"
    assert main(["viz", "--checkpoint", str(tmp_path / "run"), "--prompt", "abc", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    data = read_page_data(page)
    want = attention_maps(model.eval(), torch.tensor([97, 98, 99]))
    for layer, w in zip(data["layers"], want, strict=True):
        torch.testing.assert_close(layer["weights"], w, atol=5e-5, rtol=0)


def test_cli_refuses_a_directory_that_is_no_checkpoint(tmp_path, capsys):
    assert main(["viz", "--checkpoint", str(tmp_path), "--prompt", "abc"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_only_drawing_a_picture_imports_matplotlib(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from attnlab.cli import main\n"
        f"assert main(['viz', '--out', {str(tmp_path / 'p.html')!r}]) == 0 and main(['viz']) == 0\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_an_out_that_is_a_directory_is_one_line_before_any_work(tmp_path, capsys):
    # Regression: the page was made, then its temporary file's replace failed naming a hidden ".tmp" file.
    (tmp_path / "page.html").mkdir()
    assert main(["viz", "--out", str(tmp_path / "page.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "page.html is a directory: name a file in it" in err
