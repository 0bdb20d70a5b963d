"""What each instruction of a wired program costs under a timing, for the replay engine
(pipecc/semantics/engine.py): its duration on its rank's clock and its latency."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from pipecc.ir.ops import Collective, Compute, Fused, Send
from pipecc.semantics.model import ZERO_TIMING, Timing
from pipecc.semantics.wiring import COLL, COMPUTE, SEND, WAIT, Wiring


def instruction_costs(wiring: Wiring, timing: Timing) -> tuple[Sequence[float], Sequence[float]]:
    """Per instruction: the time it takes on its rank's clock (a compute op's duration, a
    post's or a Wait's host overhead); the latency of a send, copied to its partner recv so
    that either side can look it up."""
    n = len(wiring.code)
    if timing is ZERO_TIMING:
        zeros = [0.0] * n
        return zeros, zeros
    dur = [0.0] * n
    lat = [0.0] * n
    code, partner = wiring.code, wiring.partner
    for rank, instrs in enumerate(wiring.program.ranks):
        base = wiring.offsets[rank]
        for index, instr in enumerate(instrs):
            g = base + index
            if code[g] == COMPUTE:
                dur[g] = timing.duration(rank, index, cast("Compute | Fused", instr))
            elif code[g] == SEND:
                lat[g] = timing.latency(rank, index, cast("Send", instr))
                if partner[g] >= 0:
                    lat[partner[g]] = lat[g]
        post, wait = timing.overhead(rank)
        if post or wait:
            for g in range(base, base + len(instrs)):
                if code[g] != COMPUTE:
                    dur[g] = wait if code[g] == WAIT else post
    return dur, lat


def collective_costs(wiring: Wiring, timing: Timing, lat: list[float]) -> list[float]:
    """The duration of each collective: from its last member's readiness to its completion
    (kept where a send keeps its latency)."""
    for rank, instrs in enumerate(wiring.program.ranks):
        base = wiring.offsets[rank]
        for index, instr in enumerate(instrs):
            if wiring.code[base + index] == COLL:
                lat[base + index] = timing.collective(rank, index, cast("Collective", instr))
    return lat
