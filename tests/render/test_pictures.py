"""The SVG and PNG pictures: the legend lists exactly the op kinds and chunks drawn and never
covers the chart, its ticks or its axis label; the title fits; chunk shades stay apart up
to 8 chunks and their numbers stay readable."""

from __future__ import annotations

import itertools
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pipecc.api import compile_schedule
from pipecc.ir.ops import Kind, computations, is_compute
from pipecc.ir.program import Program
from pipecc.render import svg
from pipecc.render.boxes import ink, luminance, shade
from pipecc.render.svg import render_svg
from pipecc.semantics.costs import CostModel
from pipecc.simulate.timeline import Timeline, simulate
from tests.helpers import compile_bundled

NS = "{http://www.w3.org/2000/svg}"

CASES = [
    ("zb_h1", 2, 4, {}),
    ("1f1b", 1, 1, {}),
    ("1f1b", 4, 8, {}),
    ("interleaved_1f1b", 8, 16, {"V": 2}),
    ("interleaved_1f1b", 2, 4, {"V": 8}),
    ("zbv", 8, 16, {}),
    ("dualpipe", 8, 20, {}),
]
IDS = [f"{name}-P{p}-M{m}" + "".join(f"-{k}{v}" for k, v in d.items()) for name, p, m, d in CASES]


def _timeline(name: str, ranks: int, mbs: int, defines: dict[str, int]) -> Timeline:
    return simulate(compile_bundled(name, ranks, mbs, **defines), CostModel())


def _present(program: Program) -> set[str]:
    """`F0`, `I1`, ...: every op kind and chunk the program computes."""
    return {
        f"{op.kind.value}{op.chunk}"
        for instrs in program.ranks
        for instr in instrs
        if is_compute(instr)
        for op in computations(instr)
    }


# ---- SVG -----------------------------------------------------------------------------------


def _svg(timeline: Timeline) -> ET.Element:
    return ET.fromstring(render_svg(timeline))


def _legend_labels(root: ET.Element) -> list[str]:
    (key,) = [g for g in root.iter(f"{NS}g") if g.get("class") == "legend"]
    return [text.text or "" for text in key.iter(f"{NS}text") if text.get("fill") is None]


@pytest.mark.parametrize(("name", "ranks", "mbs", "defines"), CASES, ids=IDS)
def test_svg_legend_lists_the_kinds_present(
    name: str, ranks: int, mbs: int, defines: dict[str, int]
) -> None:
    timeline = _timeline(name, ranks, mbs, defines)
    labels = _legend_labels(_svg(timeline))
    assert sorted(labels) == sorted(_present(timeline.program))
    assert len(labels) == len(set(labels))


@pytest.mark.parametrize(("name", "ranks", "mbs", "defines"), CASES, ids=IDS)
def test_svg_legend_and_title_stay_clear_of_the_chart(
    name: str, ranks: int, mbs: int, defines: dict[str, int]
) -> None:
    root = _svg(_timeline(name, ranks, mbs, defines))
    width, height = float(root.get("width", 0)), float(root.get("height", 0))
    texts = list(root.iter(f"{NS}text"))
    (label,) = [t for t in texts if t.get("class") == "axis-label"]
    ticks = [float(t.get("y", 0)) for t in texts if (t.text or "").replace(".", "").isdigit()]
    lowest = max([float(label.get("y", 0)), *ticks])
    (key,) = [g for g in root.iter(f"{NS}g") if g.get("class") == "legend"]
    for rect in key.iter(f"{NS}rect"):
        assert float(rect.get("y", 0)) > lowest  # below the tick labels and the axis label
        assert float(rect.get("y", 0)) + 12 <= height
    for text in key.iter(f"{NS}text"):
        right = float(text.get("x", 0)) + len(text.text or "") * 11 * svg.CHAR
        assert right <= width and float(text.get("y", 0)) <= height
    rows = [r for r in root.iter(f"{NS}rect") if r.get("fill") == "#f4f4f4"]
    top_row = min(float(r.get("y", 0)) for r in rows)
    for line in (t for t in texts if t.get("class") == "title"):
        assert float(line.get("x", 0)) + len(line.text or "") * 13 * svg.CHAR <= width
        assert float(line.get("y", 0)) < top_row


def test_a_long_title_wraps_inside_a_narrow_picture(tmp_path: Path) -> None:
    path = tmp_path / "long.sched"
    name = "a_schedule_whose_name_is_much_longer_than_the_picture_is_wide_" * 2
    path.write_text(f"schedule {name}\nphase p {{ F B }}\n")
    timeline = simulate(compile_schedule(path, ranks=1, microbatches=1), CostModel())
    root = _svg(timeline)
    lines = [t.text or "" for t in root.iter(f"{NS}text") if t.get("class") == "title"]
    assert len(lines) >= 3
    assert "".join(lines).replace(" ", "") == (
        f"{name}  P=1 M=1  makespan 3  bubble 0.0%  (nccl; {timeline.costs.describe()})"
    ).replace(" ", "")
    figure = _figure(timeline)
    _inside_figure(figure, _title(figure))


# ---- PNG -----------------------------------------------------------------------------------


def _figure(timeline: Timeline) -> Any:
    pytest.importorskip("matplotlib")
    from pipecc.render.png import draw_figure

    figure = draw_figure(timeline)
    figure.canvas.draw()
    return figure


def _title(figure: Any) -> Any:
    (title,) = [text for text in figure.texts if text.get_text() == figure.get_suptitle()]
    assert title.get_text()
    return title


def _inside_figure(figure: Any, artist: Any) -> None:
    box = artist.get_window_extent(figure.canvas.get_renderer())
    whole = figure.bbox
    assert whole.x0 - 0.5 <= box.x0 and box.x1 <= whole.x1 + 0.5
    assert whole.y0 - 0.5 <= box.y0 and box.y1 <= whole.y1 + 0.5


@pytest.mark.parametrize(("name", "ranks", "mbs", "defines"), CASES, ids=IDS)
def test_png_legend_is_outside_the_axes_and_lists_the_kinds_present(
    name: str, ranks: int, mbs: int, defines: dict[str, int]
) -> None:
    timeline = _timeline(name, ranks, mbs, defines)
    figure = _figure(timeline)
    from matplotlib import pyplot

    chart, key = figure.axes
    renderer = figure.canvas.get_renderer()
    legend = key.get_legend()
    labels = [text.get_text() for text in legend.get_texts()]
    assert sorted(labels) == sorted(_present(timeline.program))
    drawn = legend.get_window_extent(renderer)
    around = chart.get_tightbbox(renderer)  # the chart with its ticks, axis label and title
    assert drawn.y1 <= around.y0 or drawn.y0 >= around.y1
    assert not drawn.overlaps(chart.xaxis.label.get_window_extent(renderer))
    _inside_figure(figure, legend)
    _inside_figure(figure, _title(figure))
    _inside_figure(figure, chart.xaxis.label)
    pyplot.close(figure)


# ---- colours -------------------------------------------------------------------------------


def _lab(colour: str) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour, to measure how far apart two colours look."""
    r, g, b = (
        c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
        for c in (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    )
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def _distance(a: str, b: str) -> float:
    return math.dist(_lab(a), _lab(b))


@pytest.mark.parametrize("chunks", range(1, 9))
def test_every_kind_and_chunk_has_a_colour_of_its_own(chunks: int) -> None:
    shades = {(kind, c): shade(kind, c, chunks) for kind in Kind for c in range(chunks)}
    for (one, a), (other, b) in itertools.combinations(shades.items(), 2):
        apart = 8.0 if one[0] is other[0] else 15.0  # ΔE76: 2.3 is just noticeable
        assert _distance(a, b) >= apart, (one, other, a, b)


@pytest.mark.parametrize("chunks", range(1, 9))
def test_numbers_on_every_shade_are_readable(chunks: int) -> None:
    for kind, c in itertools.product(Kind, range(chunks)):
        fill = shade(kind, c, chunks)
        text = "#ffffff" if ink(fill) == "white" else ink(fill)
        light, dark = sorted((luminance(fill), luminance(text)), reverse=True)
        assert (light + 0.05) / (dark + 0.05) >= 4.0, (kind, c, fill)
