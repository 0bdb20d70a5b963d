"""benchmarks/gpu_check.sh and its Python part, checked where no GPU is: the script parses,
runs the sync check, and the check's case runner works on the CPU (with no guard: the sync
debug mode exists only on CUDA) and judges its results as the GPU host will."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pipecc.api import compile_schedule
from pipecc.ir.ops import Fused

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


@functools.cache
def _benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _sync_check() -> ModuleType:
    return _benchmark("gpu_sync_check")


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_gpu_check_parses_and_runs_the_sync_check() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = SCRIPT.read_text().splitlines()
    assert any(
        line.startswith("timeout ") and "benchmarks/gpu_sync_check.py" in line for line in lines
    )


def test_the_sync_checks_case_runs_fused_ops_on_the_cpu(one_rank: None) -> None:
    check = _sync_check()
    result = check.run_case(
        check.Case("dualpipev", 1, 6), 0, torch.device("cpu"), contextlib.nullcontext
    )
    assert result["error"] is None, result["error"]
    program = compile_schedule("dualpipev", ranks=1, microbatches=6)
    fused = sum(1 for i in program.ranks[0] if type(i) is Fused)
    assert result["fused"] == fused > 0 and result["groups"] == [], "P=1: no messages"
    assert result["bindings"] == 1 and result["reused"], "one plan for the warm steps"
    assert check.verdict(result) == (
        True, f"dualpipev P=1 M=6: no host sync in the warm step ({fused} fused F&B, "
        "0 coalesced groups)",
    )  # fmt: skip


def test_the_sync_check_reports_a_sync_and_a_missing_coalesced_group(one_rank: None) -> None:
    check = _sync_check()

    @contextlib.contextmanager
    def syncs() -> Iterator[None]:
        raise RuntimeError("called a synchronizing CUDA operation")
        yield

    result = check.run_case(check.Case("1f1b", 1, 3), 0, torch.device("cpu"), syncs)
    ok, line = check.verdict(result)
    assert not ok and line.startswith("1f1b P=1 M=3: FAILED (0 fused F&B, 0 coalesced groups):")
    assert "RuntimeError: called a synchronizing CUDA operation" in line
    two = {"case": ("zbv", 2, 4), "fused": 0, "groups": [1, 1], "error": None, "bindings": 1,
           "reused": True}  # fmt: skip
    assert check.verdict(two) == (
        False, "zbv P=2 M=4: FAILED: no group went through batch_isend_irecv (0 fused F&B, "
        "0 coalesced groups)",
    )  # fmt: skip
    rebound = {**two, "groups": [2], "bindings": 3}
    assert check.verdict(rebound) == (
        False, "zbv P=2 M=4: FAILED: the plan was bound 3 times, receive buffers kept (0 fused "
        "F&B, 1 coalesced groups)",
    )  # fmt: skip


def test_the_gpu_check_runs_the_mesh_and_skips_what_one_gpu_cannot() -> None:
    text = SCRIPT.read_text()
    lines = text.splitlines()
    assert any(x.startswith("timeout ") and "benchmarks/gpu_mesh_check.py" in x for x in lines)
    for mesh in ("dp_shard=2", "dp_replicate=2", "tp=2"):
        assert mesh in text
    assert 'echo "skipped: pipecc run --mesh over NCCL needs 2 GPUs or more' in text


def test_the_mesh_checks_case_runs_fsdp_under_split_backward_on_the_cpu(one_rank: None) -> None:
    """benchmarks/gpu_mesh_check.py's case on gloo: DualPipeV (two FSDP2 stages on the rank,
    the tied embedding's two sharded copies, fused F&B) against one process without FSDP."""
    check = _benchmark("gpu_mesh_check")
    result = check.run_case("dualpipev", 4, torch.device("cpu"))
    assert result["actions"] == [2, 2], "an UNSHARD and a REDUCE_GRAD per stage"
    ok, line = check.verdict(result)
    assert ok, line
    assert line.startswith("dualpipev P=1 M=4 FSDP2 (dp_shard=1, tied) on cpu: loss ")
    assert line.endswith(": ok")
    bad = {**result, "grad_rel": 0.5}
    assert check.verdict(bad)[1].endswith(
        "max rel grad diff 5.00e-01, all-gathers 0 (UNSHARDs 2), reduce-scatters 0 "
        "(REDUCE_GRADs 2): FAILED"
    )
