"""The runtime on NCCL's matching, emulated on CPU: aligned programs equal the reference.

NCCL initialised lazily runs a `batch_isend_irecv` on the process group's communicator and a
lone `isend`/`irecv` on a pair communicator of its own, so a message posted in a group on one
side and alone on the other never matches (nccl_emulation.py emulates that over gloo).
Aligned programs have such messages (a group of the sender's is not one of the receiver's),
so the runtime posts every op through `batch_isend_irecv` where the backend coalesces
(runtime/comm/channel.py). One process group of 4 ranks runs the aligned programs of
zb_h1, zbv, dualpipev and interleaved_zb at P=4, as `pipecc run --align` places them on
NCCL, over the emulation, each against the single-process reference.
"""

from __future__ import annotations

from typing import Any

import pytest
from nccl_emulation import run_emulated
from pipecc.runtime.tools.spawn import spawn
from runtime_cases import Case
from test_runtime_schedules import _assert_matches_reference

from pipecc.driver.compile import Alignment, Lowering, compile_schedule
from pipecc.driver.load import RunBackend
from pipecc.ir.ops import Recv, Send
from pipecc.ir.program import Program
from pipecc.semantics.costs import CostModel


def aligned(name: str, microbatches: int) -> Program:
    """The program `pipecc run NAME --nproc 4 -M microbatches --align` runs on NCCL."""
    align = Alignment(CostModel(), RunBackend.NCCL.comm_model)
    return compile_schedule(
        name, ranks=4, microbatches=microbatches, lowering=Lowering(align=align)
    )


CASES = tuple(
    Case(f"aligned-{name}-P4-M{microbatches}", aligned(name, microbatches))
    for name, microbatches in (("zb_h1", 4), ("zbv", 4), ("dualpipev", 8), ("interleaved_zb", 4))
)
IDS = [case.name for case in CASES]


@pytest.fixture(scope="module")
def emulated() -> list[dict[str, Any]]:
    return spawn(run_emulated, 4, list(CASES), timeout=120.0)


def one_sided(program: Program) -> int:
    """Messages grouped on one side and alone on the other (each pair's k-th send is its
    k-th receive)."""
    sends: dict[tuple[int, int], list[Send]] = {}
    recvs: dict[tuple[int, int], list[Recv]] = {}
    for rank, instrs in enumerate(program.ranks):
        for instr in instrs:
            if type(instr) is Send:
                sends.setdefault((rank, instr.peer), []).append(instr)
            elif type(instr) is Recv:
                recvs.setdefault((instr.peer, rank), []).append(instr)
    return sum(
        (send.group is None) != (recv.group is None)
        for pair, sent in sends.items()
        for send, recv in zip(sent, recvs[pair], strict=True)
    )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_aligned_programs_over_nccl_matching_equal_the_reference(
    emulated: list[dict[str, Any]], case: Case
) -> None:
    per_rank = [result["cases"][case.name] for result in emulated]
    _assert_matches_reference(per_rank, case.program.num_microbatches)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_op_of_the_program_went_out_in_a_batch(
    emulated: list[dict[str, Any]], case: Case
) -> None:
    """Every send and receive of the step was posted through `batch_isend_irecv` (one
    tensor per message here), so all are on the group's communicator."""
    for rank, result in enumerate(emulated):
        comm = sum(type(i) is Send or type(i) is Recv for i in case.program.ranks[rank])
        assert result["coalesced"][case.name] == comm, f"rank {rank}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_programs_group_messages_on_one_side_only(case: Case) -> None:
    """Positive control: each program has messages that a per-op posting would put on two
    communicators (what these cases test)."""
    assert one_sided(case.program) > 0


def test_the_emulation_matches_per_communicator(emulated: list[dict[str, Any]]) -> None:
    """Positive control: a message sent in a batch and received alone does not meet its
    receive; the receive alone takes the next message sent alone (the wrong tensor), the
    batched receive the batched send. Posted all in batches, they match in order."""
    assert emulated[1]["crossing"] == [20.0, 10.0]
    assert emulated[1]["batched"] == [10.0, 20.0]
