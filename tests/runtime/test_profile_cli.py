"""`pipecc run --profile` refuses a noisy profile (exit 1, naming the worst stage and its
spread, the file not written) unless --allow-noisy-profile, and profiles 20 steps after 2
warm-up by default. The noise is made, not hoped for: the fault model's stage 0 sleeps 20 ms
in every odd step, so stage 0 F's per-step means spread by about 2, far over the bound."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from pipecc.runtime.profiling.recorder import SPREAD_BOUND

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")
FAULTY = str(Path(__file__).with_name("fault_model.py"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PIPECC_TEST_FAULT="noisy")
    return subprocess.run(
        [PIPECC, "run", "1f1b", "--nproc", "2", "-M", "2", "--model", FAULTY, *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
    )  # fmt: skip


def test_a_noisy_profile_is_refused_unless_allowed(tmp_path: Path) -> None:
    costs = tmp_path / "costs.toml"
    refused = _run("--steps", "4", "--warmup", "0", "--profile", str(costs))
    assert refused.returncode == 1, refused.stderr
    found = re.search(
        r"not written: the profile is noisy: (stage \d+) has a spread of ([0-9.]+)",
        refused.stderr,
    )
    assert found, refused.stderr
    assert float(found[2]) > SPREAD_BOUND
    assert f"profile spread {found[2]} at {found[1]}" in refused.stdout
    assert not costs.exists()

    allowed = _run("--profile", str(costs), "--allow-noisy-profile", "--json")
    assert allowed.returncode == 0, allowed.stderr
    report = json.loads(allowed.stdout)
    assert (report["steps"], report["warmup"]) == (20, 2), "--profile's default steps"
    assert report["profile_spread"] > SPREAD_BOUND
    assert report["profile_spread_bound"] == SPREAD_BOUND
    profile = tomllib.loads(costs.read_text())["profile"]
    assert profile["steps"] == 20
    assert profile["spread"] == report["profile_spread"]
    assert profile["spread_at"] == report["profile_spread_at"]
    # half the steps sleep 20 ms: the quartiles fall in the two modes, the median in one
    # of them or between, so the spread is 1 to 2, never near the bound
    assert profile["stage"]["0"]["F_spread"] > 5 * SPREAD_BOUND, "the odd steps' 20 ms"
    assert profile["stage"]["0"]["spread"] == report["profile_spread"], "stage 0 is the worst"
    assert report["profile_spread_at"] == "stage 0"
    assert tomllib.loads(costs.read_text())["cost"]["dispatch"] > 0, "each forward's host time"


def test_a_one_step_profile_has_no_spread_and_is_refused_before_any_process() -> None:
    result = _run("--steps", "1", "--profile", "never.toml")
    assert result.returncode == 2 and result.stdout == ""
    assert "--profile with --steps 1: the spread of a profile needs 2 or more timed" in (
        result.stderr
    )
    assert not (ROOT / "never.toml").exists()


def test_a_profile_on_a_mesh_keeps_the_data_parallel_reductions(tmp_path: Path) -> None:
    """The profiling interpreter wraps the runtime's whole interpreter, so the program's
    reductions over `dp_replicate` run under it as in a plain step (it lost the mesh, and
    stopped on an AssertionError, when it rebuilt the interpreter from its constructor's
    arguments)."""
    costs = tmp_path / "costs.toml"
    done = subprocess.run(
        [PIPECC, "run", "1f1b", "-M", "4", "--nproc", "4", "--mesh", "pp=2,dp_replicate=2",
         "--model", str(ROOT / "examples" / "gpt.py"), "--steps", "3", "--warmup", "1",
         "--profile", str(costs), "--allow-noisy-profile"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mesh pp=2,dp_replicate=2" in done.stdout
    assert tomllib.loads(costs.read_text())["cost"]["F"] > 0
