"""The overhead benchmark's table (its floor columns) and verdict line, and runtime_vs_torch's
plain-call op costs (what `ideal` and the floor simulate), without starting any ranks; the
benchmark's target itself is printed, never asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import runtime_overhead  # noqa: E402
from runtime_vs_torch import Config, Model, Samples, ideal_step, plain_ops  # noqa: E402

from pipecc.api import compile_schedule  # noqa: E402


def _medians(ratios: dict[str, float]) -> dict[str, float]:
    found = {"latency": 0.05, "latency mean": 0.2}
    for name, ratio in ratios.items():
        found[f"{name} torch"], found[f"{name} pipecc"] = 100.0, 100.0 * ratio
        found[f"{name} floor"] = 25.0
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
                                f"{ratios[1]:.2f}", "25.0", "0.25",
                                f"{100 * ratios[1] / 25:.2f}"]  # fmt: skip
    assert "one-way latency 50 µs a message (ping-pong median; mean 200 µs)" in lines[-2]


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


def test_the_floor_adds_the_message_latency_to_the_chain(tmp_path: Path) -> None:
    """The floor is the program simulated with the plain op times and a latency per
    message: 0 gives `ideal`; a latency lengthens the step by at least one message per
    microbatch on 1F1B's chain, and never shortens it."""
    program = compile_schedule("1f1b", ranks=2, microbatches=4)
    samples: Samples = {(s, k): [1.0] for s in (0, 1) for k in ("F", "B", "I", "W")}
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        steps = [ideal_step(program, samples, 2, comm) for comm in (0.0, 0.25, 0.5)]
    finally:
        dist.destroy_process_group()
    assert steps[0] == pytest.approx(10.0)  # (F + B) x 4 + the wait for rank 1's F and B
    assert steps[1] >= steps[0] + 4 * 0.25 and steps[2] > steps[1]
