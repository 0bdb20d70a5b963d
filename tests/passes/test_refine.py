"""The default policy's refinements of the global order (`passes/comm/refine.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import pipecc.passes.comm.refine as refine
from pipecc.api import compile_schedule
from pipecc.interop import torch_csv
from pipecc.ir.ops import Instr, Recv, Send, StageOp, Wait
from pipecc.ir.printer import describe
from pipecc.passes.insert_comms import DEFAULT, Grouping, MessageOrder, lower, strip_comms


def _lines(instrs: tuple[Instr, ...]) -> list[str]:
    return [describe(instr) for instr in instrs]


def test_a_reply_the_next_op_needs_goes_first_on_the_pair() -> None:
    # rank 2 makes the activation for rank 3's F1.2 with its F1.2, and its next op, B1.0,
    # needs rank 3's gradient made a little later: the gradient goes first (docs/compile.md)
    program = compile_schedule("interleaved_1f1b", ranks=4, microbatches=8)
    lines = _lines(program.ranks[2])
    grad = lines.index("recv grad pipe 0 stage 6 mb 0 from rank 3")
    act = lines.index("send act pipe 0 stage 7 mb 2 to rank 3")
    assert grad < lines.index("F1.2") < act < lines.index("B1.0")
    # ordered by the moment each is made, the activation went first
    made = lower(strip_comms(program), replace(DEFAULT, order=MessageOrder.MADE))
    by_time = _lines(made.ranks[2])
    assert by_time.index("send act pipe 0 stage 7 mb 2 to rank 3") < by_time.index(
        "recv grad pipe 0 stage 6 mb 0 from rank 3"
    )


def test_a_cross_exchange_keeps_the_order_made() -> None:
    # 1F1B at P=2: rank 0's next op after F needs the gradient, rank 1's next op after B the
    # activation: both wait for the other, and the activation (made first) goes first
    program = compile_schedule("1f1b", ranks=2, microbatches=3)
    lines = _lines(program.ranks[0])
    assert lines.index("send act pipe 0 stage 1 mb 2 to rank 1") < lines.index(
        "recv grad pipe 0 stage 0 mb 2 from rank 1"
    )


def test_receives_are_posted_two_compute_ops_ahead() -> None:
    program = compile_schedule("1f1b", ranks=4, microbatches=8)
    # rank 0 posts the gradient of mb 1 before B0.0, two compute ops before B0.1 (F0.4 is
    # between them); by the moment made alone it went after B0.0
    lines = _lines(program.ranks[0])
    assert lines.index("recv grad pipe 0 stage 0 mb 1 from rank 1") < lines.index("B0.0")
    made = lower(strip_comms(program), replace(DEFAULT, recv_lead=0))
    by_time = _lines(made.ranks[0])
    assert by_time.index("recv grad pipe 0 stage 0 mb 1 from rank 1") > by_time.index("B0.0")


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches"),
    [("interleaved_1f1b", 8, 32), ("zbv", 4, 8), ("dualpipe", 4, 8)],
)
def test_renumbering_every_order_gives_the_same_program(
    monkeypatch: pytest.MonkeyPatch, name: str, ranks: int, microbatches: int
) -> None:
    # with no room after an order, every message is renumbered (the rare path): same program
    compute = strip_comms(compile_schedule(name, ranks=ranks, microbatches=microbatches))
    slotted = lower(compute, DEFAULT)
    monkeypatch.setattr(refine, "SLOTS", 1)
    assert lower(compute, DEFAULT) == slotted


def test_groups_hold_one_moment_and_one_peer() -> None:
    program = compile_schedule("interleaved_1f1b", ranks=4, microbatches=16)
    for instrs in program.ranks:
        peers: dict[int, set[int]] = {}
        for instr in instrs:
            if (type(instr) is Send or type(instr) is Recv) and instr.group is not None:
                peers.setdefault(instr.group, set()).add(instr.peer)
        assert all(len(members) == 1 for members in peers.values())
    by_time = lower(strip_comms(program), replace(DEFAULT, grouping=Grouping.BY_TIME))
    assert by_time != program


def test_torch_stage_ops_alone_are_not_hand_placed_comm_ops() -> None:
    # a torch CSV with UNSHARD/RESHARD/REDUCE_GRAD and no comm cells gets the sends and
    # receives of the same compute order without them (the refinements included)
    program = compile_schedule("zb_h1", ranks=4, microbatches=8)
    with_stage_ops = torch_csv.loads(torch_csv.dumps(program, with_comms=True)).program
    compute_and_stage_ops = replace(
        with_stage_ops,
        ranks=tuple(
            tuple(
                i
                for i in instrs
                if type(i) is not Send and type(i) is not Recv and type(i) is not Wait
            )
            for instrs in with_stage_ops.ranks
        ),
    )
    lowered = lower(compute_and_stage_ops, DEFAULT)
    for ours, theirs in zip(lowered.ranks, program.ranks, strict=True):  # (wait indices shift)
        assert [i for i in ours if type(i) is not StageOp and type(i) is not Wait] == [
            i for i in theirs if type(i) is not Wait
        ]
