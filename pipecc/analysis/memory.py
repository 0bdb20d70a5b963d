"""The one memory rule (DESIGN §2): how many activations a rank holds, instruction by
instruction.

One unit is one stage's activations for one microbatch: F allocates 1; B frees 1; I frees 0
(what W needs stays); W frees 1; a fused op allocates its forward before its backward frees;
a sequential op (torch's OVERLAP_F_B) applies its parts in the order written.
With these units the peaks are P for 1F1B and ZB-H1 and 2P-1 for ZB-H2, on rank 0. The
verifier's --max-activations and the simulator's peaks (in units and, with `act_bytes`, in
bytes) both read them here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from pipecc.ir.ops import Compute, Fused, Instr, Kind, Sequential, computations

_F, _I = Kind.F, Kind.I


class RankPeak(NamedTuple):
    """The most live activation units of a rank, first reached at instruction `at` (-1 for a
    rank without computations)."""

    peak: int
    at: int


def activation_delta(kind: Kind) -> int:
    """Units a computation of this kind allocates (+1) or frees (-1)."""
    # identity tests: hashing an enum member for a dict lookup is a Python-level call
    return 1 if kind is _F else 0 if kind is _I else -1


def peak_activations(instrs: Sequence[Instr]) -> RankPeak:
    """The peak of one rank's instruction list, in units."""
    live, top, at = 0, 0, -1
    for index, instr in enumerate(instrs):
        if type(instr) is Compute:
            live += activation_delta(instr.kind)
        elif type(instr) is Fused:
            live += activation_delta(instr.forward.kind)
            if live > top:  # the forward allocates before the backward frees
                top, at = live, index
            live += activation_delta(instr.backward.kind)
        elif type(instr) is Sequential:  # torch's OVERLAP_F_B: its parts in the order written
            for op in instr.parts:
                live += activation_delta(op.kind)
                if live > top:
                    top, at = live, index
            continue
        else:
            continue
        if live > top:
            top, at = live, index
    return RankPeak(top, at)


def peak_bytes(instrs: Sequence[Instr], size: Callable[[int], float]) -> float:
    """The peak of one rank in bytes, a unit of stage s weighing `size(s)`."""
    live = peak = 0.0
    for instr in instrs:
        if type(instr) is Compute:
            parts: tuple[Compute, ...] = (instr,)
        elif type(instr) is Fused or type(instr) is Sequential:
            parts = computations(instr)
        else:
            continue
        for op in parts:
            live += activation_delta(op.kind) * size(op.stage)
            peak = max(peak, live)
    return peak
