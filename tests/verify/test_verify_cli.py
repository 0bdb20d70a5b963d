"""`pipecc verify` on the command line: inputs, formats, exit codes, sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT, run_cli
from programs import DATA, compiled, drop

from pipecc.cli import main
from pipecc.interop import json_program


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_clean_schedule_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "verify", "schedules/dualpipe.sched", "-P", "4", "-M", "8")
    assert code == 0
    head, peaks = out.splitlines()
    assert head.startswith("schedules/dualpipe.sched P=4 M=8: ok (")
    assert head.endswith(" instructions on 4 ranks; nccl-single passes)")
    assert peaks == "peak activations per rank (stage units): 5 5 5 5"


def test_comm_all_lists_each_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "verify", "zb_h1", "-P", "4", "-M", "8", "--comm", "all")
    assert code == 0
    assert "nccl passes, nccl-single passes, rendezvous passes, eager passes" in out


def test_violation_exits_1_with_the_witness(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "verify", "tests/verify/data/pytorch_172668.csv")
    assert code == 1
    assert out.startswith("tests/verify/data/pytorch_172668.csv:1:27: error[deadlock]: ")
    assert out.rstrip().endswith("peak activations per rank (stage units): 4 4")


def test_json_format(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "verify",
        "tests/verify/data/pytorch_172668.csv",
        "--format",
        "json",
        "--comm",
        "all",
    )
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False
    assert data["verdicts"] == {
        "nccl": "deadlock",
        "nccl-single": "deadlock",
        "rendezvous": "passes",
        "eager": "passes",
    }
    first = data["violations"][0]
    assert (first["code"], first["rank"], first["index"]) == ("deadlock", 0, 4)
    assert (first["file"], first["line"], first["col"]) == (
        "tests/verify/data/pytorch_172668.csv",
        1,
        27,
    )
    assert data["peak_activations"][0] == {"rank": 0, "peak": 4, "index": 10}


def test_github_format_points_at_the_sched_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "verify",
        "tests/verify/data/megatron_5100.sched",
        "-P",
        "4",
        "-M",
        "8",
        "--format",
        "github",
    )
    assert code == 1
    first = out.splitlines()[0]
    assert first.startswith(
        "::error file=tests/verify/data/megatron_5100.sched,line=13,col=45,"
        "title=pipecc verify [needs-buffering] "
    )
    assert "%0A" in first and "\n" not in first
    assert out.splitlines()[-1].startswith("::notice title=pipecc verify failed::")


def test_compiled_json_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.json"
    path.write_text(json_program.dumps(drop(compiled("zbv", 2, 2), 1, 1)))
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == 1
    assert "error[orphan]" in out and "error[mismatch]" in out
    assert "schedules/zbv.sched:16:24: error[orphan]" in out.replace(str(ROOT) + "/", "")


def test_compute_only_csv_is_lowered_then_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(
        capsys,
        "compile",
        "zbv",
        "-P",
        "2",
        "-M",
        "3",
        "--format",
        "torch-csv",
        "-o",
        str(tmp_path / "zbv.csv"),
    )
    assert code == 0
    code, out, _ = run_cli(capsys, "verify", str(tmp_path / "zbv.csv"), "--comm", "all")
    assert code == 0, out
    assert "compute-only input: sends, receives and waits placed by the default" in out
    code, out, _ = run_cli(capsys, "verify", "tests/verify/data/unrunnable.csv")
    assert code == 1 and "error[unrunnable-order]" in out


def test_max_activations(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "verify", "zb_h2", "-P", "4", "-M", "8", "--max-activations", "7"
    )
    assert code == 0 and "peak activations per rank (stage units): 7 7 7 7" in out
    code, out, _ = run_cli(
        capsys, "verify", "zb_h2", "-P", "4", "-M", "8", "--max-activations", "6"
    )
    assert code == 1 and out.count("error[memory]") == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["zb_h1", "--sweep", "ranks=2..x"], "--sweep ranks='2..x': expected values like 2..8"),
        (["zb_h1", "--sweep", "ranks=4..2"], "sizes are integers ≥ 1 in ranges a..b with a ≤ b"),
        (["zb_h1", "--sweep", "2..3"], "expected ranks=A..B, microbatches=A..B or a parameter"),
        (
            ["zb_h1", "--sweep", "P=2", "M=2", "stages=1..3"],
            "error: --sweep stages=1,2,3: no schedule swept declares a parameter 'stages' (zb_h1)",
        ),
        (["zb_h1", "--sweep", "P=2", "M=2", "V=1,2", "-D", "V=3"], "-D V: V is also swept"),
        (["prog.json", "--sweep", "ranks=2..3", "microbatches=1..2"], "--sweep compiles .sched"),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run_cli(capsys, "verify", *argv)
    assert code == 2 and out == ""
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message", "line"),
    [
        (
            ["schedules/1f1b.sched"],
            "a .sched file needs -P/--ranks and -M/--microbatches",
            "schedules/1f1b.sched: cannot use this input (input): schedules/1f1b.sched: a .sched",
        ),
        (
            ["missing.json"],
            "missing.json: no such file",
            "missing.json: cannot use this input (input): missing.json: no such file",
        ),
        (
            ["zb_h2", "-P", "4", "-M", "3"],
            "requires M >= 2 * P - 1, got M=3, P=4",
            "zb_h2 P=4 M=3: cannot use this input (compile): ",
        ),
    ],
)
def test_unusable_input_exits_2_with_its_verdict_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str, line: str
) -> None:
    """The error in full on stderr, as every command prints it; one line in the report."""
    code, out, err = run_cli(capsys, "verify", *argv)
    assert code == 2
    assert message in err and err.count("error:") == 1
    assert out.startswith(line) and out.count("\n") == 1 and message in out


def test_malformed_csv_points_at_the_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0X1\n1F0\n")
    code, _, err = run_cli(capsys, "verify", str(path))
    assert code == 2
    assert err == (
        f"{path}:1:5: error: not a torch action: '0X1' (expected e.g. 0F1, 2I0, "
        "1SEND_F3, (0F7;7B3)OVERLAP_F_B)\n    1 | 0F0,0X1\n      |     ^^^\n"
    )


def test_bad_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify", "zb_h1", "--comm", "mpi"])
    assert exc.value.code == 2
    assert (
        "argument --comm: invalid choice: 'mpi' (choose from 'nccl', 'nccl-single', "
        "'rendezvous', 'eager', 'all')" in capsys.readouterr().err
    )


def test_sweep_lists_skips_and_every_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(
        capsys,
        "verify",
        "zb_h1",
        "tests/verify/data/megatron_5100.sched",
        "--sweep",
        "ranks=2..4",
        "microbatches=1..6",
        "--jobs",
        "1",
    )
    assert code == 1
    lines = out.splitlines()
    assert "zb_h1: ok: 12 size(s) verified, 6 skipped" in lines
    assert "  skipped 6 size(s), requires M >= P: P=2: M=1; P=3: M=1..2; P=4: M=1..3" in lines
    at = lines.index(
        "tests/verify/data/megatron_5100.sched: FAILED at 12 size(s), 1 distinct failure(s): "
        "0 size(s) verified, 6 skipped"
    )
    assert lines[at + 1 :] == [
        "  error[needs-buffering] at tests/verify/data/megatron_5100.sched:13:45: 12 size(s): "
        "P=2 M=2, P=2 M=3, P=2 M=4, P=2 M=5, P=2 M=6, P=3 M=3, P=3 M=4, P=3 M=5, P=3 M=6, "
        "P=4 M=4, P=4 M=5, P=4 M=6",
        "  skipped 6 size(s), requires M >= P: P=2: M=1; P=3: M=1..2; P=4: M=1..3",
    ]
    assert out.count("error[needs-buffering]") == 2  # the first size's report, the summary


def test_sweep_lists_of_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "verify", "zb_h1", "--sweep", "P=2,4", "M=1..2,8", "--jobs", "1")
    assert code == 0
    assert out.splitlines()[0] == "zb_h1: ok: 3 size(s) verified, 3 skipped"


def test_sweep_in_parallel_matches_serial(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "zbv", "dualpipe", "--sweep", "ranks=2..4", "microbatches=1..8"]
    _, serial, _ = run_cli(capsys, *argv, "--jobs", "1")
    code, parallel, _ = run_cli(capsys, *argv, "--jobs", "2")
    assert code == 0 and parallel == serial
    assert json.loads(run_cli(capsys, *argv, "--format", "json")[1])[1]["verified"] == 4


def test_regression_data_is_where_the_docs_say() -> None:
    assert (DATA / "pytorch_172668.csv").exists()
