"""`recompute stage E, ...` (issue 21): the stages a schedule recomputes, carried by compile
into the program's `recompute` field; bad declarations are exit 2 with the whole message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipecc.cli import main

BODY = "placement loop\n{decl}\nphase all {{ repeat M {{ F }} repeat M {{ B }} }}\n"


def _compile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], decl: str, *flags: str
) -> tuple[int, str, str]:
    path = tmp_path / "r.sched"
    path.write_text("schedule r\n" + BODY.format(decl=decl))
    code = main(["compile", str(path), "-P", "3", "-M", "2", *flags])
    out, err = capsys.readouterr()
    return code, out, err.replace(str(path), "r.sched")


def test_compile_carries_the_stages_into_the_program(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _compile(tmp_path, capsys, "recompute stage P - 1, 0", "--format", "json")
    assert code == 0
    assert json.loads(out)["recompute"] == [
        {"stage": 0, "mode": "full"},
        {"stage": 2, "mode": "full"},
    ]
    code, out, _ = _compile(tmp_path, capsys, "", "--format", "json")
    assert code == 0 and "recompute" not in json.loads(out)


@pytest.mark.parametrize(
    ("decl", "message"),
    [
        (
            "recompute stage 0, P",
            "r.sched:3:1: error: recompute stage 3: the placement loop has stages 0..2\n"
            "    3 | recompute stage 0, P\n"
            "      | ^^^^^^^^^^^^^^^^^^^^\n",
        ),
        (
            "recompute stage 1, 1",
            "r.sched:3:1: error: recompute: stage 1 is named twice\n"
            "    3 | recompute stage 1, 1\n"
            "      | ^^^^^^^^^^^^^^^^^^^^\n",
        ),
        (
            "recompute stage rank",
            "r.sched:3:1: error: recompute must be the same on every rank, but it is [0] on "
            "rank 0 and [1] on rank 1 (it must not depend on `rank`)\n"
            "    3 | recompute stage rank\n"
            "      | ^^^^^^^^^^^^^^^^^^^^\n",
        ),
    ],
)
def test_a_bad_recompute_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], decl: str, message: str
) -> None:
    code, _, err = _compile(tmp_path, capsys, decl)
    assert code == 2
    assert err == message
