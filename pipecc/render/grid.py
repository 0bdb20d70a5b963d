"""A simulated step in the terminal: one row per rank, compute ops placed on the time axis,
idle time left empty (`pipecc.render.svg`, `png` and `trace` draw the same `Timeline`)."""

from __future__ import annotations

import math

from pipecc.ir.ops import Instr, is_compute
from pipecc.render.boxes import tick_step
from pipecc.simulate.timeline import Timeline

# ---- terminal grid -------------------------------------------------------------------------


def format_timeline(timeline: Timeline, *, width: int = 120) -> str:
    """One row per rank on a time axis, `width` characters wide at most.

    Each op is drawn over the characters its time covers, labelled `F0.3` (kind, chunk,
    microbatch, as the language writes it) where that fits, else with its kind; `.` is idle
    time. With integer costs and room
    enough, one character row cell is one time unit times a whole scale.
    """
    span = timeline.makespan or 1.0
    scale = _scale(timeline, span, width)
    columns = max(1, math.ceil(span * scale))
    name_width = len(f"rank {timeline.program.num_ranks - 1}")
    rows = [[_EMPTY] * columns for _ in range(timeline.program.num_ranks)]
    for rank, _, instr, start, end in timeline.ops():
        if is_compute(instr):
            _paint(rows[rank], round(start * scale), round(end * scale), _cell(instr))
    for row in rows:
        _mark_idle(row)
    header = _axis(span, scale, columns)
    lines = [f"{' ' * name_width}   {header}"]
    for rank, row in enumerate(rows):
        lines.append(f"{f'rank {rank}'.ljust(name_width)} | {''.join(row).rstrip()}")
    unit = f" {timeline.costs.unit}" if timeline.costs.unit else ""
    lines.append(f"{' ' * name_width}   1 column = {1 / scale:g}{unit}")
    return "\n".join(lines) + "\n"


def _scale(timeline: Timeline, span: float, width: int) -> float:
    """Characters per time unit: the largest whole number that fits (at least 6 characters
    for the shortest op when possible: `F0.3|` and one for rounding), else a fraction."""
    shortest = min(
        (end - start for _, _, i, start, end in timeline.ops() if is_compute(i) and end > start),
        default=1.0,
    )
    fit = width / span
    wanted = 6 / shortest
    scale = min(fit, wanted)
    return math.floor(scale) if scale >= 1 else scale


def _cell(instr: Instr) -> str:
    assert is_compute(instr)
    return instr.label()


def _paint(row: list[str], first: int, last: int, label: str) -> None:
    last = min(max(last, first + 1), len(row))
    text = _fit(label, last - first)
    row[first:last] = list(text)


def _fit(label: str, room: int) -> str:
    """The label in `room` characters, ending with a `|` edge when there is room for one:
    the op as the language writes it, chunk and microbatch both (`F1.2`, a fused
    `F0.4&B1.1`), or only its kind (`F`, `F&B`) where that does not fit. Never a shorter
    form such as `F2`, which the language reads as chunk 2."""
    if room <= 1:
        return label[0]
    for text in (label, _shortest(label)):
        if len(text) <= room - 1:
            return text.ljust(room - 1) + "|"
    return _shortest(label)[: room - 1] + "|"


def _shortest(label: str) -> str:
    return "&".join(part[0] for part in label.split("&"))


_EMPTY = "\0"


def _mark_idle(row: list[str]) -> None:
    """Idle time inside the row is drawn as `.`; nothing after the rank's last op."""
    last = max((i for i, ch in enumerate(row) if ch != _EMPTY), default=-1)
    for column, ch in enumerate(row):
        if ch == _EMPTY:
            row[column] = "." if column <= last else " "


def _axis(span: float, scale: float, columns: int) -> str:
    step = tick_step(span, columns)
    axis = [" "] * (columns + 8)
    tick = 0.0
    while tick <= span + 1e-9:
        label = f"{tick:g}"
        column = round(tick * scale)
        if all(axis[column + i] == " " for i in range(len(label) + 1) if column + i < len(axis)):
            for i, ch in enumerate(label):
                if column + i < len(axis):
                    axis[column + i] = ch
        tick += step
    return "".join(axis).rstrip()
