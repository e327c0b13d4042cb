"""MuonAdamW against torch's own Muon and AdamW, Newton-Schulz's orthogonalisation, the parameter
split, and --optimizer muon through the trainer (exact resume, checked optimizer state)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from attnlab import hardware
from attnlab.cli import main
from attnlab.model import GPT, GPTConfig
from attnlab.training import TrainConfig, Trainer
from attnlab.training.checkpoint import check_optimizer_state
from attnlab.training.optim import MuonAdamW, muon_param_groups, newton_schulz

SMALL = dict(context_length=16, batch_size=4, eval_batches=2, sample_tokens=0, progress=False, device="cpu")


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


class _NewtonSchulzIn(TorchFunctionMode):
    """Runs torch.optim.Muon's own code with its one cast, ``grad.bfloat16()``, made a cast to
    ``dtype``: the reference follows the dtype under test (it is torch's update otherwise)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0].to(self.dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16)])
def test_muon_groups_step_as_torch_optim_muon(shape: tuple[int, int], ns_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    start = torch.randn(shape)
    grads = [[torch.randn(shape)] for _ in range(4)]
    mine, ref = start.clone().requires_grad_(), start.clone().requires_grad_()
    groups = [{"params": [mine], "use_muon": True, "lr": 0.02, "weight_decay": 0.1}]
    _steps(MuonAdamW(groups, momentum=0.9, ns_dtype=ns_dtype), [mine], grads)
    with _NewtonSchulzIn(ns_dtype):
        _steps(torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, momentum=0.9), [ref], grads)
    assert not torch.equal(mine, start)
    torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-5)


def test_newton_schulz_runs_in_the_dtype_asked_and_by_default_in_the_fast_one(monkeypatch) -> None:
    """float32 and bfloat16 iterations differ (so the dtype is really used), the float32 ones agree
    with a float64 run, and the default asks attnlab.hardware."""
    G = torch.randn(12, 20, generator=torch.Generator().manual_seed(3))
    f64 = newton_schulz(G.double(), dtype=torch.float64)
    f32, bf16 = newton_schulz(G, dtype=torch.float32), newton_schulz(G, dtype=torch.bfloat16)
    assert f32.dtype == bf16.dtype == torch.float32
    torch.testing.assert_close(f32.double(), f64, atol=1e-5, rtol=1e-4)
    assert (bf16.double() - f64).abs().max() > 1e-3
    for native, want in ((False, f32), (True, bf16)):
        monkeypatch.setattr(hardware, "bf16_native", lambda device="cpu", native=native: native)
        assert torch.equal(newton_schulz(G), want)
    with pytest.raises(TypeError, match="ns_dtype"):
        MuonAdamW([{"params": [torch.zeros(2, 2, requires_grad=True)], "use_muon": True, "lr": 0.1}], ns_dtype="bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_groups_step_as_torch_optim_adamw(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    shapes = [(5, 3), (7,), ()]
    starts = [torch.randn(s, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, dtype=dtype) for s in shapes] for _ in range(5)]
    mine = [t.clone().requires_grad_() for t in starts]
    ref = [t.clone().requires_grad_() for t in starts]
    groups = [{"params": mine, "use_muon": False, "lr": 3e-3, "weight_decay": 0.1}]
    _steps(MuonAdamW(groups, betas=(0.8, 0.9), eps=1e-6), mine, grads)
    _steps(torch.optim.AdamW(ref, lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, foreach=False), ref, grads)
    for m, r in zip(mine, ref, strict=True):
        torch.testing.assert_close(m, r, atol=1e-12 if dtype == torch.float64 else 1e-6, rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 48), cols=st.integers(2, 48), seed=st.integers(0, 2**16))
def test_newton_schulz_flattens_the_singular_values_and_keeps_the_directions(rows: int, cols: int, seed: int) -> None:
    """Every singular value of a well-conditioned G lands in Muon's band (about 0.5-1.2 after five
    quintic steps), and the singular vectors stay G's: the result is close to U V^T."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    S = torch.linspace(1.0, 0.1, k, dtype=torch.float64) * 10 ** torch.rand(1, generator=g).item()
    G = ((U * S) @ V.T).float()
    ortho = newton_schulz(G)
    assert ortho.shape == G.shape and ortho.dtype == G.dtype
    sv = torch.linalg.svdvals(ortho.double())
    assert sv.min() > 0.4 and sv.max() < 1.3, sv
    # ortho = U S' V^T: projecting onto G's singular directions leaves a diagonal.
    inner = U.T @ ortho.double() @ V
    off = inner - torch.diag(torch.diagonal(inner))
    assert off.abs().max() < 0.05


def test_muon_param_groups_split_every_parameter_once() -> None:
    model = GPT(GPTConfig.preset("tiny", n_layers=2))
    groups = muon_param_groups(model, lr=1e-3, muon_lr=0.02, weight_decay=0.0)
    muon, rest = (set(map(id, g["params"])) for g in groups)
    every = {id(p) for p in model.parameters()}
    assert muon | rest == every and not muon & rest
    blocks = {id(p) for p in model.trf_blocks.parameters() if p.dim() == 2}
    assert muon == blocks and id(model.tok_emb.weight) in rest
    with pytest.raises(TypeError, match="trf_blocks"):
        muon_param_groups(torch.nn.Linear(2, 2), lr=1e-3, muon_lr=0.02, weight_decay=0.0)
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([{"params": [torch.zeros(3, requires_grad=True)], "use_muon": True, "lr": 0.1}])


def test_trainer_with_muon_steps_as_the_optimizer_alone(tmp_path: Path) -> None:
    """One trainer step with --optimizer muon is a forward, backward, clip and MuonAdamW step."""
    cfg = TrainConfig(out=str(tmp_path), optimizer="muon", max_steps=1, warmup_steps=0, precision="fp32", **SMALL)
    trainer = Trainer(cfg)
    model = copy.deepcopy(trainer.raw_model)
    x, y = trainer.train_batches.batch(0, 0)
    trainer.fit()
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    groups = muon_param_groups(model, lr=trainer.cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay)
    MuonAdamW(groups, betas=(cfg.beta1, cfg.beta2), ns_dtype=torch.float32).step()  # --precision fp32
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [cfg.weight_decay, 0.0] != [0.0, 0.0]
    for (name, want), got in zip(model.state_dict().items(), trainer.raw_model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_muon_run_resumed_from_a_checkpoint_repeats_the_uninterrupted_losses(tmp_path: Path) -> None:
    base = dict(SMALL, optimizer="muon", max_steps=6, eval_every=3, checkpoint_every=3, keep_checkpoints=3)
    ref = tmp_path / "ref"
    whole = [r["loss"] for r in Trainer(TrainConfig(out=str(ref), **base)).fit().history]
    out = tmp_path / "resumed"
    shutil.copytree(ref / "checkpoints" / "step-00000003", out / "checkpoints" / "step-00000003")
    (out / "latest.json").write_text(
        json.dumps({"format": "attnlab-checkpoint", "step": 3, "path": "checkpoints/step-00000003"})
    )
    resumed = Trainer(TrainConfig(out=str(out), resume=True, **base)).fit()
    assert [r["loss"] for r in resumed.history] == whole[3:]


def test_a_muon_state_is_checked_before_it_loads(tmp_path: Path) -> None:
    trainer = Trainer(TrainConfig(out=str(tmp_path), optimizer="muon", max_steps=2, **SMALL))
    trainer.fit()
    state = copy.deepcopy(trainer.optimizer.state_dict())
    assert check_optimizer_state(state, trainer.optimizer, step=2)["state"].keys() == state["state"].keys()
    pid = state["param_groups"][0]["params"][0]  # a Muon matrix
    assert set(state["state"][pid]) == {"step", "momentum_buffer"}
    state["state"][pid]["momentum_buffer"] = torch.zeros(1)
    with pytest.raises(ValueError, match="momentum_buffer"):
        check_optimizer_state(state, trainer.optimizer, step=2)


def test_old_runs_resume_with_adamw_and_the_optimizer_is_fixed_on_resume() -> None:
    saved = TrainConfig().to_dict()
    del saved["optimizer"], saved["precision"]  # a checkpoint from before --optimizer and --precision
    old = TrainConfig(optimizer="muon").resumed(saved, set())
    assert old.optimizer == "adamw" and old.precision == ("auto" if torch.cuda.is_available() else "fp32")
    with pytest.raises(ValueError, match="--optimizer 'muon'"):
        TrainConfig(optimizer="muon").resumed({**saved, "optimizer": "adamw"}, {"optimizer"})


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--optimizer", "sgd"], "--optimizer"),
        (["--muon-lr", "0"], "--muon-lr"),
        (["--precision", "fp8"], "--precision"),
    ],
)
def test_bad_optimizer_flags_are_one_line_errors(tmp_path: Path, capsys, flags: list[str], named: str) -> None:
    try:  # argparse's choices exit; the config's checks return the status
        code = main(["train", "--out", str(tmp_path / "run"), *flags])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1]
