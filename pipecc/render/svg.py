"""An SVG Gantt chart of a simulated step (no dependency)."""

from __future__ import annotations

from html import escape

from pipecc.ir.ops import Kind
from pipecc.render.boxes import COLOURS, Box, boxes, colour, messages, tick_step
from pipecc.simulate.timeline import Timeline

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
    y: float = TOP + box.rank * ROW + 1
    h: float = ROW - 2
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
        f'height="{h:.2f}" fill="{colour(box)}" stroke="white" stroke-width="0.5"/>{text}'
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
    step = tick_step(span, int(span * scale / 60) * 10 or 10)
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
    for label, fill in entries:
        parts.append(f'<rect x="{x}" y="{y - 9}" width="12" height="12" fill="{fill}"/>')
        parts.append(f'<text x="{x + 16}" y="{y + 1}">{escape(label)}</text>')
        x += 88
    if any(box.band for box in drawn):
        parts.append(
            f'<text x="{x}" y="{y + 1}" fill="#555">fused op: forward above, backward below</text>'
        )
    return "\n".join(parts)
