"""Every command checks its input: a compiled program (.json) or a torch action CSV that fails
the verifier's input checks (coverage, placement, data dependencies) is refused by compile,
simulate, explain, run and compare with the verifier's message and exit code 2, and reported
by verify as violations with exit code 1; never a traceback, never a result."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT, compile_bundled, run_cli

from pipecc.interop import json_program, torch_csv

REFUSED = "pipecc cannot use this program: it fails the verifier's input checks"


def _csv_without(tmp_path: Path, action: str) -> Path:
    """zb_h1 at P=2 M=2 as a compute-only torch CSV with one action dropped."""
    text = torch_csv.dumps(compile_bundled("zb_h1", 2, 2))
    rows = [",".join(c for c in row.split(",") if c != action) for row in text.splitlines()]
    path = tmp_path / f"without_{action}.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def _json_edited(tmp_path: Path, name: str, edit: Callable[[list[list[dict]]], None]) -> Path:
    data = json.loads(json_program.dumps(compile_bundled("zb_h1", 2, 2)))
    edit(data["programs"])
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def _misplace(programs: list[list[dict]]) -> None:
    first = next(op for op in programs[0] if op["op"] == "F")
    first["stage"] = 1  # rank 0 holds stage 0 only


def _forward_before_its_input(programs: list[list[dict]]) -> None:
    rank1 = programs[1]
    at = next(k for k, op in enumerate(rank1) if op["op"] == "F")
    rank1.insert(0, rank1.pop(at))  # before the receive of its activation
    for op in rank1:
        if op["op"] == "wait":
            op["ops"] = [i + 1 if i < at else i for i in op["ops"]]


# (input builder, the violation code verify reports)
CASES = {
    "csv-missing-W": (lambda tmp: _csv_without(tmp, "1W0"), "coverage"),
    "csv-missing-I": (lambda tmp: _csv_without(tmp, "1I0"), "coverage"),
    "json-misplaced": (lambda tmp: _json_edited(tmp, "misplaced", _misplace), "placement"),
    "json-before-input": (
        lambda tmp: _json_edited(tmp, "early", _forward_before_its_input),
        "recv-after-use",
    ),
}
MODEL = str(ROOT / "examples" / "mlp.py")
COMMANDS = {
    "compile": lambda f: ["compile", f],
    "compile-policy": lambda f: ["compile", f, "--comm-policy", "early-recv"],
    "simulate": lambda f: ["simulate", f],
    "explain": lambda f: ["explain", f, "--op", "1:3"],
    "run": lambda f: ["run", f, "--nproc", "2", "--model", MODEL],
    "compare": lambda f: ["compare", f, "-P", "2", "-M", "2"],
}


# --comm-policy discards a .json's comm ops: only a defect of its compute order remains
# (test_placing_the_comm_ops_again_checks_the_compute_order)
PAIRS = [
    (command, case)
    for command in sorted(COMMANDS)
    for case in sorted(CASES)
    if command != "compile-policy" or case == "json-misplaced"
]


@pytest.mark.parametrize(("command", "case"), PAIRS)
def test_commands_refuse_a_program_that_fails_the_input_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, command: str
) -> None:
    make, code = CASES[case]
    path = str(make(tmp_path))
    exit_code, out, err = run_cli(capsys, *COMMANDS[command](path))
    assert exit_code == 2, err
    assert out == ""
    assert f"error[{code}]:" in err
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"error: {path}: {REFUSED} ({code} ")
    assert last.endswith(f"; 'pipecc verify {path}' shows every check)")
    assert "Traceback" not in err


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_reports_them_as_violations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make, code = CASES[case]
    path = str(make(tmp_path))
    exit_code, out, _ = run_cli(capsys, "verify", path)
    assert exit_code == 1
    assert f"error[{code}]:" in out


def test_the_refusal_is_the_verifiers_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(_csv_without(tmp_path, "1W0"))
    _, verified, _ = run_cli(capsys, "verify", path)
    _, _, refused = run_cli(capsys, "simulate", path)
    message = verified.split("\n\n")[0]
    assert message.startswith(f"{path}:2:1: error[coverage]: stage 1 mb 0 has 1 I and 0 W")
    assert refused == (
        f"{message}\n\nerror: {path}: {REFUSED} (coverage 1; 'pipecc verify {path}' shows "
        "every check)\n"
    )


def test_placing_the_comm_ops_again_checks_the_compute_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--comm-policy on a .json discards its comm ops: a forward placed before the receive
    of its input is then a runnable compute order, lowered afresh; a misplaced op is not."""
    early = str(_json_edited(tmp_path, "early", _forward_before_its_input))
    code, out, err = run_cli(capsys, "compile", early, "--comm-policy", "early-recv")
    assert code == 0, err
    assert json.loads(out)["comm"] == "early-recv"
    misplaced = str(_json_edited(tmp_path, "misplaced", _misplace))
    code, _, err = run_cli(capsys, "compile", misplaced, "--align")
    assert code == 2 and "error[placement]:" in err and REFUSED in err


def test_a_good_program_is_used_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.csv"
    good.write_text(torch_csv.dumps(compile_bundled("zb_h1", 2, 2)))
    code, out, _ = run_cli(capsys, "simulate", str(good), "--json")
    assert code == 0 and json.loads(out)["makespan"] > 0
    code, out, _ = run_cli(capsys, "compare", str(good), "zb_h1", "-P", "2", "-M", "2")
    assert code == 0 and "\ngood.csv " in out and "\nzb_h1 " in out


def test_compare_of_programs_takes_their_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a .json or .csv knows its P and M: -P/-M are needed only to compile a .sched
    one = tmp_path / "one.csv"
    one.write_text(torch_csv.dumps(compile_bundled("zb_h1", 2, 4), with_comms=True))
    two = tmp_path / "two.json"
    two.write_text(json_program.dumps(compile_bundled("1f1b", 2, 4)))
    code, out, _ = run_cli(capsys, "compare", str(one), str(two))
    assert code == 0 and out.startswith("# P=2 M=4 ")
    assert "\none.csv " in out and "\ntwo.json " in out
    code, _, err = run_cli(capsys, "compare", str(one), "zb_h1")
    assert code == 2
    assert "compare needs -P/--ranks and -M/--microbatches to compile zb_h1" in err
    three = tmp_path / "three.csv"
    three.write_text(torch_csv.dumps(compile_bundled("zb_h1", 2, 2)))
    code, _, err = run_cli(capsys, "compare", str(one), str(three))
    assert code == 2 and "three.csv: the program is for P=2 M=2, not -P 2 -M 4" in err


@pytest.mark.parametrize("command", ["compile", "simulate", "explain", "compare", "verify"])
def test_every_command_names_the_fields_it_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A .json with a field this version does not know (here a typo of a send's `group`) is
    still used, as the format allows, and every command says which fields it read past."""

    def misspell(programs: list[list[dict]]) -> None:
        send = next(op for op in programs[0] if op["op"] == "send")
        send["gruop"] = send.pop("group")

    path = str(_json_edited(tmp_path, "typo", misspell))
    args = COMMANDS[command](path) if command in COMMANDS else ["verify", path]
    exit_code, out, err = run_cli(capsys, *args)
    assert exit_code == 0, err
    assert out
    note = "ignored 1 field(s) this version of pipecc does not know: programs[0]["
    assert note in err + out
    assert ".gruop" in err + out
