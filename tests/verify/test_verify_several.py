"""`pipecc verify` over several inputs, some of which pipecc cannot use: every input gets its
verdict (text line, JSON object, or GitHub annotation), an unusable one is one error, and
the exit code is 2 if any input was unusable, else 1 if any violation, else 0."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import SCHEDULES, run_cli
from programs import DATA

GOOD = str(SCHEDULES / "1f1b.sched")
WRONG = str(DATA / "megatron_5100.sched")  # compiles, fails verification at P=4 M=8
SIZES = ("-P", "4", "-M", "8")
SWEEP = ("--sweep", "ranks=4", "microbatches=8", "--jobs", "1")


@pytest.fixture
def bad(tmp_path: Path) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Unusable inputs by kind: (path, (line, col) of the error or None)."""
    syntax = tmp_path / "syntax.sched"
    syntax.write_text("schedule typo\nplacement loop\nphase p { repeat M { F B } ]\n")
    name = tmp_path / "name.sched"
    name.write_text("schedule typo\nplacement loop\nphase p { repeat MM { F B } }\n")
    binary = tmp_path / "binary.sched"
    binary.write_bytes(b"schedule \xff\xfe\n")
    folder = tmp_path / "folder.sched"
    folder.mkdir()
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "pipecc.program/1",\n  "ranks": 2,,\n}\n')
    return {
        "syntax": (str(syntax), (3, 28)),
        "name": (str(name), (3, 18)),
        "binary": (str(binary), None),
        "folder": (str(folder), None),
        "missing": (str(tmp_path / "missing.sched"), None),
        "json": (str(broken), (2, 14)),
    }


def _verify(capsys: pytest.CaptureFixture[str], files: list[str], *flags: str) -> tuple:
    return run_cli(capsys, "verify", *files, *flags)


# a sweep takes .sched files only, and a name error shows there at compile time (below)
TEXT_CASES = [
    *((kind, False) for kind in ("syntax", "name", "binary", "folder", "missing", "json")),
    *((kind, True) for kind in ("syntax", "binary", "folder", "missing")),
]


@pytest.mark.parametrize(("kind", "sweep"), TEXT_CASES)
def test_text_gives_every_input_its_line(
    capsys: pytest.CaptureFixture[str], bad: dict, kind: str, sweep: bool
) -> None:
    path, where = bad[kind]
    files = [GOOD, path, WRONG]
    code, out, err = _verify(capsys, files, *(SWEEP if sweep else SIZES))
    assert code == 2
    lines = out.splitlines()
    label = path if sweep or kind == "json" else f"{path} P=4 M=8"
    verdict = next(line for line in lines if line.startswith(f"{label}: cannot use this input"))
    if where is not None:
        assert f"{path}:{where[0]}:{where[1]}: " in verdict
    # the good file before it and the wrong one after it still get theirs
    good = "ok: 1 size(s) verified" if sweep else "ok ("
    assert any(line.startswith(f"{GOOD}{'' if sweep else ' P=4 M=8'}: {good}") for line in lines)
    assert any(line.startswith(f"{WRONG}") and "FAILED at" in line for line in lines) or any(
        line.startswith(f"{WRONG} P=4 M=8: 1 violation(s)") for line in lines
    )
    assert "error[needs-buffering]" in out
    # one error on stderr, in full, for the one unusable input
    assert err.count("error:") == 1 and "Traceback" not in err


def test_a_name_error_in_a_sweep_is_one_unusable_size(
    capsys: pytest.CaptureFixture[str], bad: dict
) -> None:
    """A schedule that parses but does not compile at a size its requires allow: the error
    is reported once, with its location, and one line lists every size it occurs at; exit 2
    as for the same size verified alone."""
    path, (line, col) = bad["name"]
    code, out, _ = _verify(capsys, [GOOD, path], "--sweep", "ranks=2..3", "microbatches=1..4")
    assert code == 2
    assert out.count(f"{path}:{line}:{col}: error: unknown name 'MM'") == 1
    assert (
        f"{path}: FAILED at 8 size(s), 1 distinct failure(s): 0 size(s) verified, 0 skipped\n"
        f"  does not compile: error at {path}:{line}:{col}: 8 size(s): P=2 M=1, P=2 M=2, "
        "P=2 M=3, P=2 M=4, P=3 M=1, P=3 M=2, P=3 M=3, P=3 M=4\n"
    ) in out
    assert f"{GOOD}: ok: 8 size(s) verified, 0 skipped" in out
    code, _, _ = _verify(capsys, [path], "-P", "2", "-M", "1")
    assert code == 2


@pytest.mark.parametrize("sweep", [False, True], ids=["sizes", "sweep"])
def test_github_annotates_the_unusable_input_at_its_line_and_column(
    capsys: pytest.CaptureFixture[str], bad: dict, sweep: bool
) -> None:
    syntax, (line, col) = bad["syntax"]
    missing, _ = bad["missing"]
    files = [GOOD, syntax, missing, WRONG]
    code, out, _ = _verify(capsys, files, *(SWEEP if sweep else SIZES), "--format", "github")
    assert code == 2
    lines = out.splitlines()
    escaped = syntax.replace(":", "%3A").replace(",", "%2C")
    parse = [x for x in lines if x.startswith(f"::error file={escaped},")]
    assert len(parse) == 1
    assert parse[0].startswith(f"::error file={escaped},line={line},col={col},title=pipecc verify")
    assert "[parse]" in parse[0] and "::unexpected ']'" in parse[0]
    assert sum(x.startswith(f"::error file={missing},title=") for x in lines) == 1
    assert any(x.startswith("::notice") and f"{GOOD}" in x and ": ok" in x for x in lines)
    assert any("[needs-buffering]" in x for x in lines if x.startswith("::error "))
    assert all(x.startswith("::") for x in lines)  # nothing but workflow commands


@pytest.mark.parametrize("sweep", [False, True], ids=["sizes", "sweep"])
def test_json_has_one_object_per_input(
    capsys: pytest.CaptureFixture[str], bad: dict, sweep: bool
) -> None:
    syntax, (line, col) = bad["syntax"]
    folder, _ = bad["folder"]
    files = [GOOD, syntax, folder, WRONG]
    code, out, _ = _verify(capsys, files, *(SWEEP if sweep else SIZES), "--format", "json")
    assert code == 2
    data = json.loads(out)
    key = "file" if sweep else "input"
    names = [re.sub(r" P=4 M=8$", "", item[key]) for item in data]
    assert names == files
    assert [item["ok"] for item in data] == [True, False, False, False]
    assert data[1]["error"] == {
        "code": "parse",
        "message": data[1]["error"]["message"],
        "file": syntax,
        "line": line,
        "col": col,
    }
    assert data[1]["error"]["message"].startswith("unexpected ']'")
    assert data[2]["error"] == {"code": "input", "message": f"{folder}: is a directory, not a file"}
    assert "error" not in data[0] and "error" not in data[3]


def test_a_malformed_json_among_programs(
    capsys: pytest.CaptureFixture[str], bad: dict, tmp_path: Path
) -> None:
    broken, (line, col) = bad["json"]
    good = tmp_path / "good.json"
    assert run_cli(capsys, "compile", "zb_h1", "-P", "2", "-M", "2", "-o", str(good))[0] == 0
    code, out, err = _verify(capsys, [broken, str(good)], "--format", "github")
    assert code == 2
    assert out.splitlines()[0] == (
        f"::error file={broken},line={line},col={col},title=pipecc verify [input] {broken}"
        "::malformed JSON: Expecting property name enclosed in double quotes"
    )
    assert out.splitlines()[1].startswith(f"::notice title=pipecc verify ok::{good}: ok (")
    assert err.startswith(f"{broken}:{line}:{col}: error: malformed JSON: Expecting property name")


@pytest.mark.parametrize("sweep", [False, True], ids=["sizes", "sweep"])
@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        (["good"], 0),
        (["good", "good"], 0),
        (["good", "wrong"], 1),
        (["wrong", "good"], 1),
        (["good", "bad"], 2),
        (["bad", "good"], 2),
        (["wrong", "bad"], 2),
        (["bad", "wrong", "good"], 2),
    ],
)
def test_exit_code_of_a_mix(
    capsys: pytest.CaptureFixture[str], bad: dict, inputs: list[str], expected: int, sweep: bool
) -> None:
    paths = {"good": GOOD, "wrong": WRONG, "bad": bad["syntax"][0]}
    files = [paths[name] for name in inputs]
    for fmt in ("text", "json", "github"):
        flags = (*(SWEEP if sweep else SIZES), "--format", fmt)
        code, out, _ = _verify(capsys, files, *flags)
        assert code == expected, (fmt, out)


def test_the_lines_keep_todays_formats(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _verify(capsys, [GOOD, GOOD], *SIZES)
    assert code == 0
    assert out.splitlines()[0].startswith(f"{GOOD} P=4 M=8: ok (")
    assert out.splitlines()[1] == "peak activations per rank (stage units): 4 3 2 1"
    code, out, _ = _verify(capsys, [GOOD], *SWEEP)
    assert out == f"{GOOD}: ok: 1 size(s) verified, 0 skipped\n"
