"""What every picture of a simulated step draws: the boxes of the compute ops, the arrows of
the messages, their colours, the legend, the title and the axis ticks.

Colours: one hue family per op kind (F blue, B green, I orange, W purple) and, on a rank
with several chunks, one shade of it per chunk, from dark (chunk 0) to light (the last), as
the DualPipe and zero-bubble papers draw the two directions. The shades are spread along a
ramp dark → saturated → pale whose hue turns a little, so up to 8 chunks stay apart (a test
measures the distances in CIELAB)."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import NamedTuple

from pipecc.ir.ops import Compute, Fused, Kind, Send, Sequential, computations
from pipecc.ir.printer import has_pipes, message
from pipecc.simulate.timeline import Timeline

RAMPS = {  # per kind: the dark, saturated and pale end of its shades (sRGB)
    Kind.F: ("#232a78", "#3f7fd0", "#c2e4f7"),
    Kind.B: ("#1c4a18", "#4ea344", "#def2b0"),
    Kind.I: ("#8a3000", "#f08a2a", "#ffe7a3"),
    Kind.W: ("#4a1654", "#b0569f", "#fad0de"),
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


def num_chunks(timeline: Timeline) -> int:
    """The most chunks a rank of the timeline's program holds: the number of shades."""
    placement = timeline.program.placement
    return max(placement.num_chunks(rank) for rank in range(timeline.program.num_ranks))


def shade(kind: Kind, chunk: int, chunks: int) -> str:
    """The colour of `kind` on `chunk` of a rank with `chunks` chunks: the saturated middle
    of the kind's ramp for one chunk, else evenly spaced along it, over more of it the more
    chunks there are (two chunks keep clear of the darkest and palest ends, where the kinds
    look most alike; eight use all of it)."""
    if chunks <= 1:
        return shade_at(kind, 0.5)
    inset = 0.2 * max(0, 8 - chunks) / 6
    return shade_at(kind, inset + (1 - 2 * inset) * min(chunk, chunks - 1) / (chunks - 1))


def shade_at(kind: Kind, where: float) -> str:
    """The colour at `where` (0 dark .. 1 pale) along the ramp of `kind`."""
    dark, middle, pale = RAMPS[kind]
    if where <= 0.5:
        return _mix(dark, middle, where * 2)
    return _mix(middle, pale, where * 2 - 1)


def _mix(a: str, b: str, t: float) -> str:
    ends = [(int(a[i : i + 2], 16), int(b[i : i + 2], 16)) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in ends)


def colour(box: Box, chunks: int) -> str:
    return shade(box.kind, box.chunk, chunks)


DARK_INK = "#1a1a1a"


def ink(fill: str) -> str:
    """The colour of text on `fill`: white or near-black, whichever contrasts more."""
    background = luminance(fill)
    on_white = 1.05 / (background + 0.05)
    on_dark = (background + 0.05) / (luminance(DARK_INK) + 0.05)
    return "white" if on_white >= on_dark else DARK_INK


def luminance(fill: str) -> float:
    """The relative luminance of an sRGB colour `#rrggbb` (WCAG 2)."""
    channels = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def legend(drawn: list[Box], chunks: int) -> list[tuple[str, str]]:
    """(label, colour) for each op kind and chunk the picture shows, in kind then chunk
    order, named as pipecc names ops (`F0`, `I1`)."""
    present = {(box.kind, box.chunk) for box in drawn}
    return [
        (f"{kind.value}{chunk}", shade(kind, chunk, chunks))
        for kind in Kind
        for chunk in sorted(c for k, c in present if k is kind)
    ]


FUSED_NOTE = "fused op: forward above, backward below"


def title(timeline: Timeline) -> str:
    """The one title of every picture of a timeline."""
    program = timeline.program
    return (
        f"{program.schedule}  P={program.num_ranks} M={program.num_microbatches}  "
        f"makespan {timeline.makespan:g}  bubble {timeline.bubble_ratio:.1%}  "
        f"({timeline.model.value}; {timeline.costs.describe()})"
    )


def wrap(text: str, columns: int) -> list[str]:
    """`text` in lines of at most `columns` characters (at least 20), broken at spaces."""
    return textwrap.wrap(text, max(20, columns), break_on_hyphens=False) or [""]


def tick_step(span: float, columns: int) -> float:
    raw = span / max(1, columns // 10)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return factor * power
    return 10 * power
