"""The replay engine on hand-built programs: exact times, causes, groups, blocked state."""

from __future__ import annotations

import pytest

from pipecc.ir.ops import Compute, Instr, Kind, Msg, Recv, Send, Wait
from pipecc.ir.placement import loop_placement
from pipecc.ir.program import Program
from pipecc.semantics import (
    ZERO_TIMING,
    Block,
    Cause,
    CauseKind,
    CommModel,
    Overhead,
    Stuck,
    replay,
    wire,
)

NCCL, SINGLE, RV, EAGER = (
    CommModel.NCCL,
    CommModel.NCCL_SINGLE,
    CommModel.RENDEZVOUS,
    CommModel.EAGER,
)


def _program(*ranks: tuple[Instr, ...], chunks: int = 1) -> Program:
    return Program(
        "t", "", len(ranks), 2, (), "hand", loop_placement(len(ranks), chunks), tuple(ranks)
    )


class Costs:
    """Every compute takes `compute`; every send has latency `latency`; every post takes
    `post` and every Wait `wait` of host time."""

    def __init__(
        self, compute: float = 1.0, latency: float = 0.0, *, post: float = 0.0, wait: float = 0.0
    ) -> None:
        self.compute, self.lat = compute, latency
        self.host = Overhead(post, wait)

    def duration(self, rank: int, index: int, instr: object) -> float:
        return self.compute

    def latency(self, rank: int, index: int, send: object) -> float:
        return self.lat

    def overhead(self, rank: int) -> Overhead:
        return self.host


F0 = Compute(Kind.F, 0, 0, 0, 0)
F1 = Compute(Kind.F, 0, 0, 1, 0)
B1 = Compute(Kind.B, 0, 0, 1, 0)  # the last stage's backward: consumes no received tensor
SEND_A = Send(Msg.ACT, 1, 0, 1, 0)
RECV_A = Recv(Msg.ACT, 0, 0, 1, 0)

# rank 0: F0 (2), send act; wait. rank 1: recv act; F1 consumes it without a wait; wait.
HANDOFF = _program((F0, SEND_A, Wait((1,))), (RECV_A, F1, Wait((0,))))


@pytest.mark.parametrize(
    ("model", "send_done", "f1_start"),
    [
        (EAGER, 2.0, 3.0),
        (RV, 3.0, 3.0),
        (NCCL, 3.0, 3.0),
        (SINGLE, 3.0, 3.0),
    ],
)
def test_handoff_times(model: CommModel, send_done: float, f1_start: float) -> None:
    run = replay(HANDOFF, model=model, timing=Costs(compute=2.0, latency=1.0))
    assert run.finished
    assert run.start_time(0, 1) == run.end_time(0, 1) == 2.0  # the post takes no time
    assert run.done_time(0, 1) == send_done
    assert run.done_time(1, 0) == 3.0  # data at the receiver: post + latency
    assert run.start_time(1, 1) == f1_start  # blocks on the recv it consumes, no wait needed
    assert run.cause(1, 1) == Cause(CauseKind.RECV, 1, 0)
    assert run.end_time(1, 1) == f1_start + 2.0
    assert run.start_time(0, 2) == send_done  # the wait on the send
    assert run.cause(0, 2) == Cause(CauseKind.WAIT, 0, 1)
    assert run.partner(0, 1) == (1, 0) and run.partner(1, 0) == (0, 1)
    assert run.makespan() == 5.0


@pytest.mark.parametrize(
    ("model", "send_done"), [(EAGER, 2.25), (RV, 3.25), (NCCL, 3.25), (SINGLE, 3.25)]
)
def test_host_overhead_of_posts_and_waits(model: CommModel, send_done: float) -> None:
    """post = 0.25 on each Send/Recv, wait = 0.5 after each Wait's release, by hand."""
    run = replay(HANDOFF, model=model, timing=Costs(2.0, 1.0, post=0.25, wait=0.5))
    assert run.finished
    # rank 1 posts its recv over [0, 0.25]; rank 0 computes F0 over [0, 2], posts over [2, 2.25]
    assert (run.start_time(1, 0), run.end_time(1, 0), run.post_time(1, 0)) == (0.0, 0.25, 0.25)
    assert (run.start_time(0, 1), run.end_time(0, 1), run.post_time(0, 1)) == (2.0, 2.25, 2.25)
    assert run.done_time(0, 1) == send_done  # eager: at its post; else post + latency
    assert run.done_time(1, 0) == 3.25  # the data: send posted at 2.25, latency 1
    assert (run.start_time(1, 1), run.end_time(1, 1)) == (3.25, 5.25)  # F1 on the recv
    # a Wait starts when released and ends `wait` later
    assert (run.start_time(0, 2), run.end_time(0, 2)) == (send_done, send_done + 0.5)
    assert (run.start_time(1, 2), run.end_time(1, 2)) == (5.25, 5.75)
    assert run.cause(1, 2) == Cause(CauseKind.PROGRAM, 1, 1)  # nothing left to wait for
    assert run.makespan() == 5.75


@pytest.mark.parametrize(
    ("model", "grad_done"), [(EAGER, 2.5), (RV, 3.5), (NCCL, 3.5), (SINGLE, 3.5)]
)
def test_a_group_is_posted_after_all_its_posts(model: CommModel, grad_done: float) -> None:
    grouped = _program(
        (F0, SEND_A._replace(group=0), RECV_B._replace(group=0), Wait((1, 2))),
        (RECV_A._replace(group=1), SEND_B._replace(group=1), Wait((0, 1))),
    )
    run = replay(grouped, model=model, timing=Costs(2.0, 1.0, post=0.25, wait=0.5))
    assert run.finished
    assert [(run.start_time(0, i), run.end_time(0, i)) for i in (1, 2)] == [(2, 2.25), (2.25, 2.5)]
    assert run.post_time(0, 1) == run.post_time(0, 2) == 2.5  # the send goes with the group
    assert run.post_time(1, 0) == run.post_time(1, 1) == 0.5
    assert run.done_time(1, 0) == 3.5  # from 2.5, not from the send's own post at 2.25
    # rank 1's grad, sent at 0.5: eager, there at 1.5, received at the recv's post (2.5);
    # otherwise it transfers once the recv is posted, at 2.5, and arrives at 3.5
    assert run.done_time(0, 2) == grad_done
    assert run.end_time(0, 3) == grad_done + 0.5
    assert run.end_time(1, 2) == 4.0


def test_untimed_replay_has_no_host_time() -> None:
    for model in (EAGER, RV, NCCL, SINGLE):
        run = replay(HANDOFF, model=model)
        assert all(
            run.start_time(r, i) == run.end_time(r, i) == 0.0
            for r, instrs in enumerate(HANDOFF.ranks)
            for i in range(len(instrs))
        )


def test_causes_walk_back_to_time_zero() -> None:
    run = replay(HANDOFF, timing=Costs(compute=2.0, latency=1.0))
    assert run.cause(0, 0) == Cause(CauseKind.START, 0, -1)
    assert run.cause(0, 1) == Cause(CauseKind.PROGRAM, 0, 0)
    assert run.completion_cause(1, 0) == Cause(CauseKind.TRANSFER, 0, 1)  # the send came last
    assert run.ready_cause(0, 1) == Cause(CauseKind.POST, 0, 1)
    assert run.ready_time(0, 1) == 2.0


def test_zero_timing_is_the_untimed_replay() -> None:
    run = replay(HANDOFF, timing=ZERO_TIMING)
    assert run.finished and run.makespan() == 0.0


# both ranks send to each other, then receive: a cycle through the per-peer streams
SEND_B = Send(Msg.GRAD, 0, 0, 0, 0)
RECV_B = Recv(Msg.GRAD, 1, 0, 0, 0)
CROSS = _program((SEND_A, RECV_B, Wait((0, 1))), (SEND_B, RECV_A, Wait((0, 1))))


def test_send_send_is_a_stream_cycle_under_nccl_only() -> None:
    assert [replay(CROSS, model=m).finished for m in (NCCL, SINGLE, RV, EAGER)] == [
        False,
        False,
        True,
        True,
    ]
    run = replay(CROSS, model=NCCL)
    assert run.blocked_at(0) == 2 and run.blocked_at(1) == 2
    assert set(run.stuck) == {
        Stuck(0, 2, Block.WAITS_FOR, (0, 0)),
        Stuck(1, 2, Block.WAITS_FOR, (1, 0)),
        Stuck(0, 0, Block.PARTNER, (1, 1)),
        Stuck(1, 0, Block.PARTNER, (0, 1)),
        Stuck(0, 1, Block.STREAM, (0, 0)),
        Stuck(1, 1, Block.STREAM, (1, 0)),
    }


def test_a_group_is_one_unit_on_its_streams() -> None:
    grouped = _program(
        (SEND_A._replace(group=0), RECV_B._replace(group=0), Wait((0, 1))),
        (SEND_B._replace(group=3), RECV_A._replace(group=3), Wait((0, 1))),
    )
    assert all(replay(grouped, model=m).finished for m in (NCCL, SINGLE, RV, EAGER))
    # the same group ids, but not consecutive: two units again
    split = _program(
        (SEND_A._replace(group=0), F0, RECV_B._replace(group=0), Wait((0, 2))),
        (SEND_B._replace(group=3), B1, RECV_A._replace(group=3), Wait((0, 2))),
    )
    assert not replay(split, model=NCCL).finished


def test_needs_buffering_send_waited_before_the_recv() -> None:
    blocking = _program(
        (SEND_A, Wait((0,)), RECV_B, Wait((2,))), (SEND_B, Wait((0,)), RECV_A, Wait((2,)))
    )
    assert [replay(blocking, model=m).finished for m in (NCCL, SINGLE, RV, EAGER)] == [
        False,
        False,
        False,
        True,
    ]
    run = replay(blocking, model=RV)
    assert Stuck(0, 2, Block.NOT_POSTED, (0, 1)) in run.stuck


def test_stream_cause() -> None:
    # rank 0 posts two sends to rank 1; rank 1 receives them only after a compute (5)
    prog = _program(
        (SEND_A, SEND_A._replace(mb=1), Wait((0, 1))),
        (B1, RECV_A, RECV_A._replace(mb=1), Wait((1, 2))),
    )
    run = replay(prog, model=NCCL, timing=Costs(compute=5.0, latency=1.0))
    assert run.done_time(0, 0) == 6.0 and run.done_time(0, 1) == 7.0
    assert run.ready_time(0, 1) == 6.0  # behind the first send on the stream
    assert run.ready_cause(0, 1) == Cause(CauseKind.STREAM, 0, 0)
    assert run.completion_cause(0, 0) == Cause(CauseKind.TRANSFER, 1, 1)


def test_orphan_never_completes_except_an_eager_send() -> None:
    orphan = _program((SEND_A, Wait((0,))), (F1,))
    assert not replay(orphan, model=RV).finished
    assert Stuck(0, 0, Block.NO_PARTNER, None) in replay(orphan, model=RV).stuck
    assert replay(orphan, model=EAGER).finished


def test_wait_on_a_later_op_waits_for_itself() -> None:
    prog = _program((Wait((1,)), SEND_A), (RECV_A, Wait((0,))))
    run = replay(prog, model=RV)
    assert Stuck(0, 0, Block.WAITS_FOR, (0, 1)) in run.stuck
    assert Stuck(0, 1, Block.NOT_POSTED, (0, 0)) in run.stuck


def test_wiring_is_shared_and_checked() -> None:
    wiring = wire(HANDOFF)
    assert replay(HANDOFF, wiring=wiring).finished
    assert replay(HANDOFF, model=EAGER, wiring=wiring).finished
    with pytest.raises(ValueError, match="another program"):
        replay(CROSS, wiring=wiring)
