"""What the spawned ranks of tests/runtime/test_guard.py run: a training job's guards.

One process group of 2 ranks runs every case (starting processes costs seconds). The cases
that fail a runtime on purpose run it in a pipeline group of their own (`dist.new_group`),
so the connections a failure closes are that group's and the world serves the next case.
Functions here run in the spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from discovery_cases import Counts, counting
from pipecc.runtime import PipelineRuntime, RuntimeConfig, add_loss
from torch import nn

from pipecc.api import compile_schedule
from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program
from pipecc.passes.sum_shared import sum_shared

HIDDEN = 4
ROWS = 2  # rows per microbatch
Result = dict[str, Any]


class Stage(nn.Module):
    """Linear + tanh; `fail_at`: (step, microbatch) of the forward that raises, counted in
    forward calls; `added`: a loss added in every forward, inf for microbatch `inf_mb`."""

    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)))
        self.fail_on_call: int | None = None
        self.calls = 0
        self.inf_on_call: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise ValueError("the stage failed on purpose")
        h = torch.tanh(self.layers(x))
        if self.inf_on_call is not None:
            extra = torch.tensor(float("inf") if self.calls == self.inf_on_call else 0.0)
            h = add_loss(h, extra)
        return h


def stages(count: int, layers: dict[int, int] | None = None) -> list[Stage]:
    torch.manual_seed(0)
    return [Stage((layers or {}).get(s, 1)) for s in range(count)]


def runtime(
    program: Program,
    rank: int,
    built: list[Stage],
    config: RuntimeConfig | None = None,
) -> PipelineRuntime:
    held = program.placement.chunks(rank)
    modules = {slot.chunk: built[slot.stage] for slot in held}
    return PipelineRuntime(program, modules, config=config)


def batch(microbatches: int, nan_mb: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS * microbatches, HIDDEN, generator=generator)
    if nan_mb is not None:
        x[nan_mb * ROWS] = float("nan")
    return x, torch.randn(ROWS * microbatches, HIDDEN, generator=generator)


def _error(call: Callable[[], object]) -> Result:
    try:
        call()
    except PipeccError as err:
        return {"error": type(err).__name__, "message": str(err), "at": time.time()}
    return {"error": None}


# ---- cases -----------------------------------------------------------------------------------


def profiled(rank: int) -> Result:
    """A ZB-H1 step under torch.profiler: the labels of the instructions among its events;
    then `last_step`."""
    program = compile_schedule("zb_h1", ranks=2, microbatches=4)
    run = runtime(program, rank, stages(2))
    x, y = batch(4)
    run.step(x, y)  # the first step discovers the shapes
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        run.step(x, y)
    names = {event.name for event in prof.events()}
    labels = [instr.label() for instr in program.ranks[rank]]
    stats = run.last_step
    assert stats is not None
    return {"labels": labels, "missing": [label for label in labels if label not in names],
            "last_step": stats}  # fmt: skip


def mismatched(rank: int, mine: tuple[str, int], theirs: tuple[str, int]) -> Result:
    """Rank 0 runs `mine` (schedule, M), rank 1 `theirs`, both at P=2: refused when the
    runtimes are built, before any step."""
    name, microbatches = mine if rank == 0 else theirs
    program = compile_schedule(name, ranks=2, microbatches=microbatches)
    return _error(lambda: runtime(program, rank, stages(program.placement.num_stages(0))))


def sums_differ(rank: int) -> Result:
    """1F1B at P=2 with a tie of stages 0 and 1 declared on both ranks; rank 0's program
    sums its gradient (`--shared 0+1`), rank 1's places no sum (kept after it by the
    library): refused when the runtimes are built, each rank naming the two programs."""
    program = compile_schedule("1f1b", ranks=2, microbatches=4)
    program = sum_shared(program, shared=((0, 1),)) if rank == 0 else program
    tie = [((0, "layers.0.weight"), (1, "layers.0.weight"))]
    return _error(lambda: runtime(program, rank, stages(2), RuntimeConfig(shared=tie)))


def cut_differently(rank: int) -> Result:
    """DualPipe at P=2: both ranks hold stage 0 (rank 0 in pipe 0, rank 1 in pipe 1); rank 1
    builds it with two layers instead of one."""
    program = compile_schedule("dualpipe", ranks=2, microbatches=4)
    return _error(lambda: runtime(program, rank, stages(2, {0: 2} if rank == 1 else None)))


def clipped_nonfinite(rank: int) -> Result:
    """Rank 0 poisons one gradient after a good step: `clip_grad_norm_` raises on every rank
    with `error_if_nonfinite`, else returns the same nan norm on every rank; then (the group
    in step) a good step and a finite norm."""
    program = compile_schedule("1f1b", ranks=2, microbatches=2)
    run = runtime(program, rank, stages(2))
    x, y = batch(2)
    run.step(x, y)
    if rank == 0:
        grad = run.parameters()[0].grad
        assert grad is not None
        grad.view(-1)[0] = float("nan")
    raised = _error(lambda: run.clip_grad_norm_(1.0, error_if_nonfinite=True))
    norm = float(run.clip_grad_norm_(1.0))  # scales every gradient by nan, as torch's
    for param in run.parameters():
        param.grad = None
    run.step(x, y)
    return {"norm": norm, "raised": raised, "after": float(run.clip_grad_norm_(1.0))}


def host_reads(rank: int) -> Result:
    """`check_finite` on: the host reads of a step whose shapes are known."""
    program = compile_schedule("1f1b", ranks=2, microbatches=4)
    run = runtime(program, rank, stages(2), RuntimeConfig(check_finite=True))
    x, y = batch(4)
    run.step(x, y)
    counts = Counts()
    with counting(counts, ((torch.Tensor, ("item", "tolist", "cpu", "__bool__", "__float__")),)):
        run.step(x, y)
    return {"reads": counts.calls}


def nonfinite_loss(rank: int, config: RuntimeConfig, *, nan_mb: int | None = None,
                   inf_call: int | None = None) -> Result:  # fmt: skip
    """One good step, then one with a nan input row in microbatch `nan_mb` or an infinite
    added loss in stage 0's forward call `inf_call` (counted from the second step); then
    `clip_grad_norm_`. In a pipeline group of its own (it fails the runtime)."""
    program = compile_schedule("1f1b", ranks=2, microbatches=4)
    built = stages(2)
    run = runtime(program, rank, built, config)
    x, y = batch(4)
    run.step(x, y)
    if inf_call is not None:
        built[0].inf_on_call = built[0].calls + inf_call
    bad, _ = batch(4, nan_mb)
    found = {"step": _error(lambda: run.step(bad, y))}
    found["clip"] = _error(lambda: run.clip_grad_norm_(1.0))
    return found


def fails_fast(rank: int, flag: Path) -> Result:
    """Rank 1's stage raises in step 1 (the timeout is 300 s); it catches the error, tries
    every call, and lives on until rank 0 says it was told (a file); rank 0 then tries every
    call too. In a pipeline group of its own."""
    group = dist.new_group([0, 1])
    program = compile_schedule("1f1b", ranks=2, microbatches=4)
    built = stages(2)
    config = RuntimeConfig(group=group, timeout=300.0)
    run = runtime(program, rank, built, config)
    x, y = batch(4)
    run.step(x, y)
    if rank == 1:
        built[1].fail_on_call = built[1].calls + 2  # microbatch 1's forward
    found = {"step": _error(lambda: run.step(x, y))}
    if rank == 0:
        flag.write_text("told")
    else:
        deadline = time.monotonic() + 120.0
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    found["later"] = [
        _error(lambda: run.step(x, y)),
        _error(lambda: run.forward(x, y)),
        _error(lambda: run.clip_grad_norm_(1.0)),
        _error(lambda: run.global_loss()),
    ]
    return found


def run_cases(rank: int, world: int, folder: str) -> dict[str, Result]:
    del world
    found: dict[str, Result] = {"profiled": profiled(rank)}
    found["1f1b-zb_h1"] = mismatched(rank, ("zb_h1", 4), ("1f1b", 4))
    found["zbv-zb_h1"] = mismatched(rank, ("zbv", 4), ("zb_h1", 4))
    found["m8-m4"] = mismatched(rank, ("1f1b", 4), ("1f1b", 8))
    found["cut"] = cut_differently(rank)
    found["sums-differ"] = sums_differ(rank)
    found["clipped"] = clipped_nonfinite(rank)
    found["reads"] = host_reads(rank)
    checked = RuntimeConfig(group=dist.new_group([0, 1]), check_finite=True)
    found["nan-loss"] = nonfinite_loss(rank, checked, nan_mb=2)
    checked = RuntimeConfig(group=dist.new_group([0, 1]), check_finite=True)
    found["inf-added"] = nonfinite_loss(rank, checked, inf_call=2)
    found["unchecked"] = nonfinite_loss(rank, RuntimeConfig(), nan_mb=2)
    found["fails-fast"] = fails_fast(rank, Path(folder) / "told")
    return found
