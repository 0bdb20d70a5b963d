"""`fill` blocks (docs/dsl.md 4.7, passes/fill_idle.py): the idle slots of the unit-cost
timing run deferred work, and V-Half and V-Min written with them reach the paper's memory and
the reference generators' step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import compile_bundled, compute_order, run_cli

from pipecc.diagnostics import ViolatedScheduleError
from pipecc.driver.compile import compile_source
from pipecc.ir.printer import format_grid

ONE_F_ONE_B = """
schedule fill_1f1b
placement loop
let warmup = min(P - 1 - rank, M)
phase all {
  fill W {
    repeat warmup { F }
    repeat M - warmup { F I }
    repeat warmup { I }
  }
}
"""


def _timeline(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, err = run_cli(capsys, "simulate", *argv, "--json")
    assert code == 0, err
    return dict(json.loads(out))


def _span_bubble(ops: list[dict[str, object]]) -> float:
    """1 − busy / (last end − first start) of the rank with the longest span."""
    spans: dict[int, tuple[float, float, float]] = {}
    for op in ops:
        name = str(op["op"])
        if name[0] not in "FBIW":
            continue
        start, end = float(str(op["start"])), float(str(op["end"]))
        rank = int(str(op["rank"]))
        first, last, busy = spans.get(rank, (start, end, 0.0))
        spans[rank] = (min(first, start), max(last, end), busy + end - start)
    first, last, busy = max(spans.values(), key=lambda span: span[1] - span[0])
    return 1 - busy / (last - first)


@pytest.mark.parametrize(
    ("name", "peak", "span", "bound"), [("v_half", 6, 26.5, 0.111), ("v_min", 4, 29.5, 0.200)]
)
def test_v_half_and_v_min_meet_the_paper(
    capsys: pytest.CaptureFixture[str], name: str, peak: int, span: float, bound: float
) -> None:
    found = _timeline(capsys, name, "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1,comm=0")
    ranks = found["ranks"]
    assert isinstance(ranks, list)
    assert [rank["peak_activations"] for rank in ranks] == [peak] * 4
    ops = found["ops"]
    assert isinstance(ops, list)
    ratio = _span_bubble(ops)
    assert ratio <= bound
    assert ratio == pytest.approx(1 - 24 / span)  # the reference generators' span, met exactly


def test_fill_runs_ws_only_where_the_rank_would_idle() -> None:
    program = compile_source(ONE_F_ONE_B, "f.sched", ranks=4, microbatches=8)
    assert format_grid(program).splitlines()[1] == (
        "rank 0 | F0.0 F0.1 F0.2 F0.3 I0.0 F0.4 I0.1 F0.5 I0.2 F0.6 I0.3 F0.7 I0.4 W0.0 I0.5 W0.1 "
        "I0.6 W0.2 I0.7 W0.3 W0.4 W0.5 W0.6 W0.7"
    )


def test_a_fill_w_delays_no_written_op(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """At unit costs every written op starts when it would with all the Ws at the end."""
    filled = tmp_path / "filled.sched"
    filled.write_text(ONE_F_ONE_B)
    late = tmp_path / "late.sched"
    late.write_text(ONE_F_ONE_B.replace("fill W {", "").replace("  }\n}", "  repeat M { W }\n}"))
    costs = ("-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1,comm=0")
    starts = []
    for path in (filled, late):
        ops = _timeline(capsys, str(path), *costs)["ops"]
        assert isinstance(ops, list)
        starts.append({(o["rank"], o["op"]): o["start"] for o in ops if str(o["op"])[0] in "FI"})
    assert starts[0] == starts[1]


def test_a_cap_runs_pending_ws_before_a_forward() -> None:
    source = "phase p { fill W cap 2 { F F I F I F I I } }"
    program = compile_source(source, "c.sched", ranks=1, microbatches=4)
    assert format_grid(program).splitlines()[1] == (
        "rank 0 | F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 F0.3 I0.2 I0.3 W0.2 W0.3"
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "phase p { fill W { fill W { F I } } }",
            "e.sched:1:20: error: fill blocks do not nest",
        ),
        (
            "phase p { fill W { F I send grad } }",
            "e.sched:1:24: error: a fill block cannot hold hand-placed sends, receives or waits "
            "(the fill decides where its ops run)",
        ),
        (
            "phase p { fill W1 { F I } }",
            "e.sched:1:16: error: fill takes op letters without a chunk (F, B, I, W), got 'W1'",
        ),
        ("phase p { fill W W { F I } }", "e.sched:1:18: error: fill names 'W' twice"),
    ],
)
def test_fill_errors(source: str, message: str) -> None:
    with pytest.raises(Exception) as caught:
        compile_source(source, "e.sched", ranks=2, microbatches=1)
    assert str(caught.value).splitlines()[0] == message


def test_an_order_that_cannot_run_is_reported_as_without_the_fill() -> None:
    body = "if rank == 0 { repeat M { F B } } else { repeat M { F } repeat M { B } }"
    errors = []
    for source in (f"phase p {{ {body} }}", f"phase p {{ fill W {{ {body} }} }}"):
        with pytest.raises(ViolatedScheduleError) as caught:  # the verifier's report: exit 1
            compile_source(source, "d.sched", ranks=2, microbatches=2)
        errors.append(str(caught.value).splitlines()[:3])
    assert errors[1] == [errors[0][0].replace(":1:39:", ":1:48:"), *errors[0][1:]]  # `fill W { `


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 2), (3, 5), (4, 6), (4, 8), (6, 13)])
def test_1f1b_with_its_ws_filled_under_1f1b_memory_is_zb_h1(ranks: int, microbatches: int) -> None:
    source = ONE_F_ONE_B.replace("fill W {", "fill W cap P {")
    filled = compile_source(source, "f.sched", ranks=ranks, microbatches=microbatches)
    bundled = compile_bundled("zb_h1", ranks, microbatches)
    assert compute_order(filled) == compute_order(bundled)
