"""Fused F&B on two CUDA streams, checked on one GPU (benchmarks/gpu_check.sh):

- **halves**: a warm step of DualPipeV (P=1, M=6, an MLP) under `torch.profiler`, each half
  of every fused op labelled (`record_function`); every kernel of the trace is given to the
  label whose host range holds its launch. Each fused op's forward kernels and backward
  kernels must run on different streams (runtime/engine/fused.py: autograd runs a backward
  where its forward ran, so the fused forward goes to the other stream).
- **hand-off**: a stage that returns `(h, ones)`, `ones` without a gradient, read late by
  the next stage (after its heavy work), handed on locally at DualPipeV's V turn into a
  fused forward on the side stream while the backward allocates on the current one: the
  loss and every gradient over several steps against one process on the same GPU. Without
  the tensors held until the streams join, the allocator could hand `ones`'s block to the
  backward while the side stream still reads it.
- `--sanitize`: only warm steps of the hand-off case, for a run under
  `TORCH_CUDA_SANITIZER=1` (torch's CUDA sanitizer reports unsynchronized accesses).

    python3 -u benchmarks/gpu_streams_check.py [--sanitize]    # exit 1 when a check fails
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from pipecc.runtime import PipelineRuntime, RuntimeConfig
from pipecc.runtime.config import mse_loss
from pipecc.runtime.engine.steps import FusedStep
from pipecc.runtime.tools.reference import Options, compare, gradients, reference_step
from torch import nn

from pipecc.api import compile_schedule

WIDTH, ROWS, MICROBATCHES, STEPS = 1024, 256, 6, 4
TOLERANCE = 1e-4
LAUNCHES = ("cuda_runtime", "cuda_driver")  # a kernel's launch: cudaLaunchKernel, cuLaunchKernel


class Heavy(nn.Module):
    """Stage 0 of the hand-off case: `(h, ones)`, `ones` carrying no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return h, torch.ones_like(h)


class ReadsLate(nn.Module):
    """Stage 1: its heavy work first, then the no-gradient input."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))

    def forward(self, h: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        return self.body(h) + ones  # an add keeps no input for the backward


def stages(device: torch.device) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Heavy().to(device), ReadsLate().to(device)]


def batch(device: torch.device, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    shape = (ROWS * MICROBATCHES, WIDTH)
    x = torch.randn(shape, generator=generator).to(device)
    return x, torch.randn(shape, generator=generator).to(device)


def runtime_of(device: torch.device) -> tuple[PipelineRuntime, list[nn.Module]]:
    program = compile_schedule("dualpipev", ranks=1, microbatches=MICROBATCHES)
    modules = stages(device)
    chunks = {slot.chunk: modules[slot.stage] for slot in program.placement.chunks(0)}
    return PipelineRuntime(program, chunks, config=RuntimeConfig(device=device)), modules


def hand_off(device: torch.device) -> tuple[bool, str]:
    """The hand-off case, STEPS steps, each against the reference."""
    runtime, modules = runtime_of(device)
    reference = stages(device)
    worst = 0.0
    for step in range(STEPS):
        for module in (*modules, *reference):
            module.zero_grad(set_to_none=True)
        x, y = batch(device, step)
        runtime.step(x, y)
        loss = float(runtime.global_loss())
        want, grads = reference_step(
            reference, (x, y), MICROBATCHES, mse_loss, Options(device=device)
        )
        _, rel, _ = compare(gradients(modules), grads)
        worst = max(worst, rel, abs(loss - want) / (abs(want) or 1.0))
    ok = worst <= TOLERANCE
    verdict = "ok" if ok else "FAILED"
    return ok, f"hand-off: (h, ones) read late, {STEPS} steps: max rel diff {worst:.2e}: {verdict}"


def labelled(runtime: PipelineRuntime) -> None:
    """Each half of every fused step of the training plan inside a `record_function`."""
    plan = runtime.plans.bound(training=True)
    ops = runtime.interpreter.fused.ops
    forward = ops.forward

    def fwd(ctx: Any, op: Any) -> None:
        with torch.profiler.record_function(f"pipecc-half {op.index} fwd"):
            forward(ctx, op)

    cast(Any, ops).forward = fwd
    for step in plan.steps:
        if isinstance(step, FusedStep):
            step.backward.run = _wrapped(step.backward.run, f"pipecc-half {step.index} bwd")


def _wrapped(run: Callable[[Any, Any], None], label: str) -> Callable[[Any, Any], None]:
    def bwd(ctx: Any, op: Any) -> None:
        with torch.profiler.record_function(label):
            run(ctx, op)

    return bwd


def kernel_streams(trace: dict[str, Any]) -> dict[tuple[int, str], set[int]]:
    """(fused step, half) -> the streams of the kernels launched inside its label."""
    events = trace["traceEvents"]
    labels = [
        (e["ts"], e["ts"] + e["dur"], e["name"].split()[1:])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("pipecc-half")
    ]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})
    }
    found: dict[tuple[int, str], set[int]] = {}
    for event in events:
        if event.get("cat") != "kernel":
            continue
        at = launches.get(event["args"].get("correlation"))
        for start, end, (index, half) in labels:
            if at is not None and start <= at <= end:
                found.setdefault((int(index), half), set()).add(int(event["args"]["stream"]))
    return found


def halves(device: torch.device) -> tuple[bool, str]:
    """The halves case: a warm step profiled, every fused op's halves' streams compared."""
    runtime, modules = runtime_of(device)
    x, y = batch(device, 0)
    for _ in range(2):
        runtime.step(x, y)
    labelled(runtime)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        runtime.step(x, y)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        found = kernel_streams(json.loads(Path(path).read_text()))
    return judge(found)


def judge(found: dict[tuple[int, str], set[int]]) -> tuple[bool, str]:
    """Every fused op: both halves seen, on disjoint streams."""
    ops = sorted({index for index, _ in found})
    shared = [i for i in ops if found.get((i, "fwd"), set()) & found.get((i, "bwd"), set())]
    missing = [i for i in ops if not found.get((i, "fwd")) or not found.get((i, "bwd"))]
    ok = bool(ops) and not shared and not missing
    return ok, (
        f"halves: {len(ops)} fused ops, {len(shared)} with both halves on one stream "
        f"(instructions {shared}), {len(missing)} with a half not seen: "
        + ("ok" if ok else "FAILED")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitize", action="store_true", help="warm steps only (CSAN)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        checks = [hand_off] if args.sanitize else [halves, hand_off]
        results = [check(device) for check in checks]
    finally:
        dist.destroy_process_group()
    for _, line in results:
        print(line, flush=True)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
