"""What `pipecc run` does: spawn P ranks, run steps, time them, check, profile.

A model file defines `build_stages(num_stages) -> list[nn.Module]` (the whole model as
consecutive stages, deterministic), `make_batch(num_rows, seed) -> (inputs, targets)` and
optionally `loss_fn(output, target)` (default: mean squared error).

Every rank builds the whole model and keeps the stages of its chunks (stage s of either pipe
is model stage s); it infers the boundary shapes locally from the whole model on the meta
device, so nothing is exchanged before the program runs. Each step: zero the gradients, make
the batch with `seed` = step index (warm-up steps first), barrier, `step`, barrier; the time
between the barriers on rank 0 is the step time. Weights stay fixed (no optimizer), so the
check compares every step with the single-process reference.
"""

from __future__ import annotations

import runpy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError
from pipecc.ir.program import Program

from .config import RuntimeConfig, mse_loss
from .pipeline import PipelineRuntime
from .profile import Recorder, render_cost_file
from .reference import ParamKey, compare, reference_step
from .spawn import spawn
from .specs import infer_boundaries


@dataclass(frozen=True)
class RunJob:
    """One `pipecc run`: the program and how to run it."""

    program: Program
    model: str
    batch_size: int
    steps: int = 1
    warmup: int = 0
    check: bool = False
    timeout: float = 300.0
    profile: bool = False


@dataclass(frozen=True)
class RunReport:
    """What `pipecc run --json` prints (plus the cost file text when profiling)."""

    schedule: str
    ranks: int
    microbatches: int
    batch_size: int
    loss: float
    max_abs_grad_diff: float | None
    max_rel_grad_diff: float | None
    reference_loss: float | None
    step_ms: float
    steps: int
    warmup: int
    backend: str
    comm: str  # the lowering policy that placed the program's comm ops
    cost_file: str | None = None


@dataclass(frozen=True)
class ModelFile:
    build_stages: Callable[[int], list[torch.nn.Module]]
    make_batch: Callable[..., tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]


def load_model(path: str) -> ModelFile:
    """Read a model file; every way it can be unusable is an InputError."""
    if not Path(path).is_file():
        raise InputError(f"{path}: no such model file")
    try:
        names = runpy.run_path(path, run_name="pipecc_model")
    except Exception as err:
        raise InputError(
            f"{path}: the model file fails to load: {type(err).__name__}: {err}"
        ) from err
    for name in ("build_stages", "make_batch"):
        if not callable(names.get(name)):
            raise InputError(f"{path}: the model file must define {name}()")
    loss_fn = names.get("loss_fn", mse_loss)
    if not callable(loss_fn):
        raise InputError(f"{path}: loss_fn must be a function")
    return ModelFile(names["build_stages"], names["make_batch"], loss_fn)


def backend_for(ranks: int) -> str:
    """NCCL when there is a GPU per rank, else gloo on CPU."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"


def run_job(job: RunJob) -> RunReport:
    """Run the job on `program.num_ranks` local processes and report."""
    if job.batch_size % job.program.num_microbatches:
        raise InputError(
            f"--batch-size {job.batch_size} cannot be split into "
            f"{job.program.num_microbatches} equal microbatches"
        )
    model = load_model(job.model)
    backend = backend_for(job.program.num_ranks)
    results = spawn(_worker, job.program.num_ranks, job, backend=backend, timeout=job.timeout)
    last = job.warmup + job.steps - 1
    losses = [loss for r in results for mb, loss in r["losses"][last].items()]
    abs_diff = rel_diff = reference = None
    if job.check:
        abs_diff, rel_diff, reference = _check(job, model, results)
    cost = _cost_text(job, results) if job.profile else None
    return RunReport(
        schedule=job.program.schedule,
        ranks=job.program.num_ranks,
        microbatches=job.program.num_microbatches,
        batch_size=job.batch_size,
        loss=sum(losses) / job.program.num_microbatches,
        max_abs_grad_diff=abs_diff,
        max_rel_grad_diff=rel_diff,
        reference_loss=reference,
        step_ms=statistics.median(results[0]["step_ms"]),
        steps=job.steps,
        warmup=job.warmup,
        backend=backend,
        comm=job.program.comm,
        cost_file=cost,
    )


def _worker(rank: int, world: int, job: RunJob) -> dict[str, Any]:
    model = load_model(job.model)
    program = job.program
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    stages = [s.to(device) for s in model.build_stages(program.placement.num_stages(0))]
    modules = {slot.chunk: stages[slot.stage] for slot in program.placement.chunks(rank)}
    first = model.make_batch(job.batch_size, seed=0)[0]
    sample = _first_microbatch(first, program.num_microbatches)
    runtime = PipelineRuntime(
        program,
        modules,
        infer_boundaries(stages, sample),
        loss_fn=model.loss_fn,
        config=RuntimeConfig(timeout=job.timeout, device=device),
    )
    out: dict[str, Any] = {"step_ms": [], "losses": [], "grads": [], "records": []}
    for step in range(job.warmup + job.steps):
        timed = step >= job.warmup
        recorder = Recorder(step=step) if job.profile and timed else None
        elapsed = _timed_step(
            runtime, modules, model.make_batch(job.batch_size, seed=step), recorder
        )
        if timed:
            out["step_ms"].append(elapsed * 1e3)
        out["losses"].append({mb: float(v) for mb, v in runtime.losses.items()})
        if job.check:
            out["grads"].append(_my_grads(program, rank, modules))
        if recorder is not None:
            out["records"].append(recorder)
    return out


def _first_microbatch(inputs: Any, microbatches: int) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs[: inputs.shape[0] // microbatches]
    return tuple(t[: t.shape[0] // microbatches] for t in inputs)


def _timed_step(
    runtime: PipelineRuntime,
    modules: dict[int, torch.nn.Module],
    batch: tuple[Any, Any],
    recorder: Recorder | None,
) -> float:
    for module in modules.values():
        module.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    runtime.step(batch[0], batch[1], recorder=recorder)
    dist.barrier()
    return time.perf_counter() - start


def _my_grads(
    program: Program, rank: int, modules: dict[int, torch.nn.Module]
) -> dict[ParamKey, torch.Tensor]:
    grads = {}
    for slot in program.placement.chunks(rank):
        for name, p in modules[slot.chunk].named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[(slot.stage, name)] = grad.detach().cpu().clone()
    return grads


def _check(
    job: RunJob, model: ModelFile, results: list[dict[str, Any]]
) -> tuple[float, float, float]:
    """The worst gradient differences over all steps and all copies of every stage, and the
    reference loss of the last step."""
    stages = model.build_stages(job.program.placement.num_stages(0))
    worst_abs = worst_rel = loss = 0.0
    for step in range(job.warmup + job.steps):
        batch = model.make_batch(job.batch_size, seed=step)
        loss, want = reference_step(stages, batch, job.program.num_microbatches, model.loss_fn)
        for result in results:
            got_abs, got_rel = compare(result["grads"][step], want)
            worst_abs, worst_rel = max(worst_abs, got_abs), max(worst_rel, got_rel)
    return worst_abs, worst_rel, loss


def _cost_text(job: RunJob, results: list[dict[str, Any]]) -> str:
    records = [record for result in results for record in result["records"]]
    program = job.program
    header = "\n".join(
        (
            f"pipecc run --profile: {program.schedule}, P={program.num_ranks}, "
            f"M={program.num_microbatches}, batch {job.batch_size} rows, model {job.model}",
            f"measured on {backend_for(program.num_ranks)} over {job.steps} timed step(s), "
            "means in ms: F, B, I, W, FB, FI = the",
            "wall time of each compute op (FB/FI: a fused F&B/F&I, under its forward's stage);",
            "[cost.stage.N]: N is the program's stage index (both pipes' stage N together);",
            "post = host time of a send or recv; wait = host time of a wait after its release;",
            "comm = the latency under which the rendezvous rule reproduces the run's waits;",
            "sync = the duplicated-stage gradient sum, per step; bytes = median message size",
        )
    )
    return render_cost_file(records, header)
