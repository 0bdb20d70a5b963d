"""Hand-placed sends, receives, groups and waits (docs/dsl.md, "Placing comms by hand")."""

from __future__ import annotations

import pytest
from test_insert_comms import check_lowering

from pipecc.api import compile_source
from pipecc.diagnostics import ScheduleError
from pipecc.ir.ops import Compute, Kind, Msg, Recv, Send, Wait
from pipecc.ir.printer import describe
from pipecc.semantics import CommModel, replay

ZB_H1_SEND_BEFORE_W = """
require M >= P
phase warmup   { repeat P - rank { F } }
phase fill     { repeat rank { I F } }
phase steady   { repeat M - P { if rank > 0 { I send grad W F } else { I W F } } }
phase cooldown { repeat P - rank { if rank > 0 { I send grad W } else { I W } } }
phase drain    { repeat rank { W } }
"""


def _compile(text: str, ranks: int = 3, microbatches: int = 4):  # type: ignore[no-untyped-def]
    return compile_source(text, "t.sched", ranks=ranks, microbatches=microbatches)


def test_hand_placed_send_stays_between_i_and_w() -> None:
    program = _compile(ZB_H1_SEND_BEFORE_W)
    check_lowering(program)
    rank1 = program.ranks[1]
    for index, instr in enumerate(rank1):
        if isinstance(instr, Send) and instr.span is not None:
            assert rank1[index - 1].kind is Kind.I  # type: ignore[union-attr]
            assert instr.what is Msg.GRAD and instr.mb == rank1[index - 1].mb  # type: ignore[union-attr]
    manual = [i for i in rank1 if isinstance(i, Send) and i.span is not None]
    assert len(manual) == 4 - 1  # steady (M-P = 1) + cooldown (P - 1 - ... = 2) on rank 1


def test_rank_zero_has_no_gradient_to_send() -> None:
    with pytest.raises(ScheduleError, match="send grad on rank 0: no gradient produced"):
        _compile("phase p { F I send grad W }", ranks=2, microbatches=1)


def test_recv_group_and_wait_by_hand() -> None:
    text = """
    phase p {
      if rank == 0 { F send act recv grad wait B }
      else { group { recv act } wait F B send grad wait }
    }
    """
    program = _compile(text, ranks=2, microbatches=1)
    check_lowering(program)
    assert [describe(i) for i in program.ranks[1]] == [
        "recv act pipe 0 stage 1 mb 0 from rank 0 [group 0]",
        "wait 0",
        "F0.0",
        "B0.0",
        "send grad pipe 0 stage 0 mb 0 to rank 0",
        "wait 4",
    ]
    rank0 = program.ranks[0]
    assert [type(i).__name__ for i in rank0] == ["Compute", "Send", "Recv", "Wait", "Compute"]
    assert isinstance(rank0[3], Wait) and rank0[3].ops == (1, 2)


def test_recv_without_consumer_is_an_error() -> None:
    with pytest.raises(ScheduleError, match="recv grad on rank 0: no later op on this rank"):
        _compile("phase p { F B recv grad }", ranks=2, microbatches=1)


def test_wait_with_nothing_posted_is_an_error() -> None:
    with pytest.raises(ScheduleError, match="wait on rank 0: no hand-placed send or recv"):
        _compile("phase p { wait F B }", ranks=1, microbatches=1)


def test_auto_ops_fill_in_around_hand_placed_ones() -> None:
    program = _compile(ZB_H1_SEND_BEFORE_W)
    # rank 0 still receives every gradient (auto-placed), rank 2 still receives activations
    rank0_recvs = [i for i in program.ranks[0] if isinstance(i, Recv)]
    assert len(rank0_recvs) == 4
    assert all(isinstance(i, Compute | Send | Recv | Wait) for i in program.ranks[2])


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 2), (2, 3), (3, 4), (4, 8)])
def test_hand_placed_sends_keep_each_pair_in_one_order(ranks: int, microbatches: int) -> None:
    # GPipe with every send written right after its producer: the receives the compiler
    # places must be merged with the hand-placed sends by the global order, or a rank posts
    # a later gradient's receive before an earlier activation's send (a deadlock on NCCL)
    text = """
    phase fwd { repeat M { if rank < P - 1 { F send act } else { F } } }
    phase bwd { repeat M { if rank > 0 { B send grad } else { B } } }
    """
    program = compile_source(text, "hand.sched", ranks=ranks, microbatches=microbatches)
    check_lowering(program)
    for model in CommModel:
        assert replay(program, model=model).finished, model
