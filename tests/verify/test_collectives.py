"""Collectives in the verifier (DESIGN §5): a rendezvous of their ranks, matched per set of
ranks by order, kind and `what`; deadlocks through them with their witness under each comm
model; nccl-single's one stream shared with the point-to-point ops; the compiler's gradient
sums verified under every model."""

from __future__ import annotations

import pytest
from helpers import ROOT, SCHEDULES
from programs import codes, compiled, move, report, with_rank

from pipecc.api import compile_schedule
from pipecc.ir.ops import Collective, CollectiveKind, Compute, Kind, Msg, Recv, Send, Wait
from pipecc.ir.placement import loop_placement
from pipecc.ir.program import Program
from pipecc.passes.sum_shared import sum_shared
from pipecc.semantics import CommModel, replay
from pipecc.verify import ALL_MODELS, Status

SUM = Collective(CollectiveKind.ALL_REDUCE, (0, 1), "grad-sum s0+s1")
GATHER = Collective(CollectiveKind.ALL_GATHER, (0, 1), "grad-sum s0+s1")


def _tied_1f1b(microbatches: int = 2) -> Program:
    """1F1B at P=2 with a parameter shared by its two stages: one sum at the end of each rank."""
    return sum_shared(compiled("1f1b", 2, microbatches), shared=((0, 1),))


def test_the_compiled_sum_passes_every_model() -> None:
    program = _tied_1f1b()
    assert [instrs[-1] for instrs in program.ranks] == [SUM, SUM]
    result = report(program, models=ALL_MODELS)
    assert result.ok, [str(v) for v in result.violations]


def test_a_collective_moved_before_a_recv_deadlocks_under_every_model() -> None:
    """Rank 0 enters the sum first; rank 1 reaches it only after rank 0's activation, which
    rank 0 sends after the sum: one cycle, through the collective and the recv, under all four
    models, and its witness says why at each hop."""
    program = _tied_1f1b()
    last = len(program.ranks[0]) - 1
    stuck = move(program, 0, last, 0)
    result = report(stuck, models=ALL_MODELS)
    assert codes(result) == ["deadlock"]
    (violation,) = result.violations
    at = len(program.ranks[1]) - 1
    src = "schedules/1f1b.sched"
    assert violation.message.replace(f"{ROOT}/", "") == "\n".join(
        [
            "deadlock under nccl, nccl-single, rendezvous, eager: ranks 1 → 0 → 1 wait for "
            "each other in a cycle",
            "  stuck: rank 1 at @2 wait 0; rank 0 at @0 all_reduce grad-sum s0+s1 over ranks 0, 1",
            "  cycle (each line waits for the next, the last for the first):",
            "    rank 1 @2     wait 0                                       waits for @0  "
            f"[{src}:15:38]",
            "    rank 1 @0     recv act stage 1 mb 0 from rank 0            completes with its "
            "partner, rank 0 @2 (eager: a receive completes once its send is posted)  "
            f"[{src}:15:38]",
            "    rank 0 @2     send act stage 1 mb 0 to rank 1              not posted: rank 0 is "
            f"stuck at @0, before it  [{src}:14:34]",
            "    rank 0 @0     all_reduce grad-sum s0+s1 over ranks 0, 1    completes with rank 1 "
            f"@{at}, which has not reached it (eager: a collective completes once every member "
            f"has reached it)  [{src}:14:34]",
            f"    rank 1 @{at}    all_reduce grad-sum s0+s1 over ranks 0, 1    not posted: rank 1 "
            f"is stuck at @2, before it  [{src}:15:40]",
            "  last completed instructions (▶ where the rank is stuck):",
            "    rank 1 | @0 recv act s1.0←r0  @1 recv act s1.1←r0  ▶ @2 wait 0",
            "    rank 0 | ▶ @0 all_reduce{0,1}",
        ]
    )
    for verdict in result.verdicts:
        assert verdict.status is Status.DEADLOCK, verdict


@pytest.mark.parametrize("model", ALL_MODELS)
def test_each_model_blocks_the_rank_at_its_collective(model: CommModel) -> None:
    program = _tied_1f1b()
    stuck = move(program, 0, len(program.ranks[0]) - 1, 0)
    run = replay(stuck, model=model)
    assert not run.finished
    assert run.blocked_at(0) == 0  # inside the sum, waiting for rank 1
    waits = [i for i, instr in enumerate(stuck.ranks[1]) if type(instr) is Wait]
    assert run.blocked_at(1) == waits[0]  # at the wait for the activation rank 0 never sends


def _three_ranks(*ranks: tuple[object, ...]) -> Program:
    return Program("t", "", 3, 1, (), "hand", loop_placement(3, 1), ranks)  # type: ignore[arg-type]


def test_nccl_single_shares_the_ranks_one_stream_with_its_collectives() -> None:
    """Rank 0 posts a sum with rank 2 (async) and then the activation for rank 1; rank 2
    joins the sum only after the activation has passed through rank 1. With one stream per
    peer (nccl) the send does not queue behind the sum; with one stream per rank
    (nccl-single) it does, and the three ranks wait in a cycle."""
    async_sum = Collective(CollectiveKind.ALL_REDUCE, (0, 2), "grad-sum s0+s2", True)
    f = [Compute(Kind.F, 0, 0, s, 0) for s in range(3)]
    program = _three_ranks(
        (f[0], async_sum, Send(Msg.ACT, 1, 0, 1, 0), Wait((1, 2))),
        (Recv(Msg.ACT, 0, 0, 1, 0), Wait((0,)), f[1], Send(Msg.ACT, 2, 0, 2, 0), Wait((3,))),
        (Recv(Msg.ACT, 1, 0, 2, 0), Wait((0,)), f[2], async_sum._replace(asynchronous=False)),
    )
    for model in ALL_MODELS:
        assert replay(program, model=model).finished is (model is not CommModel.NCCL_SINGLE)
    result = report(program, models=ALL_MODELS)
    (witness,) = [str(v) for v in result.violations if v.code == "deadlock"]
    assert witness.startswith("error[deadlock]: deadlock under nccl-single: ranks ")
    assert (
        "queued behind @1, not complete (nccl-single: rank 0's ops run in posting order on "
        "one stream)"
    ) in witness
    assert "it runs under rendezvous: this cycle closes only through NCCL's stream order" in witness


def test_under_nccl_a_collective_heads_every_stream_toward_its_members() -> None:
    """The same, with the send toward a member of the sum: nccl queues it behind the sum too."""
    async_sum = Collective(CollectiveKind.ALL_REDUCE, (0, 1), "grad-sum s0+s1", True)
    f0, f1 = Compute(Kind.F, 0, 0, 0, 0), Compute(Kind.F, 0, 0, 1, 0)
    ranks = (
        (f0, async_sum, Send(Msg.ACT, 1, 0, 1, 0), Wait((1, 2))),
        (Recv(Msg.ACT, 0, 0, 1, 0), Wait((0,)), f1, async_sum._replace(asynchronous=False)),
    )
    program = Program("t", "", 2, 1, (), "hand", loop_placement(2, 1), ranks)
    verdicts = {m: replay(program, model=m).finished for m in ALL_MODELS}
    assert verdicts == {
        CommModel.NCCL: False,
        CommModel.NCCL_SINGLE: False,
        CommModel.RENDEZVOUS: True,
        CommModel.EAGER: True,
    }
    found = report(program, models=(CommModel.NCCL,)).violations
    (witness,) = [v.message for v in found if v.code == "deadlock"]
    assert witness.startswith("deadlock under nccl: rank")
    assert "it runs under rendezvous: this cycle closes only through NCCL's stream order" in witness


def test_collectives_of_one_set_match_by_order_kind_and_what() -> None:
    """Rank 0 sums then gathers, rank 1 gathers then sums: the first of each meet and differ."""
    program = _tied_1f1b()
    ranks = (program.ranks[0] + (GATHER,), program.ranks[1][:-1] + (GATHER, SUM))
    swapped = Program(**{**_fields(program), "ranks": ranks})
    result = report(swapped, models=ALL_MODELS)
    assert codes(result) == ["mismatch"]
    last0, last1 = len(program.ranks[0]) - 1, len(program.ranks[1]) - 1
    assert result.violations[0].message == (
        "collectives over ranks 0, 1: the 1st is all_reduce grad-sum s0+s1 "
        f"over ranks 0, 1 on rank 0 (@{last0}) but all_gather grad-sum s0+s1 over ranks 0, 1 "
        f"on rank 1 (@{last1}); the k-th collective of one set of ranks meets the k-th of "
        "every member, so they exchange the wrong data or hang inside the library"
    )
    assert result.violations[0].notes[0][1] == "rank 1 issues its 1st one here"


def test_a_different_what_is_a_mismatch_and_a_missing_one_an_orphan() -> None:
    program = _tied_1f1b()
    other = SUM._replace(what="grad-sum s1")
    result = report(with_rank(program, 1, program.ranks[1][:-1] + (other,)))
    assert codes(result) == ["mismatch"]
    assert "but all_reduce grad-sum s1 over ranks 0, 1 on rank 1" in result.violations[0].message
    alone = report(with_rank(program, 1, program.ranks[1][:-1]), models=ALL_MODELS)
    assert codes(alone)[0] == "orphan"
    last = len(program.ranks[0]) - 1
    assert alone.violations[0].message == (
        "collectives over ranks 0, 1: the members issue different numbers (rank 0 1, rank 1 "
        f"0): the 1st on rank 0, all_reduce grad-sum s0+s1 over ranks 0, 1 (@{last}), has no "
        "partner on every member and never completes"
    )


def test_a_collective_without_its_own_rank_is_a_route_error() -> None:
    program = _tied_1f1b()
    bad = SUM._replace(ranks=(1,))
    result = report(with_rank(program, 0, program.ranks[0][:-1] + (bad,)))
    assert "route" in codes(result)
    (route,) = [v for v in result.violations if v.code == "route"]
    assert route.message.endswith(
        "all_reduce grad-sum s0+s1 over ranks 1 does not include rank 0 itself: it takes part "
        "in no collective and never completes"
    )


def test_an_async_collective_is_waited_and_a_blocking_one_is_not() -> None:
    program = _tied_1f1b()
    n = len(program.ranks[0])
    posted = SUM._replace(asynchronous=True)
    unwaited = report(with_rank(program, 0, program.ranks[0][:-1] + (posted,)))
    assert "unwaited" in codes(unwaited)
    waited = with_rank(program, 0, program.ranks[0][:-1] + (posted, Wait((n - 1,))))
    assert report(waited, models=ALL_MODELS).ok
    blocking = report(with_rank(program, 0, program.ranks[0] + (Wait((n - 1,)),)))
    assert codes(blocking) == ["bad-wait"]
    assert "which is a blocking collective: it completes where it stands" in str(
        blocking.violations[0]
    )


def _fields(program: Program) -> dict[str, object]:
    return {name: getattr(program, name) for name in Program.__dataclass_fields__}


def _last_stage(program: Program) -> int:
    return program.placement.num_stages(0) - 1


@pytest.mark.parametrize("name", sorted(p.stem for p in SCHEDULES.glob("*.sched")))
def test_every_bundled_schedule_with_a_tie_verifies_under_every_model(name: str) -> None:
    """The compiler's sums (DualPipe's duplicated stages, and a tie between the first and
    the last stage) pass every comm model, at two sizes, and sit at the end of the holders in
    one order."""
    for ranks, microbatches in ((2, 4), (4, 8)):
        try:
            plain = compile_schedule(name, ranks=ranks, microbatches=microbatches)
        except Exception:  # noqa: BLE001  a size the schedule does not accept
            continue
        program = sum_shared(plain, shared=((0, _last_stage(plain)),))
        result = report(program, models=ALL_MODELS)
        assert result.ok, (name, ranks, [str(v) for v in result.violations])
        sums = [[i for i in instrs if type(i) is Collective] for instrs in program.ranks]
        for rank, found in enumerate(sums):
            assert list(program.ranks[rank][len(program.ranks[rank]) - len(found) :]) == found
            assert [op.ranks for op in found] == sorted(op.ranks for op in found)
            assert all(rank in op.ranks for op in found)
