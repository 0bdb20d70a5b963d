"""The alignment pass: no placement-bound wait, the same compute order, safe under every model,
and a brute-force check of the wait classification on small programs."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from helpers import ROOT, compile_bundled, compute_order
from test_insert_comms import check_lowering

from pipecc.api import compile_schedule, compile_source
from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import Instr, Recv, Send, Wait, computations
from pipecc.ir.program import Program
from pipecc.passes.align_comms import align_comms
from pipecc.semantics import CommModel, replay
from pipecc.semantics.costs import CostModel, parse_cost_flag
from pipecc.simulate.timeline import simulate

SCHEDULES = [
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "interleaved_zb",
    "looped_bfs",
    "zb_h1",
    "zb_h2",
    "zbv",
    "dualpipe",
    "dualpipev",
]


def _placement(program: Program, costs: CostModel, model: CommModel) -> float:
    t = simulate(program, costs, model=model)
    return sum(r.placement_bound for r in t.ranks)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_aligned_programs_have_no_placement_bound_wait(schedule: str) -> None:
    for ranks, comm in itertools.product((2, 4, 8), (0, 0.1, 0.5)):
        program = compile_bundled(schedule, ranks, 2 * ranks)
        costs = parse_cost_flag(f"F=1,B=2,I=1,W=1,comm={comm}")
        aligned = align_comms(program, costs=costs, model=CommModel.NCCL)
        assert _placement(aligned, costs, CommModel.NCCL) == 0, (schedule, ranks, comm)
        assert compute_order(aligned) == compute_order(program)


@pytest.mark.parametrize("model", list(CommModel), ids=lambda m: m.value)
def test_aligned_for_each_model(model: CommModel) -> None:
    costs = parse_cost_flag("F=1,B=2,I=1,W=1,comm=0.5")
    for schedule in ("zb_h1", "dualpipe", "interleaved_1f1b", "zbv"):
        program = compile_bundled(schedule, 4, 8)
        aligned = align_comms(program, costs=costs, model=model)
        assert aligned.comm == "aligned"
        assert _placement(aligned, costs, model) == 0
        check_lowering(aligned)
        for other in CommModel:  # deadlock-free under every model, not just its own
            assert replay(aligned, model=other).finished


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ops_of_zero_duration_still_give_a_safe_program(schedule: str) -> None:
    # a cost model may give ops zero time (legal: costs are >= 0); every message made at the
    # moment its consumer starts must still be received before it, in the pair's order
    for flag in ("F=0,B=0,I=0,W=0,comm=0", "F=1,B=0,I=0,W=1,comm=0", "F=0,B=1,I=1,W=0,comm=0"):
        program = compile_bundled(schedule, 2, 4)
        aligned = align_comms(program, costs=parse_cost_flag(flag), model=CommModel.NCCL)
        check_lowering(aligned)
        for model in CommModel:
            assert replay(aligned, model=model).finished, (schedule, flag, model)


def test_known_residual_is_under_one_latency() -> None:
    """Under nccl streams, two transfers in opposite directions between one pair that overlap
    in time serialize when one side posts them in different gaps (docs/align.md): what is
    left is shorter than one message latency per gap."""
    costs = parse_cost_flag("F=1,B=2,I=1,W=1,comm=0.3")
    aligned = align_comms(
        compile_bundled("interleaved_1f1b", 4, 8), costs=costs, model=CommModel.NCCL
    )
    t = simulate(aligned, costs, model=CommModel.NCCL)
    residual = [g for r in t.ranks for g in r.gaps if g.placement > 0]
    assert residual and all(g.placement < 0.3 for g in residual)
    assert all("queued on its nccl stream" in g.cause for g in residual)


def test_default_policy_leaves_placement_bound_wait_with_a_long_latency() -> None:
    # the default orders messages for a nominal latency of 1/8 of a forward; with a latency
    # as long as a forward, it leaves waits that placing for the real latency removes
    program = compile_bundled("zb_h1", 4, 8)
    costs = parse_cost_flag("F=1,I=1,W=1,comm=1")
    assert _placement(program, costs, CommModel.NCCL) > 0
    aligned = align_comms(program, costs=costs, model=CommModel.NCCL)
    assert (
        simulate(aligned, costs, model=CommModel.NCCL).makespan
        < simulate(program, costs, model=CommModel.NCCL).makespan
    )


# ---- hand-made misplacements ---------------------------------------------------------------


def test_receive_posted_late_is_placement_bound() -> None:
    # rank 1 posts the receive for microbatch 1 by hand, only after an unrelated I; rank 0
    # waits for its first send by hand, before it needs to
    text = """
    phase p {
      if rank == 0 { F send act wait F repeat M { B } }
      else { recv act F I recv act F B W }
    }
    """
    program = compile_source(text, "late.sched", ranks=2, microbatches=2)
    costs = parse_cost_flag("F=1,B=2,I=2,W=1,comm=0.5")
    t = simulate(program, costs, model=CommModel.RENDEZVOUS)
    late = [g for g in t.ranks[1].gaps if g.index == 7]
    assert len(late) == 1
    gap = late[0]
    # made at 2 by rank 0, could arrive at 2.5; rank 1 is busy until 4.5 and only then posts
    assert (gap.since, gap.until, gap.dependency, gap.placement) == (4.5, 5.0, 0.0, 0.5)
    assert gap.cause == (
        "[4] recv act pipe 0 stage 1 mb 1 from rank 0 completed at 5: "
        "the receive was posted only at 4.5"
    )
    # the rank's own early wait for a send is placement-bound too
    early = [g for g in t.ranks[0].gaps if g.index == 3][0]
    assert early.placement == 0.5 and "its own send" in early.cause
    aligned = align_comms(program, costs=costs, model=CommModel.RENDEZVOUS)
    assert (
        sum(r.placement_bound for r in simulate(aligned, costs, model=CommModel.RENDEZVOUS).ranks)
        == 0
    )


def test_send_after_unrelated_w_is_placement_bound_under_rendezvous() -> None:
    def program(path: str) -> Program:
        return compile_bundled_example(path, 4, 8)

    costs = parse_cost_flag("F=1,I=1,W=1")
    after = program("zb_h1_send_after_w")
    before = program("zb_h1_send_before_w")
    t_after = simulate(after, costs, model=CommModel.RENDEZVOUS)
    t_before = simulate(before, costs, model=CommModel.RENDEZVOUS)
    assert sum(r.placement_bound for r in t_after.ranks) > 0
    assert sum(r.placement_bound for r in t_before.ranks) == 0
    causes = [g.cause for r in t_after.ranks for g in r.gaps if g.placement > 0]
    assert any("posted the matching send only at" in cause for cause in causes)
    aligned = align_comms(after, costs=costs, model=CommModel.RENDEZVOUS)
    assert (
        sum(r.placement_bound for r in simulate(aligned, costs, model=CommModel.RENDEZVOUS).ranks)
        == 0
    )


def compile_bundled_example(name: str, ranks: int, microbatches: int) -> Program:
    return compile_schedule(
        ROOT / "examples" / "schedules" / f"{name}.sched", ranks=ranks, microbatches=microbatches
    )


# ---- brute force ---------------------------------------------------------------------------


def _moves(program: Program) -> list[Program]:
    """Every program obtained by moving one comm op to another position on its rank: the post
    of a Send/Recv, or the completion of one (taken out of its Wait into a Wait of its own)."""
    found = []
    for rank, instrs in enumerate(program.ranks):
        for source, instr in enumerate(instrs):
            if not isinstance(instr, Send | Recv):
                continue
            for target in range(len(instrs) + 1):
                for moved in (
                    _move_post(instrs, source, target),
                    _move_completion(instrs, source, target),
                ):
                    if moved is not None and moved != instrs:
                        found.append(_with_rank(program, rank, moved))
    return found


def _with_rank(program: Program, rank: int, instrs: tuple[Instr, ...]) -> Program:
    ranks = list(program.ranks)
    ranks[rank] = instrs
    return replace(program, ranks=tuple(ranks))


def _rebuild(entries: list[tuple[int | None, Instr]]) -> tuple[Instr, ...] | None:
    """entries: (original index or None, instruction), Wait targets given as original
    indices. Renumber them; None when a Wait would precede an op it completes."""
    position = {orig: new for new, (orig, _) in enumerate(entries) if orig is not None}
    result: list[Instr] = []
    for new, (_, instr) in enumerate(entries):
        if isinstance(instr, Wait):
            targets = tuple(sorted(position[i] for i in instr.ops))
            if any(t >= new for t in targets):
                return None
            instr = Wait(targets)
        result.append(instr)
    return tuple(result)


def _move_post(instrs: tuple[Instr, ...], source: int, target: int) -> tuple[Instr, ...] | None:
    """The Send/Recv at `source` posted at position `target` instead."""
    if target == source or target >= len(instrs):
        return None
    entries = [(i, instr) for i, instr in enumerate(instrs) if i != source]
    entries.insert(target, (source, instrs[source]))
    return _rebuild(entries)


def _move_completion(
    instrs: tuple[Instr, ...], source: int, target: int
) -> tuple[Instr, ...] | None:
    """The op at `source` completed by a Wait of its own at position `target` instead of the
    Wait that lists it now."""
    entries: list[tuple[int | None, Instr]] = []
    for i, instr in enumerate(instrs):
        if i == target:
            entries.append((None, Wait((source,))))
        if isinstance(instr, Wait) and source in instr.ops:
            rest = tuple(t for t in instr.ops if t != source)
            if not rest:
                continue
            instr = Wait(rest)
        entries.append((i, instr))
    if target >= len(instrs):
        entries.append((None, Wait((source,))))
    return _rebuild(entries)


def _legal(program: Program) -> bool:
    """A legal position: every send after the op that makes its tensor, every posted op
    waited once, recvs waited before use, no deadlock under any comm model."""
    try:
        check_lowering(program)
    except (AssertionError, KeyError):
        return False
    flow = MessageKeys(program.placement)
    for instrs in program.ranks:
        made: set[int] = set()
        for instr in instrs:
            for op in computations(instr):
                out = flow.output_flow(op.kind, op.pipe, op.stage, op.mb)
                if out is not None:
                    made.add(out.key)
            if (
                isinstance(instr, Send)
                and flow.key(instr.what, instr.pipe, instr.stage, instr.mb) not in made
            ):
                return False
    return all(replay(program, model=m).finished for m in CommModel)


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches"),
    [("1f1b", 2, 2), ("zb_h1", 2, 3), ("gpipe", 2, 2), ("zbv", 2, 2), ("1f1b", 2, 4)],
)
@pytest.mark.parametrize("model", [CommModel.RENDEZVOUS, CommModel.NCCL], ids=lambda m: m.value)
def test_classification_agrees_with_brute_force(
    schedule: str, ranks: int, microbatches: int, model: CommModel
) -> None:
    """Try moving each comm op to every legal position. A program with no placement-bound
    wait is never beaten by a move; for every wait classified placement-bound, some move lets
    that op start earlier; and the aligned program is at least as fast as every move."""
    costs = parse_cost_flag("F=1,B=2,I=1,W=1,comm=0.5")
    program = compile_bundled(schedule, ranks, microbatches)
    base = simulate(program, costs, model=model)
    variants = [simulate(p, costs, model=model) for p in _moves(program) if _legal(p)]
    assert variants
    best = min(v.makespan for v in variants)
    aligned = simulate(align_comms(program, costs=costs, model=model), costs, model=model)
    assert aligned.makespan <= best + 1e-9
    assert sum(r.placement_bound for r in aligned.ranks) == 0
    flagged = [g for r in base.ranks for g in r.gaps if g.placement > 1e-9]
    if not flagged:
        assert best >= base.makespan - 1e-9
    for gap in flagged:
        op = program.ranks[gap.rank][gap.index]
        earliest = min(
            v.replay.start_time(gap.rank, v.program.ranks[gap.rank].index(op)) for v in variants
        )
        assert earliest < gap.until - 1e-9, gap
