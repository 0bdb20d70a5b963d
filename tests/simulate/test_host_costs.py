"""The host costs in the simulator: post and wait time on the rank's clock, the step's sync."""

from __future__ import annotations

import pytest

from pipecc.api import compile_schedule
from pipecc.ir.ops import Collective
from pipecc.passes.sum_shared import sum_shared
from pipecc.semantics import CommModel
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import simulate

COSTS = parse_cost_flag("F=1,B=2,comm=0.1,post=0.25,wait=0.5")


def test_one_microbatch_of_1f1b_by_hand() -> None:
    """rank 0: F0 [0, 1]; send [1, 1.25] (posted alone), recv [1.25, 1.5]; wait released
    when the gradient arrives; B0. rank 1: recv [0, 0.25]; wait released at 1.25 + 0.1 =
    1.35, over at 1.85; F0 [1.85, 2.85]; B0 [2.85, 4.85]; send [4.85, 5.1]; the gradient
    arrives at 5.1 + 0.1 = 5.2; rank 0's wait ends at 5.7, its B0 at 7.7."""
    program = compile_schedule("1f1b", ranks=2, microbatches=1)
    timeline = simulate(program, COSTS, model=CommModel.RENDEZVOUS)
    ops = [(rank, index, round(a, 9), round(b, 9)) for rank, index, _, a, b in timeline.ops()]
    assert ops == [
        (0, 0, 0.0, 1.0), (0, 1, 1.0, 1.25), (0, 2, 1.25, 1.5), (0, 3, 5.2, 5.7),
        (0, 4, 5.7, 7.7),
        (1, 0, 0.0, 0.25), (1, 1, 1.35, 1.85), (1, 2, 1.85, 2.85), (1, 3, 2.85, 4.85),
        (1, 4, 4.85, 5.1), (1, 5, 5.2, 5.7),
    ]  # fmt: skip
    assert timeline.makespan == timeline.step == pytest.approx(7.7)  # no duplicated stages
    rank0, rank1 = timeline.ranks
    assert (rank0.busy, rank0.host, rank1.host) == (3.0, 1.0, 1.5)  # 2 posts + 1 wait each
    # stalls: from the end of the previous instruction to the release
    assert [(s.index, s.since, round(s.length, 9)) for s in rank0.stalls] == [(3, 1.5, 3.7)]
    assert [(s.index, s.since, round(s.length, 9)) for s in rank1.stalls] == [
        (1, 0.25, 1.1),
        (5, 5.1, 0.1),
    ]
    # the gap before rank 0's B0: 4.7 long, 1.0 of it host time; the gradient could not be
    # there before 4.85 + post + comm = 5.2, so the rest is dependency-bound
    (gap,) = rank0.gaps
    assert (gap.since, gap.until, gap.host) == pytest.approx((1.0, 5.7, 1.0))
    assert (gap.dependency, gap.placement) == pytest.approx((3.7, 0.0))


def test_without_host_costs_the_timeline_is_unchanged() -> None:
    program = compile_schedule("zb_h1", ranks=4, microbatches=8)
    costs = parse_cost_flag("F=1,B=2,comm=0.1")
    zero = parse_cost_flag("F=1,B=2,comm=0.1,post=0,wait=0,sync=0")
    plain, zeros = simulate(program, costs).to_json(), simulate(program, zero).to_json()
    assert plain.pop("costs") != zeros.pop("costs")  # the header names what was given
    assert plain == zeros


# DualPipe's program holds the sum of its duplicated stages (an all_reduce per pair of ranks):
# its time is the `collective` key inside the replay, not `sync` after it
@pytest.mark.parametrize(("name", "sync"), [("dualpipe", 0.0), ("1f1b", 0.0), ("dualpipev", 0.0)])
def test_sync_is_added_to_the_step_of_sums_outside_the_program_only(name: str, sync: float) -> None:
    program = compile_schedule(name, ranks=2, microbatches=4)
    timeline = simulate(program, parse_cost_flag("F=1,B=2,sync=3"))
    assert timeline.makespan == simulate(program, parse_cost_flag("F=1,B=2")).makespan
    assert (timeline.sync, timeline.step) == (sync, timeline.makespan + sync)
    report = timeline.to_json()
    assert (report["sync"], report["step"]) == (sync, timeline.makespan + sync)


# A tied weight between the first and the last stage (S stages): the runtime sums its copies
# when the placement puts the two stages on different ranks, and the simulator adds `sync`
# exactly then. On a loop placement they are on ranks 0 and P-1; on a V shape both are on
# rank 0, so nothing crosses ranks; DualPipe's program sums its duplicated stages itself.
@pytest.mark.parametrize(
    ("name", "shared", "sync"),
    [
        ("1f1b", "0+1", 3.0),
        ("zb_h1", "0+1", 3.0),
        ("interleaved_1f1b", "0+3", 3.0),  # V=2 chunks: stages 0 (rank 0) and 3 (rank 1)
        ("interleaved_1f1b", "0+2", 0.0),  # stages 0 and 2 are both on rank 0
        ("zbv", "0+3", 0.0),  # the V shape folds the last stage back onto rank 0
        ("dualpipev", "0+3", 0.0),
        ("zbv", "0+1", 3.0),  # stage 1 is rank 1's
        ("dualpipe", "0+1", 0.0),  # its program sums every stage (the collective key's)
        ("1f1b", "", 0.0),
    ],
)
def test_sync_is_added_when_a_shared_group_spans_ranks(name: str, shared: str, sync: float) -> None:
    program = compile_schedule(name, ranks=2, microbatches=4)
    flag = f"F=1,B=2,sync=3,shared={shared}" if shared else "F=1,B=2,sync=3"
    timeline = simulate(program, parse_cost_flag(flag))
    assert (timeline.sync, timeline.step) == (sync, timeline.makespan + sync)


@pytest.mark.parametrize(("name", "shared"), [("dualpipe", ()), ("1f1b", ((0, 3),))])
def test_a_collective_lasts_its_cost_key(name: str, shared: tuple[tuple[int, ...], ...]) -> None:
    """The program's gradient sums come after everything else on their ranks: a duration of
    `collective` adds exactly that to the step, and nothing to a rank that holds none."""
    program = sum_shared(compile_schedule(name, ranks=4, microbatches=8), shared=shared)
    plain = simulate(program, parse_cost_flag("F=1,B=2,comm=0.1"))
    timed = simulate(program, parse_cost_flag("F=1,B=2,comm=0.1,collective=2.5"))
    assert timed.makespan == pytest.approx(plain.makespan + 2.5)
    for rank, instrs in enumerate(program.ranks):
        assert timed.ranks[rank].last_end == pytest.approx(plain.ranks[rank].last_end)
        last = len(instrs) - 1
        end, before = timed.replay.end_time(rank, last), plain.replay.end_time(rank, last)
        if type(instrs[-1]) is Collective:  # each sum ends exactly its duration later
            assert end == pytest.approx(before + 2.5), rank
        else:
            assert end == pytest.approx(before), rank
    assert timed.sync == 0.0  # the sums are in the program, not after it
