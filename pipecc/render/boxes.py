"""What every picture of a simulated step draws: the boxes of the compute ops, the arrows of
the messages, their colours (one per op kind, the second chunk of a rank in a lighter shade,
as the DualPipe and zero-bubble papers draw the two directions) and the axis ticks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from pipecc.ir.ops import Compute, Fused, Kind, Send, Sequential, computations
from pipecc.ir.printer import has_pipes, message
from pipecc.simulate.timeline import Timeline

COLOURS = {  # (chunk 0, chunk 1+)
    Kind.F: ("#4e79a7", "#a0c4e8"),
    Kind.B: ("#59a14f", "#a6d89b"),
    Kind.I: ("#17becf", "#9de4ec"),
    Kind.W: ("#b07aa1", "#dcbfd6"),
}


@dataclass(frozen=True, slots=True)
class Box:
    """One computation to draw: on `rank`, from `start` to `end`, in `band` (0 = whole row,
    1/2 = upper/lower half of a fused op)."""

    rank: int
    start: float
    end: float
    kind: Kind
    chunk: int
    mb: int
    band: int


def boxes(timeline: Timeline) -> list[Box]:
    """The computations of a timeline, fused ops split into their two halves."""
    found = []
    for rank, _, instr, start, end in timeline.ops():
        if type(instr) is Compute:
            found.append(Box(rank, start, end, instr.kind, instr.chunk, instr.mb, 0))
        elif type(instr) is Fused or type(instr) is Sequential:
            for band, op in enumerate(computations(instr), start=1):
                found.append(Box(rank, start, end, op.kind, op.chunk, op.mb, band))
    return found


class Arrow(NamedTuple):
    """A message drawn as an arrow: from the send's post to the receive's completion."""

    src: int
    sent: float
    dst: int
    arrived: float
    label: str  # the message (`act stage 2 mb 3`)


def messages(timeline: Timeline) -> list[Arrow]:
    """Every message of the timeline that was delivered."""
    run = timeline.replay
    pipes = has_pipes(run.program)
    found: list[Arrow] = []
    for rank, index, instr, _, _ in timeline.ops():
        if type(instr) is not Send:
            continue
        partner = run.partner(rank, index)
        if partner is None:
            continue
        done = run.done_time(*partner)
        if done is not None:
            posted = run.post_time(rank, index) or 0.0
            found.append(Arrow(rank, posted, partner[0], done, message(instr, pipes=pipes)))
    return found


def colour(box: Box) -> str:
    return COLOURS[box.kind][0 if box.chunk == 0 else 1]


def tick_step(span: float, columns: int) -> float:
    raw = span / max(1, columns // 10)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return factor * power
    return 10 * power
