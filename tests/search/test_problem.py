"""The search problem: placement, scaling of per-share costs, and the reference replay."""

from __future__ import annotations

import pytest

from pipecc.diagnostics import CostModelError
from pipecc.search.problem import (
    SHAPES,
    SPLIT,
    OrderError,
    Problem,
    SearchOp,
    evaluate,
)
from pipecc.semantics.costs import load_cost_file, parse_cost_flag

F, I, W = SPLIT  # noqa: E741


def _problem(placement: str, cost: str = "F=1,I=1,W=1,comm=1", ranks: int = 2) -> Problem:
    return Problem.from_costs(
        parse_cost_flag(cost), ranks=ranks, microbatches=2, placement=placement, cap=2
    )


def test_placement_maps_stages_to_ranks() -> None:
    loop = _problem("loop", ranks=3)
    assert [loop.rank_of(s) for s in range(3)] == [0, 1, 2]
    vee = _problem("vshape", ranks=3)
    assert [vee.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert vee.stages_of(1) == (1, 4)


def test_v_stages_run_at_half_their_share(tmp_path: object) -> None:
    costs = parse_cost_flag("F=2,I=4,W=6,comm=0.5")
    vee = Problem.from_costs(costs, ranks=2, microbatches=1, placement="vshape", cap=1)
    assert vee.f == (1, 1, 1, 1) and vee.i == (2, 2, 2, 2) and vee.w == (3, 3, 3, 3)
    assert vee.mem_f == (0.5,) * 4 and vee.mem_w == (-0.5,) * 4 and vee.comm == 0.5


def test_stage_tables_name_the_cuts_stages(tmp_path: pytest.TempPathFactory) -> None:
    """A [cost.stage.N] table is stage N of the placement's cut, used as given; global costs
    are per share (a V stage runs half of one)."""
    path = tmp_path / "c.toml"  # type: ignore[operator]
    path.write_text("[cost]\nF=1\n[cost.stage.1]\nF=3\n[cost.stage.2]\nF=2\n")
    costs = load_cost_file(path)
    loop = Problem.from_costs(costs, ranks=3, microbatches=1, placement="loop", cap=1)
    assert loop.f == (1, 3, 2)
    vee = Problem.from_costs(costs, ranks=3, microbatches=1, placement="vshape", cap=1)
    assert vee.f == (0.5, 3, 2, 0.5, 0.5, 0.5)
    with pytest.raises(CostModelError, match=r"\[cost.stage.2\] names a stage that loop P=2"):
        Problem.from_costs(costs, ranks=2, microbatches=1, placement="loop", cap=1)


def test_a_v_profile_is_converted_for_the_loop_cut(tmp_path: pytest.TempPathFactory) -> None:
    """A file measured on a V shape (2P stages): the loop's stage s adds stages 2s and 2s+1;
    per-share globals apply to both cuts."""
    path = tmp_path / "v.toml"  # type: ignore[operator]
    path.write_text(
        '[cost]\nplacement = "vshape"\nranks = 2\nstages = 4\nF = 2\nI = 2\nW = 2\n'
        "[cost.stage.0]\nF = 1\n[cost.stage.1]\nF = 2\n[cost.stage.2]\nF = 3\n"
        "[cost.stage.3]\nF = 4\nI = 0.5\n"
    )
    costs = load_cost_file(path)
    loop = Problem.from_costs(costs, ranks=2, microbatches=1, placement="loop", cap=1)
    assert loop.f == (3, 7) and loop.i == (2, 1.5) and loop.w == (2, 2)
    vee = Problem.from_costs(costs, ranks=2, microbatches=1, placement="vshape", cap=1)
    assert vee.f == (1, 2, 3, 4) and vee.i == (1, 1, 1, 0.5)


def test_evaluate_replays_in_the_latency_model() -> None:
    problem = _problem("loop")
    order = (
        (SearchOp(F, 0, 0), SearchOp(F, 0, 1), SearchOp(I, 0, 0), SearchOp(W, 0, 0),
         SearchOp(I, 0, 1), SearchOp(W, 0, 1)),
        (SearchOp(F, 1, 0), SearchOp(I, 1, 0), SearchOp(F, 1, 1), SearchOp(I, 1, 1),
         SearchOp(W, 1, 0), SearchOp(W, 1, 1)),
    )  # fmt: skip
    result = evaluate(problem, order)
    assert result is not None
    # F1.0 starts at 1 + comm; I0.0 waits for I1.0 (ends 4) + comm
    assert result.start[1] == (2, 3, 4, 5, 6, 7)
    assert result.start[0] == (0, 1, 5, 6, 7, 8)
    assert result.makespan == 9 and result.span == 9 - 0 and result.peak == (2, 2)


def test_v_turn_passes_locally_and_deadlock_is_none() -> None:
    problem = _problem("vshape", "F=2,I=2,W=2,comm=1")
    r0 = [SearchOp(k, s, m) for m in range(2) for k, s in ((F, 0), (F, 3), (I, 3), (I, 0))]
    r0 += [SearchOp(W, s, m) for m in range(2) for s in (0, 3)]
    r1 = [SearchOp(k, s, m) for m in range(2) for k, s in ((F, 1), (F, 2), (I, 2), (I, 1))]
    r1 += [SearchOp(W, s, m) for m in range(2) for s in (1, 2)]
    result = evaluate(problem, (tuple(r0), tuple(r1)))
    assert result is not None
    # F1.0 at 1 + 1 (message), F2.0 right after it on the same rank (local turn)
    assert result.start[1][:2] == (2, 3)
    assert result.peak == (2, 2)  # four half-share forwards before the first W
    stuck = (tuple(r0), (r1[1], r1[0], *r1[2:]))  # F2 before F1 on one rank
    assert evaluate(problem, stuck) is None


def test_evaluate_refuses_an_order_missing_ops() -> None:
    problem = _problem("loop")
    with pytest.raises(OrderError, match="rank 0"):
        evaluate(problem, ((SearchOp(F, 0, 0),), ()))


@pytest.mark.parametrize("placement", SHAPES)
def test_the_search_places_stages_as_the_irs_named_placement(placement: str) -> None:
    """The search's placements are the IR's by name: every stage on the rank (and chunk
    order) the IR's placement of that name gives."""
    problem = _problem(placement, ranks=4)
    ir = problem.ir_placement()
    assert ir.name == placement and ir.num_stages(0) == problem.num_stages
    for stage in range(problem.num_stages):
        assert ir.holder(0, stage).rank == problem.rank_of(stage)
    for rank in range(4):
        assert tuple(slot.stage for slot in ir.chunks(rank)) == problem.stages_of(rank)
    with pytest.raises(ValueError, match="the search takes"):
        _problem("bidirectional")
