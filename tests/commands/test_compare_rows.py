"""`pipecc compare FILE:NAME=VALUE,...`: options per row, so one schedule with two values of
a parameter shares one table (issue 32, part 3)."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

from pipecc.commands.compare import input_labels

FLAGS = ("-P", "4", "-M", "8", "--cost", "F=1,B=2,I=1,W=1")


def test_one_schedule_two_values_two_rows(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "compare", "interleaved_1f1b:V=2", "interleaved_1f1b:V=4", "1f1b", *FLAGS
    )
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[2:]] == [
        "interleaved_1f1b:V=4",
        "interleaved_1f1b:V=2",
        "1f1b",
    ]
    code, out, _ = run_cli(
        capsys, "compare", "interleaved_1f1b:V=2", "interleaved_1f1b:V=4", *FLAGS, "--json"
    )
    rows = {row["label"]: row for row in json.loads(out)}
    alone = {}
    for v in (2, 4):
        _, single, _ = run_cli(
            capsys, "compare", "interleaved_1f1b", "-D", f"V={v}", *FLAGS, "--json"
        )
        (alone[v],) = json.loads(single)
    for v in (2, 4):  # each row is the schedule compiled with its own value
        row = rows[f"interleaved_1f1b:V={v}"]
        assert (row["makespan"], row["peak_activations"]) == (
            alone[v]["makespan"],
            alone[v]["peak_activations"],
        )
    assert rows["interleaved_1f1b:V=2"]["makespan"] != rows["interleaved_1f1b:V=4"]["makespan"]


def test_a_row_option_overrides_minus_d_there_only() -> None:
    assert input_labels(["interleaved_1f1b:V=2", "interleaved_1f1b", "zb_h1"], [("V", 3)]) == [
        "interleaved_1f1b:V=2",
        "interleaved_1f1b -D V=3",
        "zb_h1",
    ]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("1f1b:V=2", "error: -D V: the schedule has no parameter 'V'"),
        (
            "interleaved_1f1b:V=x",
            "error: interleaved_1f1b:V=x: V: the value must be an integer, got 'x'",
        ),
        (
            "zbv.json:V=2",
            "error: zbv.json:V=2: a compiled program has its parameters already; row options are "
            "for .sched files and bundled schedules",
        ),
    ],
)
def test_bad_row_options_exit_2(capsys: pytest.CaptureFixture[str], row: str, message: str) -> None:
    code, _, err = run_cli(capsys, "compare", row, *FLAGS)
    assert code == 2
    assert err.startswith(message), err
