"""benchmarks/gpu_check.sh and its Python parts, checked where no GPU is: the script runs
without CUDA as the GPU machine's image would run it (its python, pipecc from the tree through
the path shim, lark from a folder), skipping every GPU step; the sync check's and the streams
check's cases run on the CPU (with no guard: the busy GPU exists only on CUDA) and their
results are judged as the GPU host will judge them."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
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


STEPS = (
    "versions", "compat", "gpu-tests", "sync", "streams", "gpt-tied-dropout", "gpt-bf16",
    "gpt-recompute-full", "gpt-recompute-attn", "fsdp", "nccl-2", "mesh-2", "nccl-4", "ep-4",
    "ep-overlap", "sanitizer", "split", "profile",
)  # fmt: skip


def test_the_gpu_check_parses_and_runs_its_checks_in_order_of_value() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = SCRIPT.read_text().splitlines()
    named = [x.split()[1] if x.startswith(("step ", "gpu_step ")) else x.split()[2]
             for x in lines if x.startswith(("step ", "gpu_step ", "gpus_step "))]  # fmt: skip
    assert tuple(named) == STEPS
    assert "set -e" not in SCRIPT.read_text() and "pip install" not in SCRIPT.read_text()
    assert any(x.startswith("gpu_step sync ") and "gpu_sync_check.py" in x for x in lines)


@pytest.mark.slow
def test_without_cuda_the_check_skips_every_gpu_step_and_passes(tmp_path: Path) -> None:
    """As on a machine without CUDA: this environment's python as PYTHON, no .venv named."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:]
    rows = [line.split(None, 3) for line in (out / "summary.txt").read_text().splitlines()]
    assert [row[1] for row in rows] == list(STEPS)
    assert [row[0] for row in rows[:2]] == ["PASS", "PASS"], "versions and compat run"
    reasons = {row[3] for row in rows[2:]}
    assert {row[0] for row in rows[2:]} == {"SKIP"} and reasons == {
        "no CUDA device",
        "needs 2 GPUs (one rank per GPU), this host has 0",
        "needs 4 GPUs (one rank per GPU), this host has 0",
    }
    assert "no CUDA device: every GPU step is skipped" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "summary.txt"]
    assert done.stdout.rstrip().endswith("gpu check: ok")


def test_the_path_shim_imports_pipecc_from_the_tree_with_lark_from_a_folder(
    tmp_path: Path,
) -> None:
    """With a Python that has no pipecc (the interpreter this environment was made from),
    the shim on PYTHONPATH and lark copied into a folder: the moved packages come from the
    tree's folders and a bundled schedule compiles."""
    import lark

    base = getattr(sys, "_base_executable", sys.executable)
    shutil.copytree(Path(lark.__file__).parent, tmp_path / "wheels" / "lark")
    shim = ROOT / "benchmarks" / "tree_site"
    env = {**os.environ, "PYTHONPATH": f"{shim}:{tmp_path / 'wheels'}"}
    code = (
        "import importlib.util as u\n"
        "for n in ('pipecc', 'pipecc.runtime', 'pipecc.grammars', 'pipecc.schedules'):\n"
        "    print(u.find_spec(n).origin)\n"
        "from pipecc.api import compile_schedule\n"
        "print(len(compile_schedule('dualpipev', ranks=2, microbatches=4).ranks))\n"
    )
    done = subprocess.run([base, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        str(ROOT / "pipecc" / "__init__.py"), str(ROOT / "runtime" / "__init__.py"),
        str(ROOT / "grammars" / "__init__.py"), str(ROOT / "schedules" / "__init__.py"), "2",
    ]  # fmt: skip


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
        True, f"dualpipev P=1 M=6: no host sync of any kind in the warm step ({fused} fused "
        "F&B, 0 coalesced groups)",
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
    lines = SCRIPT.read_text().splitlines()
    assert any(x.startswith("gpu_step fsdp ") and "gpu_mesh_check.py" in x for x in lines)
    assert any(x.startswith("gpus_step 2 mesh-2 ") for x in lines)
    assert 'verdict SKIP "$1" 0 "needs $need GPUs (one rank per GPU), this host has' in (
        SCRIPT.read_text()
    )


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


def test_the_streams_checks_hand_off_case_matches_the_reference_on_the_cpu(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = _benchmark("gpu_streams_check")
    monkeypatch.setattr(check, "WIDTH", 16)
    monkeypatch.setattr(check, "ROWS", 2)
    monkeypatch.setattr(check, "STEPS", 2)
    ok, line = check.hand_off(torch.device("cpu"))
    assert ok and line.startswith("hand-off: (h, ones) read late, 2 steps: max rel diff ")
    assert line.endswith(": ok")


def test_the_streams_check_labels_each_half_and_judges_their_streams(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the trace has the labels (no kernels): one per half of every fused op;
    the kernels' streams are then judged from a trace as CUDA writes it."""
    check = _benchmark("gpu_streams_check")
    monkeypatch.setattr(check, "WIDTH", 16)
    monkeypatch.setattr(check, "ROWS", 2)
    runtime, _ = check.runtime_of(torch.device("cpu"))
    x, y = check.batch(torch.device("cpu"), 0)
    runtime.step(x, y)
    check.labelled(runtime)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runtime.step(x, y)
    labels = sorted(e.name for e in prof.events() if e.name.startswith("pipecc-half"))
    fused = [s.index for s in runtime.plans.bound(training=True).steps if type(s.instr) is Fused]
    assert len(fused) == 9
    assert labels == sorted(f"pipecc-half {i} {h}" for i in fused for h in ("fwd", "bwd"))

    def event(cat: str, ts: int, **fields: object) -> dict[str, object]:
        return {"cat": cat, "ts": ts, **fields}

    trace = {"traceEvents": [
        event("user_annotation", 10, dur=10, name="pipecc-half 4 fwd"),
        event("user_annotation", 30, dur=10, name="pipecc-half 4 bwd"),
        event("cuda_runtime", 12, args={"correlation": 1}),
        event("cuda_driver", 32, args={"correlation": 2}),
        event("cuda_runtime", 50, args={"correlation": 3}),  # outside every label
        event("kernel", 60, args={"correlation": 1, "stream": 7}),
        event("kernel", 61, args={"correlation": 2, "stream": 13}),
        event("kernel", 62, args={"correlation": 3, "stream": 7}),
    ]}  # fmt: skip
    found = check.kernel_streams(trace)
    assert found == {(4, "fwd"): {7}, (4, "bwd"): {13}}
    assert check.judge(found) == (
        True, "halves: 1 fused ops, 0 with both halves on one stream (instructions []), 0 with "
        "a half not seen: ok",
    )  # fmt: skip
    assert check.judge({(4, "fwd"): {7}, (4, "bwd"): {7, 13}, (6, "fwd"): {7}})[1] == (
        "halves: 2 fused ops, 1 with both halves on one stream (instructions [4]), 1 with a "
        "half not seen: FAILED"
    )
