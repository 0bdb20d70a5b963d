"""The overhead benchmark's verdict line and runtime_vs_torch's plain-call op costs (what
`ideal` simulates), without starting any ranks; the benchmark's target itself is printed,
never asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import runtime_overhead  # noqa: E402
from runtime_vs_torch import Config, Model, Samples, plain_ops  # noqa: E402


def _medians(ratios: dict[str, float]) -> dict[str, float]:
    found = {}
    for name, ratio in ratios.items():
        found[f"{name} torch"], found[f"{name} pipecc"] = 100.0, 100.0 * ratio
    return found


@pytest.mark.parametrize(
    ("ratios", "last"),
    [
        ((0.3, 0.5, 0.5, 1.2), "median 0.50 over 4 schedules (target <= 0.50: met)"),
        ((0.3, 0.6, 0.7, 0.2), "median 0.45 over 4 schedules (target <= 0.50: met)"),
        ((0.52, 0.6, 0.4, 0.9), "median 0.56 over 4 schedules (target <= 0.50: not met)"),
    ],
)
def test_the_verdict_is_the_median_ratio_against_half(ratios: tuple[float, ...], last: str) -> None:
    names = list(runtime_overhead.SCHEDULES)
    lines = runtime_overhead.report(names, _medians(dict(zip(names, ratios, strict=True))), 5)
    assert lines[-1] == f"pipecc/torch: {last}"
    assert lines[3].split() == ["interleaved_1f1b", "100.0", f"{100 * ratios[1]:.1f}",
                                f"{ratios[1]:.2f}"]  # fmt: skip


def test_plain_op_costs_of_a_rank_split_the_backward() -> None:
    """zbv's rank 0 holds stages 0 and 3: every kind timed per stage, I = 0 on stage 0
    (its input needs no gradient), W = B - I elsewhere, one sample per call."""
    model = Model(Config("zbv", "mlp", 16, 4, 3, 0, mlp_rows=2))
    samples: Samples = {}
    stages = model.stages()
    for _ in range(2):
        plain_ops(model, stages, 0, samples)
    assert sorted(samples) == [(s, k) for s in (0, 3) for k in ("B", "F", "I", "W")]
    assert all(len(v) == 2 and min(v) >= 0 for v in samples.values())
    assert samples[(0, "I")] == [0.0, 0.0] and samples[(0, "W")] == samples[(0, "B")]
    for b, i, w in zip(samples[(3, "B")], samples[(3, "I")], samples[(3, "W")], strict=True):
        assert i > 0 and w == pytest.approx(max(b - i, 0.0))
    assert all(p.grad is None for s in stages for p in s.parameters()), "left zeroed"
