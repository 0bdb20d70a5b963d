"""The default lowering: every message sent once and received once, in the same order on both
sides of every pair; every posted op waited exactly once; a recv waited before its consumer."""

from __future__ import annotations

from collections import defaultdict

import pytest
from helpers import compile_bundled

from pipecc.interop import json_program
from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import Compute, Fused, Recv, Send, Wait, computations
from pipecc.ir.program import Backend, Program
from pipecc.passes.insert_comms import DEFAULT, EARLY_RECV, POLICIES, insert_comms, strip_comms
from pipecc.semantics import CommModel
from pipecc.verify import Options, verify

SIZES = {
    "gpipe": [(2, 1), (3, 5), (4, 8)],
    "1f1b": [(2, 1), (3, 5), (4, 8)],
    "interleaved_1f1b": [(2, 4), (3, 6), (4, 8)],
    "interleaved_zb": [(2, 4), (3, 6), (4, 8)],
    "looped_bfs": [(2, 3), (4, 8)],
    "zb_h1": [(2, 2), (3, 5), (4, 8)],
    "zb_h2": [(2, 3), (3, 6), (4, 8)],
    "zbv": [(2, 1), (3, 4), (4, 8)],
    "dualpipe": [(2, 4), (4, 8), (6, 14)],
    "dualpipev": [(2, 4), (3, 7), (4, 8)],
}


def check_lowering(program: Program) -> None:
    """Structural invariants of a lowered program (assertion messages name rank and index)."""
    flow = MessageKeys(program.placement)
    sends: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # type: ignore[type-arg]
    recvs: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # type: ignore[type-arg]
    for rank, instrs in enumerate(program.ranks):
        waited_at: dict[int, int] = {}
        for index, instr in enumerate(instrs):
            if isinstance(instr, Send):
                sends[(rank, instr.peer)].append(instr[:5][0:1] + instr[2:5])
            elif isinstance(instr, Recv):
                recvs[(instr.peer, rank)].append(instr[:5][0:1] + instr[2:5])
            elif isinstance(instr, Wait):
                for target in instr.ops:
                    assert target not in waited_at, f"rank {rank}: op {target} waited twice"
                    assert isinstance(instrs[target], Send | Recv)
                    waited_at[target] = index
        posted = [i for i, instr in enumerate(instrs) if isinstance(instr, Send | Recv)]
        assert sorted(waited_at) == posted, f"rank {rank}: posted ops never waited"
        _check_recvs_before_use(rank, instrs, waited_at, flow)
    assert dict(sends) == dict(recvs)


def _check_recvs_before_use(
    rank: int,
    instrs: tuple,
    waited_at: dict[int, int],  # type: ignore[type-arg]
    flow: MessageKeys,
) -> None:
    recv_index = {}
    for index, instr in enumerate(instrs):
        if isinstance(instr, Recv):
            recv_index[flow.key(instr.what, instr.pipe, instr.stage, instr.mb)] = index
        if isinstance(instr, Compute | Fused):
            for op in computations(instr):
                needed = flow.input_flow(op.kind, op.pipe, op.stage, op.mb)
                if needed is None or needed.src == rank:
                    continue
                at = recv_index[needed.key]
                assert waited_at[at] < index, f"rank {rank}: {op.label()} before its wait"


@pytest.mark.parametrize("schedule", sorted(SIZES))
def test_default_lowering_invariants(schedule: str) -> None:
    for ranks, microbatches in SIZES[schedule]:
        check_lowering(compile_bundled(schedule, ranks, microbatches))


def test_posts_between_computes_form_one_group() -> None:
    program = compile_bundled("1f1b", 2, 3)
    rank0 = program.ranks[0]
    groups = [instr.group for instr in rank0 if isinstance(instr, Send | Recv)]
    # the first send goes alone; afterwards a send and a recv are posted together
    assert groups[0] is None
    assert groups[1] == groups[2] == 0


def test_local_handoff_has_no_comm_ops() -> None:
    # the last rank of a V passes chunk 0's output to chunk 1 without sending
    program = compile_bundled("zbv", 2, 2)
    last = program.ranks[1]
    assert not [i for i in last if isinstance(i, Send | Recv) and i.peer == 1]


@pytest.mark.parametrize("schedule", sorted(SIZES))
def test_early_recv_posts_every_receive_first_and_is_for_gloo_only(schedule: str) -> None:
    for ranks, microbatches in SIZES[schedule]:
        default = compile_bundled(schedule, ranks, microbatches)
        early = insert_comms(strip_comms(default), placement=EARLY_RECV)
        assert early.comm == "early-recv" and early.backend is Backend.INDEPENDENT_PROGRESS
        assert default.backend is Backend.ANY
        check_lowering(early)
        for rank, instrs in enumerate(early.ranks):
            computes = [i for i in instrs if isinstance(i, Compute | Fused)]
            assert computes == [i for i in default.ranks[rank] if isinstance(i, Compute | Fused)]
            first = next(k for k, i in enumerate(instrs) if isinstance(i, Compute | Fused))
            late = [k for k, i in enumerate(instrs) if isinstance(i, Recv) and k > first]
            assert not late, f"rank {rank}: receives posted after the first compute op: {late}"
        verdicts = {m: verify(early, Options(models=(m,))).ok for m in CommModel}
        assert verdicts[CommModel.RENDEZVOUS] and verdicts[CommModel.EAGER]
        # every pair sends both ways, and on NCCL's ordered streams the receives posted
        # first hold up the sends behind them
        assert not verdicts[CommModel.NCCL] and not verdicts[CommModel.NCCL_SINGLE]


def test_policies() -> None:
    assert POLICIES == {"default": DEFAULT, "early-recv": EARLY_RECV}
    assert EARLY_RECV.backend is Backend.INDEPENDENT_PROGRESS
    assert DEFAULT.backend is Backend.ANY


def test_the_backend_a_policy_needs_survives_json() -> None:
    """The runtime reads `Program.backend`: a compiled .json must keep it (derived from the
    policy name the JSON records, so the format is unchanged)."""
    for placement in (DEFAULT, EARLY_RECV):
        program = insert_comms(strip_comms(compile_bundled("zb_h1", 4, 8)), placement=placement)
        loaded = json_program.loads(json_program.dumps(program), "p.json")
        assert loaded.backend is placement.backend
        assert loaded == program
