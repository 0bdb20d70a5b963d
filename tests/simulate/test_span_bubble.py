"""The zero-bubble papers' bubble rate, `span_bubble_ratio`: 1 − busy / (last end − first
start) of the rank whose span is longest (docs/simulate.md), beside `bubble_ratio`."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from helpers import run_cli

from pipecc.api import compile_schedule
from pipecc.ir.program import Program
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate import simulate
from pipecc.simulate.timeline import Timeline


def _timeline(name: str, ranks: int, microbatches: int, cost: str) -> Timeline:
    program: Program = compile_schedule(name, ranks=ranks, microbatches=microbatches)
    return simulate(program, parse_cost_flag(cost).for_program(program))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 2), (3, 5), (4, 8), (5, 7)])
def test_1f1b_and_gpipe_closed_form(name: str, ranks: int, microbatches: int) -> None:
    # F=1, B=2: rank 0 runs first and last, so it is the longest rank; its span is the
    # makespan (M + P − 1)(F + B) and it is busy M (F + B): 1 − M / (M + P − 1)
    timeline = _timeline(name, ranks, microbatches, "F=1,B=2")
    busy = microbatches * (1 + 2)
    span = (microbatches + ranks - 1) * (1 + 2)
    expected = 1 - Fraction(busy, span)
    assert timeline.longest_rank.rank == 0
    assert timeline.span_bubble_ratio == pytest.approx(float(expected), abs=1e-12)
    assert timeline.span_bubble_ratio == pytest.approx(timeline.bubble_ratio, abs=1e-12)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_has_no_span_bubble_at_equal_costs(ranks: int, microbatches: int) -> None:
    # the ZB-V paper's claim at F = I = W: no idle slot inside any rank's working interval,
    # while the bubble ratio, which counts fill and drain, is not 0
    timeline = _timeline("zbv", ranks, microbatches, "F=1,I=1,W=1")
    assert timeline.span_bubble_ratio == 0.0
    assert timeline.bubble_ratio > 0.0


def test_zb_h2_has_no_span_bubble_at_equal_costs() -> None:
    timeline = _timeline("zb_h2", 4, 8, "F=1,I=1,W=1")
    assert (timeline.span_bubble_ratio, round(timeline.bubble_ratio, 4)) == (0.0, 0.1111)


def test_longest_rank_is_the_longest_span_lowest_rank_on_a_tie() -> None:
    timeline = _timeline("zb_h1", 4, 8, "F=1,I=1,W=2")
    spans = [stats.last_end - stats.first_start for stats in timeline.ranks]
    longest = max(spans)
    assert timeline.longest_rank.rank == spans.index(longest)
    stats = timeline.longest_rank
    assert timeline.span_bubble_ratio == pytest.approx(1 - stats.busy / longest)


def test_simulate_json_has_the_key_and_text_says_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "simulate", "zbv", "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1", "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert (data["bubble_ratio"], data["span_bubble_ratio"]) == (0.058823529, 0.0)
    code, out, _ = run_cli(capsys, "simulate", "zbv", "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1")
    lines = out.splitlines()
    assert lines[1] == "makespan 25.5   bubble ratio 0.0588   span bubble ratio 0.0000 (rank 0)"
    assert lines[7] == (
        "peak act: in stage units (one stage's activations for one microbatch; a stage of "
        "this program is 0.5 share of the model)"
    )


def test_compare_reports_the_span_bubble_and_the_peaks_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ("-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1")
    code, out, _ = run_cli(capsys, "compare", "zbv", "1f1b", *flags)
    assert code == 0
    assert out.splitlines() == [
        "# P=4 M=8  comm nccl  costs per 1/P of the model: F=1, I=1, W=1 (F=1, B=2, I=1, W=1, "
        "comm=0)  (peak act in stage units, peak shares in 1/P of the model)",
        "input               makespan  vs best  bubble  span bubble  peak act  peak shares  "
        "stall total",
        "zbv                     25.5   1.000×    5.9%         0.0%         8            4"
        "            3",
        "1f1b                      33   1.294×   27.3%        27.3%         4            4"
        "           24",
    ]
    code, out, _ = run_cli(capsys, "compare", "zbv", *flags, "--json")
    (row,) = json.loads(out)
    assert (row["span_bubble_ratio"], row["peak_activations"], row["peak_shares"]) == (0.0, 8, 4)
