"""The pytest plugin: `pytest --pipecc DIR` turns each .sched × size into a test item."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers import SCHEDULES
from programs import DATA


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args, str(folder)],
        capture_output=True,
        text=True,
        cwd=folder,
        check=False,
    )


def test_items_per_size_with_skips_and_failures(tmp_path: Path) -> None:
    shutil.copy(SCHEDULES / "zb_h1.sched", tmp_path)
    shutil.copy(DATA / "megatron_5100.sched", tmp_path)
    result = _pytest(tmp_path, "--pipecc", "--pipecc-sizes", "ranks=2..3 microbatches=1..4")
    out = result.stdout
    assert result.returncode == 1, out
    # zb_h1: 8 sizes, 3 rejected by `require M >= P`; megatron_5100: 5 allowed, all fail
    assert "5 failed, 5 passed, 6 skipped" in out
    assert "SKIPPED [1] zb_h1.sched:1: P=3 M=2: requires M >= P" in out
    assert "_ megatron_5100.sched P=2 M=2 _" in out
    assert "error[needs-buffering]" in out


def test_the_comm_option_chooses_the_models(tmp_path: Path) -> None:
    # pair_order_cycle deadlocks under nccl only, so each --pipecc-comm gives its own verdict
    shutil.copy(DATA / "pair_order_cycle.sched", tmp_path)
    sizes = ("--pipecc-sizes", "ranks=2 microbatches=2")
    gloo = _pytest(tmp_path, "--pipecc", "--pipecc-comm", "rendezvous", *sizes)
    assert gloo.returncode == 0 and "1 passed" in gloo.stdout, gloo.stdout
    default = _pytest(tmp_path, "--pipecc", *sizes)
    assert default.returncode == 1 and "error[deadlock]: deadlock under nccl:" in default.stdout
    both = _pytest(tmp_path, "--pipecc", "--pipecc-comm", "all", *sizes)
    assert both.returncode == 1
    assert "nccl deadlock, nccl-single deadlock, rendezvous passes, eager passes" in both.stdout


def test_without_the_flag_nothing_is_collected(tmp_path: Path) -> None:
    shutil.copy(SCHEDULES / "zb_h1.sched", tmp_path)
    result = _pytest(tmp_path)
    assert result.returncode == 5  # pytest: no tests collected
    assert "no tests ran" in result.stdout
