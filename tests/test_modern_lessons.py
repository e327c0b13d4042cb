"""The lessons on attention since GPT-2 (``attnlab explain rope|alibi|sliding-window|gqa``).

Their numbers are checked against independent computations: complex-number rotations, the ALiBi
paper's slopes, masks written element by element, a cache walked by hand, LLMs-from-scratch's
printed KV-cache sizes.
"""

from __future__ import annotations

import io
import math

import torch

from attnlab import tutorial_code as tc
from attnlab.tools.explain import LESSONS, MODERN_LESSONS, lesson_names, run_lesson, tutorial_lessons


def run(name: str) -> tuple[dict[str, torch.Tensor], str]:
    buf = io.StringIO()
    return run_lesson(name, file=buf), buf.getvalue()


def test_registered_after_the_tutorials_lessons():
    names = lesson_names()
    assert names[-len(MODERN_LESSONS) :] == list(MODERN_LESSONS) or set(MODERN_LESSONS) <= set(names)
    assert names.index("dot-products") < names.index("rope")
    for name in MODERN_LESSONS:  # past the GPT-style guide: named by its title, outside its sections
        assert "Implementing GPT-Style Attention" in LESSONS[name].tutorial
        assert name not in [entry.name for entry in tutorial_lessons("gpt-style")]


def test_rope_lesson():
    t, text = run("rope")
    q_rot, scores = t["q_rot"], t["scores"]
    torch.manual_seed(789)
    sa = tc.SelfAttention_v2(3, 2)
    q = sa.W_query(tc.INPUTS).detach()  # (6, 2)
    for m in range(6):  # pair (a, b) as a + ib, times e^{i m}
        z = complex(float(q[m, 0]), float(q[m, 1])) * complex(math.cos(m), math.sin(m))
        assert abs(z.real - float(q_rot[m, 0])) < 1e-5 and abs(z.imag - float(q_rot[m, 1])) < 1e-5
    torch.testing.assert_close(t["shifted"], scores, atol=1e-4, rtol=1e-4)
    k = sa.W_key(tc.INPUTS).detach()
    angle = lambda v: math.atan2(float(v[1]), float(v[0]))
    for d in range(6):  # |q||k| cos(angle_q + d - angle_k)
        want = float(q[1].norm() * k[0].norm()) * math.cos(angle(q[1]) + d - angle(k[0]))
        assert abs(float(t["by_distance"][d]) - want) < 1e-5
    assert "check: a rotation keeps every length" in " ".join(text.split())


def test_alibi_lesson():
    t, _ = run("alibi")
    assert t["slopes"].tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    for h, slope in enumerate(t["slopes"].tolist()):
        for i in range(6):
            for j in range(i + 1):
                assert float(t["bias"][h, i, j]) == -slope * (i - j)
    x = tc.INPUTS.double()
    for h, slope in enumerate(t["slopes"].tolist()):  # the last word, by hand
        scores = [float(x[5] @ x[j]) - slope * (5 - j) for j in range(6)]
        z = sum(math.exp(s) for s in scores)
        want = torch.tensor([math.exp(s) / z for s in scores], dtype=torch.float64)
        torch.testing.assert_close(t["weights"][h, 5].double(), want, atol=1e-6, rtol=1e-5)


def test_sliding_window_lesson():
    t, text = run("sliding-window")
    band = torch.tensor([[j <= i and i - j < 3 for j in range(6)] for i in range(6)])
    assert torch.equal(t["band"], band)
    sinks = torch.tensor([[j <= i and (i - j < 3 or j < 1) for j in range(6)] for i in range(6)])
    assert torch.equal(t["sinks"], sinks)
    # The ring by hand: token t goes to slot t % 3, the slot's old token leaves.
    held = [-1, -1, -1]
    for step in range(12):
        held[step % 3] = step
        assert t["held"][step].tolist() == held
    flat = " ".join(text.split())
    assert "cache.keys.shape = (1, 2, 3, 2)" in flat
    diff = float(flat.split("token by token through the ring == all 12 at once: max |difference| = ")[1].split()[0])
    assert diff < 1e-5


def test_gqa_lesson():
    t, text = run("gqa")
    # LLMs-from-scratch prints 17.18 GB (MHA) and 4.29 GB (GQA, 8 KV heads) for these sizes.
    assert "17.18 GB, 4.29 GB and 0.54 GB" in " ".join(text.split())
    assert t["sizes"].tolist() == [4 * t["sizes"][1].item(), t["sizes"][1].item(), t["sizes"][1].item() // 8]
    torch.testing.assert_close(t["weights"].sum(-1), torch.ones(1, 4, 6))


def test_soft_capping_lesson():
    t, text = run("soft-capping")
    x = tc.INPUTS.double()
    for i in range(6):  # by hand, in float64: 2 tanh(s / 2), then a causal softmax
        row = [2 * math.tanh(4 * float(x[i] @ x[j]) / 2) for j in range(i + 1)]
        assert max(abs(a - float(b)) for a, b in zip(row, t["capped"][i, : i + 1], strict=True)) < 1e-5
        z = sum(math.exp(s) for s in row)
        want = [math.exp(s) / z for s in row] + [0.0] * (5 - i)
        assert max(abs(a - float(b)) for a, b in zip(want, t["weights"][i], strict=True)) < 1e-5
    assert float(t["scores"].max()) > 2 > float(t["capped"].max())  # the cap bit
    assert "applies the same step: max |difference| = 0.0e+00" in " ".join(text.split())
