"""Pictures of a simulated step: a terminal grid, an SVG Gantt chart, a PNG (through
matplotlib, when installed) and a Chrome/Perfetto trace.

All of them draw the same `Timeline`: one row per rank, compute ops placed on the time axis,
idle time left empty, microbatch numbers in the boxes, colours per op kind, the second chunk
of a rank in a lighter shade (as the DualPipe and zero-bubble papers draw the two directions).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from html import escape
from typing import Any

from pipecc.ir.ops import Compute, Fused, Instr, Kind, Recv, Send
from pipecc.simulate import Timeline

# ---- shared --------------------------------------------------------------------------------

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
        elif type(instr) is Fused:
            for band, op in enumerate((instr.forward, instr.backward), start=1):
                found.append(Box(rank, start, end, op.kind, op.chunk, op.mb, band))
    return found


def messages(timeline: Timeline) -> list[tuple[int, float, int, float, str]]:
    """(src rank, send post time, dst rank, recv completion time, label) per message."""
    run = timeline.replay
    found = []
    for rank, index, instr, _, _ in timeline.ops():
        if type(instr) is not Send:
            continue
        partner = run.partner(rank, index)
        if partner is None:
            continue
        done = run.done_time(*partner)
        if done is not None:
            posted = run.post_time(rank, index) or 0.0
            found.append((rank, posted, partner[0], done, _message_label(instr)))
    return found


def _message_label(instr: Send | Recv) -> str:
    return f"{instr.what.value} s{instr.stage} mb{instr.mb}"


def _colour(box: Box) -> str:
    return COLOURS[box.kind][0 if box.chunk == 0 else 1]


# ---- terminal grid -------------------------------------------------------------------------


def format_timeline(timeline: Timeline, *, width: int = 120) -> str:
    """One row per rank on a time axis, `width` characters wide at most.

    Each op is drawn over the characters its time covers, labelled with as much of
    `F0.3` (kind, chunk, microbatch) as fits; `.` is idle time. With integer costs and room
    enough, one character row cell is one time unit times a whole scale.
    """
    span = timeline.makespan or 1.0
    scale = _scale(timeline, span, width)
    columns = max(1, math.ceil(span * scale))
    name_width = len(f"rank {timeline.program.num_ranks - 1}")
    rows = [[_EMPTY] * columns for _ in range(timeline.program.num_ranks)]
    for rank, _, instr, start, end in timeline.ops():
        if type(instr) is Compute or type(instr) is Fused:
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
    """Characters per time unit: the largest whole number that fits (at least 4 characters
    for the shortest op when possible), else a fraction."""
    shortest = min(
        (
            end - start
            for _, _, i, start, end in timeline.ops()
            if (type(i) is Compute or type(i) is Fused) and end > start
        ),
        default=1.0,
    )
    fit = width / span
    wanted = 4 / shortest
    scale = min(fit, wanted)
    return math.floor(scale) if scale >= 1 else scale


def _cell(instr: Instr) -> str:
    assert type(instr) is Compute or type(instr) is Fused
    return instr.label()


def _paint(row: list[str], first: int, last: int, label: str) -> None:
    last = min(max(last, first + 1), len(row))
    text = _fit(label, last - first)
    row[first:last] = list(text)


def _fit(label: str, room: int) -> str:
    """The label in `room` characters, ending with a `|` edge when there is room for one:
    `F0.3` → `F3` → `F` as room shrinks (a fused `F0.4&B1.1` → `F4&B1` → `F&B`)."""
    if room <= 1:
        return label[0]
    for text in (label, _short(label), _shortest(label)):
        if len(text) <= room - 1:
            return text.ljust(room - 1) + "|"
    return _shortest(label)[: room - 1] + "|"


def _short(label: str) -> str:
    return "&".join(part[0] + part.split(".")[-1] for part in label.split("&"))


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
    step = _tick_step(span, columns)
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


def _tick_step(span: float, columns: int) -> float:
    raw = span / max(1, columns // 10)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return factor * power
    return 10 * power


# ---- SVG -----------------------------------------------------------------------------------

ROW, TOP, LEFT, RIGHT, BOTTOM = 26, 36, 64, 16, 60


def render_svg(
    timeline: Timeline, *, arrows: bool = False, px_per_unit: float | None = None
) -> str:
    """An SVG Gantt chart: rank rows, op boxes with microbatch numbers, time axis, legend."""
    span = timeline.makespan or 1.0
    scale = px_per_unit or max(4.0, min(40.0, 1400.0 / span))
    ranks = timeline.program.num_ranks
    width = LEFT + span * scale + RIGHT
    height = TOP + ranks * ROW + BOTTOM
    title = (
        f"{timeline.program.schedule}  P={ranks} M={timeline.program.num_microbatches}  "
        f"makespan {timeline.makespan:g}  bubble {timeline.bubble_ratio:.1%}  "
        f"({timeline.model.value}; {timeline.costs.describe()})"
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{LEFT}" y="16" font-size="13">{escape(title)}</text>',
    ]
    for rank in range(ranks):
        y = TOP + rank * ROW
        parts.append(
            f'<text x="{LEFT - 8}" y="{y + ROW / 2 + 4}" text-anchor="end">rank {rank}</text>'
        )
        parts.append(
            f'<rect x="{LEFT}" y="{y + 1}" width="{span * scale:.2f}" '
            f'height="{ROW - 2}" fill="#f4f4f4"/>'
        )
    drawn = boxes(timeline)
    parts.extend(_svg_box(box, scale) for box in drawn)
    if arrows:
        parts.extend(_svg_arrow(m, scale) for m in messages(timeline))
    parts.append(_svg_axis(span, scale, TOP + ranks * ROW))
    parts.append(_svg_legend(TOP + ranks * ROW + 34, drawn))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _svg_box(box: Box, scale: float) -> str:
    x = LEFT + box.start * scale
    w = max(0.5, (box.end - box.start) * scale - 0.6)
    y = TOP + box.rank * ROW + 1
    h = ROW - 2
    if box.band:
        h = (ROW - 2) / 2
        y += (box.band - 1) * h
    text = ""
    if w >= 9:
        size = min(11.0, h * 0.8)
        ink = "white" if box.chunk == 0 else "#1a1a1a"
        text = (
            f'<text x="{x + w / 2:.2f}" y="{y + h / 2 + size * 0.35:.2f}" '
            f'text-anchor="middle" font-size="{size:.1f}" fill="{ink}">{box.mb}</text>'
        )
    tip = f"{box.kind.value}{box.chunk}.{box.mb}  {box.start:g}–{box.end:g}"
    return (
        f'<g><title>{tip}</title><rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" '
        f'height="{h:.2f}" fill="{_colour(box)}" stroke="white" stroke-width="0.5"/>{text}'
        "</g>"
    )


def _svg_arrow(message: tuple[int, float, int, float, str], scale: float) -> str:
    src, sent, dst, arrived, label = message
    x1, y1 = LEFT + sent * scale, TOP + src * ROW + ROW / 2
    x2, y2 = LEFT + arrived * scale, TOP + dst * ROW + ROW / 2
    return (
        f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" stroke="#333" '
        f'stroke-width="0.6" stroke-opacity="0.5"><title>{escape(label)}</title></line>'
    )


def _svg_axis(span: float, scale: float, y: float) -> str:
    step = _tick_step(span, int(span * scale / 60) * 10 or 10)
    parts = [
        f'<line x1="{LEFT}" y1="{y + 2}" x2="{LEFT + span * scale:.2f}" y2="{y + 2}" '
        'stroke="#333"/>'
    ]
    tick = 0.0
    while tick <= span + 1e-9:
        x = LEFT + tick * scale
        parts.append(f'<line x1="{x:.2f}" y1="{y + 2}" x2="{x:.2f}" y2="{y + 6}" stroke="#333"/>')
        parts.append(f'<text x="{x:.2f}" y="{y + 17}" text-anchor="middle">{tick:g}</text>')
        tick += step
    return "\n".join(parts)


def _svg_legend(y: float, drawn: list[Box]) -> str:
    """One entry per (op kind, first or later chunk) the chart shows."""
    parts = []
    x = LEFT
    present = {(box.kind, min(box.chunk, 1)) for box in drawn}
    entries = [
        (f"{kind.value} chunk {c}" if c == 0 else f"{kind.value} chunk ≥1", COLOURS[kind][c])
        for kind in Kind
        for c in (0, 1)
        if (kind, c) in present
    ]
    for label, colour in entries:
        parts.append(f'<rect x="{x}" y="{y - 9}" width="12" height="12" fill="{colour}"/>')
        parts.append(f'<text x="{x + 16}" y="{y + 1}">{escape(label)}</text>')
        x += 88
    if any(box.band for box in drawn):
        parts.append(
            f'<text x="{x}" y="{y + 1}" fill="#555">fused op: forward above, backward below</text>'
        )
    return "\n".join(parts)


# ---- PNG -----------------------------------------------------------------------------------


class MissingDependencyError(RuntimeError):
    """An optional package a renderer needs is not installed."""


def render_png(timeline: Timeline, path: str, *, arrows: bool = False) -> None:
    """The same chart as the SVG, drawn with matplotlib (an optional dependency)."""
    try:
        import matplotlib  # noqa: PLC0415  (optional, heavy)

        matplotlib.use("Agg")
        from matplotlib import pyplot  # noqa: PLC0415
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError as err:
        raise MissingDependencyError(
            "PNG output needs matplotlib (pip install matplotlib); --svg needs nothing"
        ) from err
    ranks = timeline.program.num_ranks
    figure, axes = pyplot.subplots(figsize=(min(24, 4 + timeline.makespan / 4), 1 + ranks * 0.45))
    for box in boxes(timeline):
        height, bottom = (
            (0.8, box.rank - 0.4) if not box.band else (0.4, box.rank - 0.4 + (box.band - 1) * 0.4)
        )
        axes.broken_barh(
            [(box.start, box.end - box.start)],
            (bottom, height),
            facecolors=_colour(box),
            edgecolor="white",
            linewidth=0.5,
        )
        if box.end - box.start >= timeline.makespan / 80:
            axes.text(
                (box.start + box.end) / 2,
                bottom + height / 2,
                str(box.mb),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if box.chunk == 0 else "#1a1a1a",
            )
    if arrows:
        for src, sent, dst, arrived, _ in messages(timeline):
            axes.annotate(
                "",
                xy=(arrived, dst),
                xytext=(sent, src),
                arrowprops={"arrowstyle": "->", "lw": 0.4, "alpha": 0.5},
            )
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.invert_yaxis()
    axes.set_xlabel(f"time ({timeline.costs.unit or 'units'})")
    axes.set_title(
        f"{timeline.program.schedule}  makespan {timeline.makespan:g}  "
        f"bubble {timeline.bubble_ratio:.1%}",
        fontsize=10,
    )
    legend = [Patch(color=COLOURS[k][c], label=f"{k.value}{c}") for k in Kind for c in (0, 1)]
    axes.legend(handles=legend, ncol=8, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    pyplot.close(figure)


# ---- Chrome / Perfetto trace ----------------------------------------------------------------


def render_trace(timeline: Timeline) -> str:
    """Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing): one process per
    rank, compute ops on thread 0, comm posts and waits on thread 1, flow arrows send→recv.
    One time unit of the cost model is written as one millisecond."""
    events: list[dict[str, Any]] = []
    for rank in range(timeline.program.num_ranks):
        events.append(
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "compute"}}
        )
        events.append(
            {"ph": "M", "pid": rank, "tid": 1, "name": "thread_name", "args": {"name": "comm"}}
        )
    for rank, index, instr, start, end in timeline.ops():
        compute = type(instr) is Compute or type(instr) is Fused
        name = _cell(instr) if compute else _trace_name(instr)
        events.append(
            {
                "ph": "X",
                "pid": rank,
                "tid": 0 if compute else 1,
                "name": name,
                "ts": start * 1000,
                "dur": max(0.0, end - start) * 1000,
                "args": {"index": index},
            }
        )
    for flow_id, (src, sent, dst, arrived, label) in enumerate(messages(timeline)):
        events.append(
            {
                "ph": "s",
                "id": flow_id,
                "pid": src,
                "tid": 1,
                "ts": sent * 1000,
                "name": label,
                "cat": "message",
            }
        )
        events.append(
            {
                "ph": "f",
                "id": flow_id,
                "pid": dst,
                "tid": 1,
                "ts": arrived * 1000,
                "name": label,
                "cat": "message",
                "bp": "e",
            }
        )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=0) + "\n"


def _trace_name(instr: Instr) -> str:
    if type(instr) is Send or type(instr) is Recv:
        verb = "send" if type(instr) is Send else "recv"
        return f"{verb} {_message_label(instr)} r{instr.peer}"
    return "wait"
