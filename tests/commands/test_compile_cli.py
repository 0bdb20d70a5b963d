"""`pipecc compile` and `pipecc list` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

from pipecc import __version__
from pipecc.cli import main

ZB_H1_GRID = """\
# zb_h1  P=4 M=8  placement loop
rank 0 | F0.0 F0.1 F0.2 F0.3 I0.0 W0.0 F0.4 I0.1 W0.1 F0.5 I0.2 W0.2 F0.6 I0.3 W0.3 F0.7 I0.4 W0.4 I0.5 W0.5 I0.6 W0.6 I0.7 W0.7
rank 1 | F0.0 F0.1 F0.2 I0.0 F0.3 I0.1 W0.0 F0.4 I0.2 W0.1 F0.5 I0.3 W0.2 F0.6 I0.4 W0.3 F0.7 I0.5 W0.4 I0.6 W0.5 I0.7 W0.6 W0.7
rank 2 | F0.0 F0.1 I0.0 F0.2 I0.1 F0.3 I0.2 W0.0 F0.4 I0.3 W0.1 F0.5 I0.4 W0.2 F0.6 I0.5 W0.3 F0.7 I0.6 W0.4 I0.7 W0.5 W0.6 W0.7
rank 3 | F0.0 I0.0 F0.1 I0.1 F0.2 I0.2 F0.3 I0.3 W0.0 F0.4 I0.4 W0.1 F0.5 I0.5 W0.2 F0.6 I0.6 W0.3 F0.7 I0.7 W0.4 W0.5 W0.6 W0.7
"""


def test_text_grid(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "compile",
                str(ROOT / "schedules/zb_h1.sched"),
                "--ranks",
                "4",
                "--microbatches",
                "8",
                "--format",
                "text",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == ZB_H1_GRID


def test_readme_shows_the_real_grid() -> None:
    assert ZB_H1_GRID.strip() in (ROOT / "README.md").read_text()


def test_text_grid_aligns_fused_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "dualpipe", "-P", "4", "-M", "8", "--format", "text"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("rank 0 | F0.0 F0.1 F0.2 F1.4 I1.4 W1.4 F1.5      F0.3&B1.5")
    assert len({line.index("|") for line in lines[1:]}) == 1


def test_output_file_and_json_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prog.json"
    assert main(["compile", "dualpipe", "-P", "4", "-M", "8", "-o", str(out)]) == 0
    assert capsys.readouterr().out == ""
    assert json.loads(out.read_text())["schedule"] == "dualpipe"
    assert main(["compile", str(out), "--format", "listing"]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith("# dualpipe  P=4 M=8  placement bidirectional\nrank 0:\n")
    assert "send act pipe 0 stage 1 mb 0 to rank 1" in listing


def test_defines_change_the_program(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["compile", "interleaved_1f1b", "-P", "2", "-M", "4", "-D", "V=3", "--format", "text"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("# interleaved_1f1b  P=2 M=4  placement loop(3)  V=3\n")
    assert "F2.0" in out


def test_list_shows_every_bundled_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert names == sorted(p.stem for p in (ROOT / "schedules").glob("*.sched"))
    assert "M >= 2 * P" in out


def test_help_explains_formats_and_exit_codes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipecc.cli", "compile", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    for word in ("torch-csv-comms", "--microbatches", "-D NAME=VALUE", "F0.4&B1.1"):
        assert word in result.stdout
    top = subprocess.run(
        [sys.executable, "-m", "pipecc.cli", "--help"], capture_output=True, text=True, check=False
    ).stdout
    assert "exit codes: 0 success, 1" in top


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"pipecc {__version__}\n"


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "pipecc"
    result = subprocess.run(
        [str(script), "compile", "gpipe", "-P", "2", "-M", "2", "--format", "torch-csv"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    assert result.stdout == "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"


def test_early_recv_policy_compiles_verifies_for_gloo_and_is_flagged_for_nccl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "zb_h1.json"
    code, _, err = run_cli(
        capsys, "compile", "zb_h1", "-P", "4", "-M", "8", "--comm-policy", "early-recv",
        "-o", str(out),
    )  # fmt: skip
    assert code == 0, err
    program = json.loads(out.read_text())
    assert program["comm"] == "early-recv"
    for instrs in program["programs"]:
        first = next(k for k, i in enumerate(instrs) if i["op"] in ("F", "B", "I", "W", "F&B"))
        assert all(k < first for k, i in enumerate(instrs) if i["op"] == "recv")
    code, text, _ = run_cli(capsys, "verify", str(out), "--comm", "rendezvous")
    assert code == 0, text
    code, text, _ = run_cli(capsys, "verify", str(out))  # nccl, the default model
    assert code == 1
    assert "error[deadlock]: deadlock under nccl" in text
    assert (
        "note: compiled with the early-recv comm policy, which is for gloo: NCCL's ordered "
        "streams deadlock on it by design (verify it with --comm rendezvous)" in text
    )
    # the same policy applied to a compiled program places its comm ops again
    code, again, err = run_cli(
        capsys, "compile", "zb_h1", "-P", "4", "-M", "8", "-o", str(tmp_path / "default.json")
    )
    assert code == 0, err
    code, again, err = run_cli(
        capsys, "compile", str(tmp_path / "default.json"), "--comm-policy", "early-recv"
    )
    assert code == 0, err
    assert json.loads(again) == program


def test_align_and_a_comm_policy_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "compile", "zb_h1", "-P", "4", "-M", "8", "--comm-policy", "early-recv",
        "--align", "--cost", "F=1,B=2",
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert err == "error: --align and --comm-policy both place the comm ops: give one of them\n"


def test_a_compiled_program_keeps_its_placement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    aligned = tmp_path / "aligned.json"
    code, _, err = run_cli(
        capsys, "compile", "zb_h1", "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=2,comm=0.3",
        "--align", "-o", str(aligned),
    )  # fmt: skip
    assert code == 0, err
    code, again, err = run_cli(capsys, "compile", str(aligned))
    assert code == 0, err
    assert json.loads(again) == json.loads(aligned.read_text())
    assert json.loads(again)["comm"] == "aligned"


def test_costs_without_align_are_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "compile", "zb_h1", "-P", "4", "-M", "8", "--cost", "F=1")
    assert (code, out) == (2, "")
    assert err == "error: --cost/--cost-file are for --align (without it nothing uses them)\n"
