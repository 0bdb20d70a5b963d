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
from pipecc.semantics import CommModel, replay
from pipecc.semantics.costs import CostTiming, parse_cost_flag
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


def test_posts_of_one_moment_form_one_group() -> None:
    # 1F1B: rank 0's send of microbatch 1 and its receive of the gradient of microbatch 0
    # share a gap but come to exist at different moments: each is posted alone
    program = compile_bundled("1f1b", 2, 3)
    assert all(i.group is None for i in program.ranks[0] if isinstance(i, Send | Recv))
    # DualPipe: the two outputs of one F&B are made at one moment and posted together
    rank0 = compile_bundled("dualpipe", 4, 8).ranks[0]
    fused = next(k for k, i in enumerate(rank0) if isinstance(i, Fused))
    first, second = rank0[fused + 1], rank0[fused + 2]
    assert isinstance(first, Send) and isinstance(second, Send)
    assert first.group is not None and first.group == second.group


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


@pytest.mark.parametrize("schedule", sorted(SIZES))
def test_a_send_is_completed_with_the_next_receive_from_its_peer(schedule: str) -> None:
    """Structure: a send's Wait is the one of the first receive from the same peer posted
    after it, or the rank's final Wait when there is none."""
    for ranks, microbatches in SIZES[schedule]:
        program = compile_bundled(schedule, ranks, microbatches)
        for rank, instrs in enumerate(program.ranks):
            waited_at = {t: k for k, i in enumerate(instrs) if isinstance(i, Wait) for t in i.ops}
            last_wait = max(waited_at.values(), default=-1)
            for k, send in enumerate(instrs):
                if not isinstance(send, Send):
                    continue
                reply = next(
                    (j for j in range(k + 1, len(instrs)) if _recv_from(instrs[j], send.peer)),
                    None,
                )
                expected = last_wait if reply is None else waited_at[reply]
                assert waited_at[k] == expected, f"{schedule} P={ranks} rank {rank} send [{k}]"


def _recv_from(instr: object, peer: int) -> bool:
    return isinstance(instr, Recv) and instr.peer == peer


@pytest.mark.parametrize("model", list(CommModel))
def test_waiting_for_a_send_never_holds_a_rank_up(model: CommModel) -> None:
    """Timing: in every default program, under every comm model and latency, a Wait that
    completes sends is released no later than its receives (or the rank) allow; only the
    rank's final Wait, for the sends no receive follows, waits for them."""
    for schedule in ("1f1b", "zb_h1", "interleaved_1f1b", "zbv", "dualpipe"):
        ranks, microbatches = SIZES[schedule][-1]
        program = compile_bundled(schedule, ranks, microbatches)
        for comm in (0, 0.3, 1):
            costs = parse_cost_flag(f"F=1,B=2,I=1,W=1,comm={comm}")
            run = replay(program, model=model, timing=CostTiming(costs))
            assert run.finished
            for rank, instrs in enumerate(program.ranks):
                for k, instr in enumerate(instrs):
                    if not isinstance(instr, Wait) or k in (0, len(instrs) - 1):
                        continue
                    ready = run.end_time(rank, k - 1) or 0.0
                    for target in instr.ops:
                        if isinstance(instrs[target], Recv):
                            ready = max(ready, run.done_time(rank, target) or 0.0)
                    released = run.start_time(rank, k)
                    assert released is not None and released <= ready + 1e-9, (
                        f"{schedule} comm={comm} rank {rank} wait [{k}]"
                    )
