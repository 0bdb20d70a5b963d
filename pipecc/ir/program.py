"""The compiled program: one instruction list per rank, plus what it was compiled for."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pipecc.ir.ops import Instr
from pipecc.ir.placement import Placement


class Backend(enum.Enum):
    """What a program needs of the backend that carries its messages (DESIGN §5)."""

    ANY = "any"  # runs to completion under every comm model
    # needs every posted op to progress on its own (gloo: the `rendezvous` model); under
    # NCCL's ordered streams it deadlocks by design (the early-recv policy, docs/compile.md)
    INDEPENDENT_PROGRESS = "independent-progress"


@dataclass(frozen=True, slots=True)
class Program:
    """A schedule compiled for P ranks and M microbatches (DESIGN §4).

    `ranks[r]` is rank r's instruction list in execution order. `comm` names the lowering
    policy that placed the communication ops ("none" for a compute-only program); `backend`
    is what that policy needs of the backend, which the verifier and the runtime read.
    """

    schedule: str
    source: str
    num_ranks: int
    num_microbatches: int
    params: tuple[tuple[str, int], ...]
    comm: str
    placement: Placement
    ranks: tuple[tuple[Instr, ...], ...]
    backend: Backend = Backend.ANY

    def num_instructions(self) -> int:
        return sum(len(instrs) for instrs in self.ranks)
