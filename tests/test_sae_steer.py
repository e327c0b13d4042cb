"""Steering with an SAE's latent (attnlab.interpret.steer, ``attnlab generate --steer``): the hook adds
exactly ``strength * W_dec[latent]`` (a float64 reference), and strength 0 leaves the tokens as they were."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from attnlab.cli import main
from attnlab.interpret import SAE, SAEConfig, hooks, steer

HOOK = "blocks.1.hook_resid_mid"


def make_sae(d_in: int = 24, d_sae: int = 32, hook: str = HOOK, seed: int = 0) -> SAE:
    torch.manual_seed(seed)
    sae = SAE(SAEConfig(d_in=d_in, d_sae=d_sae, architecture="topk", k=4, hook_name=hook))
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(d_sae, 1) * 3)  # rows of different norms: a wrong row shows
    return sae.eval()


def test_the_hook_adds_exactly_the_direction(make_gpt):
    model, sae = make_gpt().double(), make_sae().double()
    idx = torch.randint(0, 37, (2, 7))
    seen = {}

    def read(x, h):
        seen[len(seen)] = x.clone()

    with torch.no_grad():
        with hooks(model, {HOOK: read}):
            model(idx)
        with steer(model, sae, 5, -2.5) as direction, hooks(model, {HOOK: read}):
            model(idx)
    ref = seen[0] + (-2.5) * sae.W_dec.detach()[5]  # (B, T, d) float64, broadcast over every position
    torch.testing.assert_close(seen[1], ref, atol=0, rtol=0)
    torch.testing.assert_close(direction, -2.5 * sae.W_dec.detach()[5], atol=0, rtol=0)
    # Two latents at once: the directions add.
    with torch.no_grad(), steer(model, sae, 5, 1.0), steer(model, sae, 9, 2.0), hooks(model, {HOOK: read}):
        model(idx)
    torch.testing.assert_close(seen[2], seen[0] + sae.W_dec.detach()[5] + 2 * sae.W_dec.detach()[9])


def test_strength_zero_keeps_the_tokens_and_a_strong_push_moves_them(make_gpt):
    model, sae = make_gpt(seed=3), make_sae(seed=3)
    idx = torch.randint(0, 37, (1, 4), generator=torch.Generator().manual_seed(0))

    def greedy(**kw):
        return [int(t[0]) for t in model.stream(idx, 6, temperature=0.0, **kw)]

    plain = greedy()
    with steer(model, sae, 2, 0.0):
        assert greedy() == plain
        assert greedy(use_cache=False) == plain
    pushed = []
    for latent in range(2):
        with steer(model, sae, latent, 40.0):
            pushed.append(greedy())
    assert any(p != plain for p in pushed)


def test_bad_arguments(make_gpt):
    model, sae = make_gpt(), make_sae()
    with pytest.raises(ValueError, match=r"latent must be an int in \[0, 32\), got 32"), steer(model, sae, 32, 1.0):
        pass
    with pytest.raises(ValueError, match="strength must be a finite number"), steer(model, sae, 1, float("nan")):
        pass
    with pytest.raises(ValueError, match="does not match the model's width"), steer(model, make_sae(d_in=8), 1, 1.0):
        pass


def _generate(monkeypatch, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    code = main(["generate", *args])
    return code, out.getvalue()


@pytest.mark.slow
def test_generate_steer_on_smollm2(smollm2_gguf, tmp_path, monkeypatch, capsys, one_thread):
    sae = make_sae(d_in=576, d_sae=64, hook="blocks.6.hook_resid_post")
    sae.save(tmp_path / "sae")
    base = ["--model", str(smollm2_gguf), "--prompt", "The cat", "--max-new-tokens", "6", "--temperature", "0"]
    code, plain = _generate(monkeypatch, *base)
    assert code == 0
    code, zero = _generate(monkeypatch, *base, "--steer", f"{tmp_path / 'sae'}:3:0")
    assert code == 0 and zero == plain
    capsys.readouterr()
    for spec, message in (
        ("nocolons", "--steer must be SAE_DIR:LATENT:STRENGTH"),
        (f"{tmp_path / 'sae'}:64:1", "latent must be in"),
    ):
        assert main(["generate", *base, "--steer", spec]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
