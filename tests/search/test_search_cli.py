"""`pipecc search`: the command-line contract (JSON keys, files, exit codes), and a .sched it
wrote compiles, verifies and runs with `pipecc run --check` (P=2 and 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipecc.cli import main

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")
MLP = str(ROOT / "examples" / "mlp.py")
KEYS = {"makespan", "lower_bound", "gap", "peak", "placement", "seconds", "baseline", "backend",
        "comm"}  # fmt: skip


def _search(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["search", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_exactly_the_contract_keys_and_files_reproduce_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "best.json"
    code, out, _ = _search(capsys, "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1,comm=1",
                           "--memory", "4", "--json", "-o", str(out_json),
                           "--sched", str(tmp_path / "best.sched"))  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert set(report) == KEYS
    assert report["placement"] == "loop" and len(report["peak"]) == 4
    assert max(report["peak"]) <= 4
    assert report["gap"] == pytest.approx(report["makespan"] / report["lower_bound"] - 1)
    assert report["baseline"]["name"] in {"1f1b", "zb_h1", "zb_h2", "gpipe"}
    assert report["makespan"] <= report["baseline"]["makespan"]
    costs = tmp_path / "best.costs.toml"
    assert costs.exists()
    assert main(["simulate", str(out_json), "--cost-file", str(costs), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["makespan"] == report["makespan"]
    assert main(["verify", str(out_json), "--comm", "all"]) == 0
    assert (
        main(["verify", str(tmp_path / "best.sched"), "-P", "4", "-M", "8", "--comm", "all"]) == 0
    )


def test_table_and_grid_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _search(capsys, "-P", "2", "-M", "4", "--cost", "F=1,I=1,W=0.5",
                           "--memory", "2", "--placement", "auto")  # fmt: skip
    assert code == 0
    assert "lower bound" in out and "baseline" in out and "rank 1 |" in out


def test_memory_budget_is_the_memory_cap(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["-P", "2", "-M", "4", "--cost", "F=1,I=1,W=1,comm=0.5", "--json"]
    reports = []
    for flag in ("--memory", "--memory-budget"):
        code, out, _ = _search(capsys, *args, flag, "1")
        assert code == 0
        reports.append(json.loads(out))
    assert max(reports[1]["peak"]) <= 1
    assert {**reports[0], "seconds": 0} == {**reports[1], "seconds": 0}


def test_no_schedule_fits_exits_1_with_the_smallest_cap(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _search(capsys, "-P", "4", "-M", "8", "--cost", "F=1", "--memory", "0.5",
                             "--placement", "auto")  # fmt: skip
    assert code == 1 and out == ""
    assert "the smallest cap that has one is 1 (" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "2"], "give the costs"),
        (["--cost", "F=1", "--memory", "-1"], "--memory must be a positive number"),
        (["--cost", "F=1", "--memory", "2", "--mem", "F=1,X=2"], "--mem: expected"),
        (["--cost", "F=1", "--memory", "2", "--mem", "B=-1,I=0,W=-2"], "is not I + W"),
        (["--cost", "G=1", "--memory", "2"], "unknown cost key 'G'"),
        (["--cost", "F=1", "--memory", "2", "--time-limit", "0"], "--time-limit must be"),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = _search(capsys, "-P", "2", "-M", "2", *args)
    assert code == 2 and out == ""
    assert message in err


def test_a_stage_table_beyond_the_cut_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    costs = tmp_path / "v.toml"
    costs.write_text("[cost]\nF = 1\n[cost.stage.3]\nF = 2\n")
    code, _, err = _search(capsys, "-P", "2", "-M", "2", "--cost-file", str(costs),
                           "--memory", "2")  # fmt: skip
    assert code == 2
    assert "[cost.stage.3] names a stage that loop P=2 (2 stages) does not have" in err


@pytest.mark.parametrize(("ranks", "placement"), [(2, "vshape"), (4, "loop")])
def test_a_written_sched_compiles_verifies_and_runs(
    tmp_path: Path, ranks: int, placement: str
) -> None:
    sched = tmp_path / "found.sched"
    assert main(["search", "-P", str(ranks), "-M", "4", "--cost", "F=1,I=1.5,W=0.5,comm=0.3",
                 "--memory", str(ranks), "--placement", placement, "--json",
                 "--sched", str(sched)]) == 0  # fmt: skip
    assert main(["verify", str(sched), "-P", str(ranks), "-M", "4", "--comm", "all"]) == 0
    env = dict(os.environ, PIPECC_MLP_HIDDEN="16")
    result = subprocess.run(
        [PIPECC, "run", str(sched), "-P", str(ranks), "-M", "4", "--nproc", str(ranks),
         "--model", MLP, "--check", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["max_rel_grad_diff"] <= 1e-6


def test_the_pytest_plugin_verifies_a_written_sched(tmp_path: Path) -> None:
    assert main(["search", "-P", "3", "-M", "5", "--cost", "F=1,I=1,W=1,comm=0.5",
                 "--memory", "2", "--placement", "vshape", "--json",
                 "--sched", str(tmp_path / "found.sched")]) == 0  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pipecc",
         "--pipecc-comm", "all", "--pipecc-sizes", "ranks=2..3 microbatches=5", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 skipped" in result.stdout  # P=2: the file requires P == 3


def test_host_costs_of_a_profile_are_named_as_left_out(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    costs = tmp_path / "profile.toml"
    costs.write_text('[cost]\nunit = "ms"\nF = 1\nI = 1\nW = 0.5\ncomm = 0.2\npost = 0.1\n')
    code, out, err = _search(capsys, "-P", "2", "-M", "4", "--cost-file", str(costs),
                             "--memory", "2", "--json")  # fmt: skip
    assert code == 0
    assert set(json.loads(out)) == KEYS  # stdout stays one JSON object
    assert "no host time: post=0.1 are not in its search" in err
