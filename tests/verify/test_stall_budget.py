"""`pipecc verify --stall-budget`: placement-bound waits over a budget are violations; the
budget works with --comm all, --sweep, --format github and the pytest plugin."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

from pipecc.cli import main
from pipecc.diagnostics import InputError
from pipecc.verify import StallBudget

COSTS = "F=1,B=2,I=1,W=1,comm=0.1"
EXAMPLES = ROOT / "examples" / "schedules"


def test_budget_syntax() -> None:
    assert StallBudget.parse("0") == StallBudget(0.0)
    assert StallBudget.parse("0.05").allowed(100) == 0.05
    assert StallBudget.parse("2%").allowed(50) == 1.0
    with pytest.raises(InputError, match="expected a time"):
        StallBudget.parse("fast")


def test_default_placement_fails_a_zero_budget_only_with_a_long_latency(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # comm = 0.1: no placement-bound wait under per-peer nccl (docs/compile.md)
    code, out, _ = run_cli(capsys, "verify", "dualpipe", "-P", "8", "-M", "20", "--cost", COSTS,
                           "--stall-budget", "0", "--comm", "nccl")  # fmt: skip
    assert code == 0, out
    assert "budget 0): 8.6/0 8.5/0 8.4/0 8.3/0 8.3/0 8.4/0 8.5/0 8.6/0" in out
    # comm = 1, as long as a forward: the default's order leaves a wait the budget catches
    code, out, _ = run_cli(
        capsys,
        "verify",
        "zb_h1",
        "-P",
        "4",
        "-M",
        "8",
        "--cost",
        "F=1,B=2,I=1,W=1,comm=1",
        "--stall-budget",
        "0",
        "--comm",
        "nccl",
        "--format",
        "json",
    )
    assert code == 1
    report = json.loads(out)
    first = report["violations"][0]
    assert first["code"] == "stall"
    assert (first["rank"], first["index"]) == (1, 37)
    assert first["message"] == (
        "rank 1 @37 F0.5 (stage 1 mb 5) waits 1 longer than its data needs (20 to 21, of which"
        " 0 dependency-bound) under nccl, over the stall budget 0: [33] recv act pipe 0 stage 1"
        " mb 5 from rank 0 completed at 21: rank 0's [20] send act pipe 0 stage 1 mb 5 to rank 1"
        " was queued on its nccl stream behind [17] recv grad pipe 0 stage 0 mb 2 from rank 1"
        " until 20"
    )
    assert first["line"] == 13  # the .sched line of the F that waited
    waits = report["waits"][0]
    assert waits["model"] == "nccl" and waits["makespan"] == 42
    assert waits["placement_bound"] == [0, 3, 0, 0] and waits["dependency_bound"][1] == 14


def test_percentage_budget_lets_short_waits_pass(capsys: pytest.CaptureFixture[str]) -> None:
    # the longest placement-bound wait here is 1, under 5% of the makespan (2.1)
    code, out, _ = run_cli(
        capsys,
        "verify",
        "zb_h1",
        "-P",
        "4",
        "-M",
        "8",
        "--cost",
        "F=1,B=2,I=1,W=1,comm=1",
        "--stall-budget",
        "5%",
        "--comm",
        "nccl",
    )
    assert code == 0, out
    assert "budget 5%): 18/0 14/3 16/0 15/0" in out


def test_aligned_program_passes_under_every_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    aligned = tmp_path / "dp.json"
    assert (
        main(
            [
                "compile",
                "dualpipe",
                "-P",
                "8",
                "-M",
                "20",
                "--cost",
                COSTS,
                "--align",
                "-o",
                str(aligned),
            ]
        )
        == 0
    )
    code, out, _ = run_cli(
        capsys, "verify", str(aligned), "--cost", COSTS, "--stall-budget", "0", "--comm", "all"
    )
    assert code == 0, out
    assert out.count("/0 ") >= 4 * 7  # zero placement-bound wait on every rank, every model


def test_send_after_w_under_rendezvous_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "verify",
        str(EXAMPLES / "zb_h1_send_after_w.sched"),
        "-P",
        "4",
        "-M",
        "8",
        "--cost",
        "F=1,I=1,W=2",
        "--comm",
        "rendezvous",
        "--stall-budget",
        "0",
        "--format",
        "github",
    )
    assert code == 1
    errors = [line for line in out.splitlines() if line.startswith("::error")]
    assert errors and all("pipecc verify [stall]" in line for line in errors)
    assert "posted the matching send only at" in out


def test_budget_in_a_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "verify",
        str(ROOT / "schedules" / "zb_h1.sched"),
        "--sweep",
        "ranks=2..3",
        "microbatches=4",
        "--cost",
        "F=1,I=1,W=1,comm=1",
        "--stall-budget",
        "0",
        "--jobs",
        "1",
    )
    assert code == 1
    assert "FAILED at" in out and "error[stall]" in out


def test_budget_needs_a_cost_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "verify", "zb_h1", "-P", "4", "-M", "8", "--stall-budget", "0")
    assert code == 2
    assert err == "error: --stall-budget needs a cost model: --cost K=V,... or --cost-file\n"


def test_pytest_plugin_applies_the_budget(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "zb_h1_send_after_w.sched", tmp_path)
    base = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--pipecc",
        "--pipecc-sizes",
        "ranks=4 microbatches=8",
        str(tmp_path),
    ]
    clean = subprocess.run(base, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert clean.returncode == 0, clean.stdout
    budget = subprocess.run(
        [
            *base,
            "--pipecc-comm",
            "rendezvous",
            "--pipecc-stall-budget",
            "0",
            "--pipecc-cost",
            "F=1,I=1,W=2",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert budget.returncode == 1
    assert "error[stall]" in budget.stdout
