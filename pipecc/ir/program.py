"""The compiled program: one instruction list per rank, plus what it was compiled for."""

from __future__ import annotations

from dataclasses import dataclass

from pipecc.ir.ops import Instr
from pipecc.ir.placement import Placement

# Lowering policies whose programs only a backend with independent progress (gloo: DESIGN §5's
# `rendezvous` model) can run: under NCCL's ordered streams they deadlock (docs/compile.md).
RENDEZVOUS_ONLY = frozenset({"early-recv"})


@dataclass(frozen=True, slots=True)
class Program:
    """A schedule compiled for P ranks and M microbatches (DESIGN §4).

    `ranks[r]` is rank r's instruction list in execution order. `comm` names the lowering
    policy that placed the communication ops ("none" for a compute-only program).
    """

    schedule: str
    source: str
    num_ranks: int
    num_microbatches: int
    params: tuple[tuple[str, int], ...]
    comm: str
    placement: Placement
    ranks: tuple[tuple[Instr, ...], ...]

    def num_instructions(self) -> int:
        return sum(len(instrs) for instrs in self.ranks)
