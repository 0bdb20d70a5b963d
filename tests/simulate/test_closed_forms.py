"""The simulator against closed forms (zero comm cost), DESIGN §6 and the papers' tables."""

from __future__ import annotations

import itertools

import pytest
from helpers import compile_bundled

from pipecc.semantics import CommModel
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import Timeline, simulate

MODELS = list(CommModel)


def _run(
    name: str,
    ranks: int,
    microbatches: int,
    costs: str,
    model: CommModel = CommModel.NCCL,
    **defines: int,
) -> Timeline:
    program = compile_bundled(name, ranks, microbatches, **defines)
    return simulate(program, parse_cost_flag(costs), model=model)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.value)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_1f1b_and_gpipe_makespan(schedule: str, model: CommModel) -> None:
    for ranks, microbatches, (f, b) in itertools.product((2, 3, 5), (1, 4, 9), ((1, 2), (2, 3))):
        t = _run(schedule, ranks, microbatches, f"F={f},B={b}", model)
        assert t.makespan == (microbatches + ranks - 1) * (f + b)
        expected_bubble = (ranks - 1) / (microbatches + ranks - 1)
        assert t.bubble_ratio == pytest.approx(expected_bubble)


def test_zb_h1_bubble() -> None:
    """Rank 0's idle time inside its working interval is (P−1)(F + I − W) with B = I + W,
    as the zero-bubble paper states, whenever W ≤ F; when W > F a W no longer fits into the
    gap it is meant to fill and the bubble is (P−1)(F + I − min(F, W))."""
    for ranks, (f, i, w) in itertools.product(
        (2, 4, 6), itertools.product((1, 2, 3), (1, 2), (1, 2))
    ):
        t = _run("zb_h1", ranks, 3 * ranks, f"F={f},I={i},W={w}")
        assert t.ranks[0].internal_idle == (ranks - 1) * (f + i - min(f, w))
        if w <= f:
            assert t.ranks[0].internal_idle == (ranks - 1) * (f + i - w)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.value)
def test_zb_h2_has_no_bubble_when_f_i_w_are_equal(model: CommModel) -> None:
    for ranks in (2, 3, 4, 6, 8):
        for microbatches in (2 * ranks, 2 * ranks + 3, 4 * ranks):
            t = _run("zb_h2", ranks, microbatches, "F=1,I=1,W=1", model)
            assert [r.internal_idle for r in t.ranks] == [0.0] * ranks


def test_dualpipe_bubble_matches_deepseek_table_when_f_equals_i() -> None:
    """(PP/2 − 1)(F&B + B − 3W) per rank (DeepSeek-V3, Table 2), when F equals the input-
    gradient part of B and W ≤ F; it is an approximation otherwise (docs/simulate.md)."""
    for ranks, (f, w, fb) in itertools.product(
        (4, 6, 8), ((1, 1, None), (2, 1, None), (2, 2, None), (3, 2, None), (1, 1, 2.5))
    ):
        i = f
        costs = f"F={f},I={i},W={w}" + (f",FB={fb}" if fb else "")
        fused = fb if fb else f + i + w
        for microbatches in (2 * ranks, 4 * ranks):
            t = _run("dualpipe", ranks, microbatches, costs)
            table = (ranks // 2 - 1) * (fused + (i + w) - 3 * w)
            assert max(r.idle for r in t.ranks) == pytest.approx(table)


def test_dualpipe_table_is_off_when_f_differs_from_i_or_w_exceeds_f() -> None:
    t = _run("dualpipe", 8, 32, "F=2,I=1,W=1")
    table = (8 // 2 - 1) * ((2 + 2) + 2 - 3 * 1)
    assert (max(r.idle for r in t.ranks), table) == (12, 9)
    t = _run("dualpipe", 8, 32, "F=1,I=1,W=2")
    table = (8 // 2 - 1) * ((1 + 3) + 3 - 3 * 2)
    assert (max(r.idle for r in t.ranks), table) == (6, 3)


@pytest.mark.parametrize(
    ("schedule", "peak"),
    [
        ("1f1b", lambda p: p),
        ("zb_h1", lambda p: p),
        ("zb_h2", lambda p: 2 * p - 1),
        ("dualpipe", lambda p: p + 1),
    ],
)
def test_activation_peaks(schedule: str, peak) -> None:  # type: ignore[no-untyped-def]
    for ranks in (2, 4, 6, 8):
        t = _run(schedule, ranks, 4 * ranks, "F=1,I=1,W=1")
        assert t.ranks[0].peak_activations == peak(ranks)
        assert max(r.peak_activations for r in t.ranks) == peak(ranks)


def test_comm_latency_delays_the_pipeline() -> None:
    fast = _run("1f1b", 4, 8, "F=1,B=2,comm=0")
    slow = _run("1f1b", 4, 8, "F=1,B=2,comm=0.5")
    # the first forward reaches the last rank after P-1 hops of F + latency
    assert slow.ranks[3].first_start == 3 * (1 + 0.5)
    # every round trip through the pipe in the steady state pays the latency too
    assert slow.makespan > fast.makespan + 2 * 3 * 0.5


def test_fused_op_uses_fb_when_given() -> None:
    plain = _run("dualpipev", 4, 16, "F=1,I=1,W=1")
    overlapped = _run("dualpipev", 4, 16, "F=1,I=1,W=1,FB=2")
    assert overlapped.makespan < plain.makespan
    # rank 0 runs 21 fused pairs (steps 4 and 5 of DualPipeV), each 1 shorter with FB=2
    assert overlapped.ranks[0].busy == plain.ranks[0].busy - 21
