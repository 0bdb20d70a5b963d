"""What `pipecc run` does: spawn P ranks, run steps, time them, check, profile.

The model file's contract is in runtime/tools/model_file.py. With `build_stage` each rank builds
only the stages of its chunks (stage s of either pipe is model stage s); with `build_stages`
every rank builds the whole model, keeps its own stages and declares shared the parameters
that are one object in two stages (tied weights). Either way the runtime finds the
boundaries of each new shape signature along the pipeline on the step's real data, each
stage run by a rank holding it (runtime/boundaries/discovery.py): every rank is given the
whole batch (its shapes give the step's signature; only the ranks holding a first or a last
stage split it). A model file's `boundaries(example_inputs)` is checked against them. Each
step: zero the gradients, make the batch with `seed` = step index (warm-up steps first),
barrier, `step`, barrier; the time between the barriers on rank 0 is the step time. Weights
stay fixed (no optimizer), so the check compares every step with the single-process
reference (runtime/tools/checking.py).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError
from pipecc.ir.mesh import Mesh
from pipecc.ir.placement import StageSlot
from pipecc.ir.program import Program

from ..comm.shared import shared_parameters, shared_stages
from ..config import RuntimeConfig
from ..engine.recompute import Spec, check_selections, parse_spec, recomputed, selections
from ..pipeline import PipelineRuntime
from ..profiling.layers import (
    LayerClock,
    calibrate,
    layer_names,
    profile_layers,
    render_layers,
    stage_of_layers,
)
from ..profiling.memory import byte_keys
from ..profiling.moe_costs import moe_profile
from ..profiling.recorder import (
    SPREAD_BOUND,
    Recorder,
    comm_costs,
    compute_costs,
    host_costs,
    render_cost_file,
    worst_spread,
)
from . import mesh_job
from .checking import check_run
from .environment import GlooPosting, gloo_posting
from .memory import memory_steps
from .model_file import AUTOCAST, ModelFile, check_targets, load_model, param_dtypes
from .moe_program import moe_layers_of, refuse_unsplit, stage_moe_layers
from .reference import Options, ParamKey, default_tolerance
from .spawn import spawn
from .ties import model_ties
from .training_run import aux_by_stage, reported_aux, stages_of
from .whole_reference import check_whole_run, dropout_off, held_grads

__all__ = [
    "AUTOCAST", "RunJob", "RunReport", "backend_for", "model_ties", "moe_layers_of",
    "parse_spec", "run_job",
]  # fmt: skip


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
    seed: int = 0
    derive_rng: bool = True
    autocast: torch.dtype | None = None  # overrides the model file's
    # --check against: "stages" (one after another), "whole" (build_model(), by name) or
    # "auto": "whole" where the model file defines build_model, else "stages"
    reference: str = "stages"
    mesh: Mesh | None = None  # --mesh: the world is the mesh, the program one pipeline's
    memory: bool = False  # measure each rank's peak bytes over one step (tools/memory.py)
    optimizer: str | None = None  # for the optimizer's bytes; overrides the model file's
    recompute: Spec = None  # --recompute (runtime/engine/recompute.py); overrides the model file's
    layers: tuple[tuple[str, ...], ...] | None = None  # --partition: each stage's layer names
    profile_layers: bool = False  # --profile-layers: time each layer (profiling/layers.py)
    # a cost file's text -> the program's makespan under it (ms): what calibrates the
    # profile's comm (profiling/recorder.py); the command's, which may import the simulator
    replay: Callable[[str], float] | None = None
    # the runtime's gloo posting fields; None: from PIPECC_POST_THREAD and
    # PIPECC_GLOO_DIRECTIONS in the environment of `run_job` (tools/environment.py)
    gloo: GlooPosting | None = None


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
    tolerance: float = 1e-5  # the default --check tolerance for the run's dtypes
    worst_params: list[dict[str, Any]] = field(default_factory=list)  # with --check
    cost_file: str | None = None
    # with --profile, two or more timed steps: the largest spread of a stage's compute time
    # per step (runtime/profiling/recorder.py), which stage ("stage 1"), the bound it is held to
    profile_spread: float | None = None
    profile_spread_at: str | None = None
    profile_spread_bound: float | None = None
    profile_moe: dict[int, dict[str, float]] | None = None  # MoE phases (moe_costs.py)
    # the last step's losses added inside the stages (add_loss), summed over the stages,
    # mean over the microbatches (`loss` is the main loss alone), and by stage
    aux_loss: float = 0.0
    aux_loss_by_stage: dict[int, float] = field(default_factory=dict)
    reference: str = "stages"  # what --check compared with
    reference_aux_loss: float | None = None  # with --check --reference whole
    check_failures: list[str] = field(default_factory=list)  # fail whatever the tolerance
    # with --profile or --memory: each stage's byte keys (docs/simulate.md), measured on one
    # byte-profiled step; with --memory each rank's measured peak; the batch's bytes
    memory_sizes: dict[int, dict[str, int]] | None = None
    measured_bytes: list[int] | None = None
    batch_bytes: int | None = None
    layer_profile: str | None = None  # --profile-layers: the TOML text


def with_reference(job: RunJob, model: ModelFile) -> RunJob:
    """--reference auto (`pipecc run`'s default): the whole model where the file defines
    build_model(), so that a split or a tie the stages get wrong fails --check."""
    if job.reference != "auto":
        return job
    return replace(job, reference="whole" if model.build_model is not None else "stages")


def backend_for(ranks: int) -> str:
    """NCCL when there is a GPU per rank, else gloo on CPU."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"


def run_job(job: RunJob) -> RunReport:
    """Run the job on `program.num_ranks` local processes and report."""
    replicas = _replicas(job)
    if job.batch_size % (job.program.num_microbatches * replicas):
        shares = f"{replicas} replicas' shares of " if replicas > 1 else ""
        raise InputError(
            f"--batch-size {job.batch_size} cannot be split into {shares}"
            f"{job.program.num_microbatches} equal microbatches"
        )
    if job.gloo is None:
        job = replace(job, gloo=gloo_posting(os.environ))
    job = _profiled_cut(job, load_model(job.model))
    model = load_model(job.model).with_cut(job.layers)
    job = with_reference(job, model)
    if job.mesh is not None and job.mesh.ep > 1:  # MoE stages the program does not split
        layers = stage_moe_layers(model, job.program.placement.num_stages(0))
        refuse_unsplit(job.program, job.mesh, layers, job.model)
    model.check_cut(job.program.placement.num_stages(0))
    spec, stages = _recompute(job, model), job.program.placement.num_stages(0)
    _check_recompute(spec, model, stages)
    replayed = recomputed(spec, stages) | frozenset(selections(spec, stages))
    if job.profile_layers and replayed:  # its I would hold a replayed F: not the layers' I
        raise InputError(
            f"--profile-layers scales the layers to the stage times of the run, which "
            f"recomputes stage(s) {', '.join(map(str, sorted(replayed)))}: profile without "
            "recomputation (the search adds its cost per stage)"
        )
    check_targets(job.model, model, model.batch(job.batch_size, seed=0)[1])
    world = job.mesh.world if job.mesh is not None else job.program.num_ranks
    backend = backend_for(world)
    results = spawn(_worker, world, job, backend=backend, timeout=job.timeout)
    last = job.warmup + job.steps - 1
    losses = [loss for r in results for mb, loss in r["losses"][last].items()]
    pipelines = 1 if job.mesh is None else job.mesh.pipelines  # each reports its M losses
    checked = _check(job, model, results, backend) if job.check else None
    microbatches = job.program.num_microbatches * pipelines  # every pipeline reports its own
    aux = aux_by_stage([r["aux"][last] for r in results], microbatches)
    program = job.program
    worst = worst_spread(_records(results)) if job.profile else None
    cost_text = _cost_text(job, results) if job.profile else None
    return RunReport(
        schedule=program.schedule,
        ranks=program.num_ranks,
        microbatches=program.num_microbatches,
        batch_size=job.batch_size,
        loss=sum(losses) / (program.num_microbatches * pipelines),
        max_abs_grad_diff=None if checked is None else checked.max_abs,
        max_rel_grad_diff=None if checked is None else checked.max_rel,
        reference_loss=None if checked is None else checked.reference_loss,
        step_ms=statistics.median(results[0]["step_ms"]),
        steps=job.steps,
        warmup=job.warmup,
        backend=backend,
        comm=program.comm,
        tolerance=default_tolerance(
            [*(d for r in results for d in r["dtypes"]), _autocast(job, model) or torch.float32]
        ),
        worst_params=[] if checked is None else [d._asdict() for d in checked.worst],
        cost_file=cost_text,
        profile_spread=None if worst is None else worst.spread,
        profile_spread_at=None if worst is None else worst.where(),
        profile_spread_bound=SPREAD_BOUND if job.profile else None,
        profile_moe=moe_profile(_records(results)) if job.profile else None,
        aux_loss=sum(aux.values()),
        aux_loss_by_stage=aux,
        reference=job.reference,
        reference_aux_loss=None if checked is None else checked.reference_added,
        check_failures=[] if checked is None else list(checked.failures),
        **_memory_fields(results),
        layer_profile=_layer_profile(job, model, results, cost_text)
        if job.profile_layers and cost_text is not None
        else None,
    )


def _layer_profile(
    job: RunJob, model: ModelFile, results: list[dict[str, Any]], cost_text: str
) -> str:
    """--profile-layers: each layer timed alone on one microbatch, then calibrated against
    the stages this run measured (profiling/layers.py), with the run's host times and the
    message latency of its cost file (`cost_text`, calibrated on the run's steps)."""
    whole = model.layers_model()
    names = [n for stage in job.layers for n in stage] if job.layers else layer_names(whole)
    rows = job.batch_size // job.program.num_microbatches
    entries = profile_layers(whole, names, model.batch(rows, seed=0), model.loss_fn)
    records = _records(results)
    held = {stage: params for r in results for stage, params in r["held"].items()}
    measured = compute_costs(records)[1]
    in_run = {name: ms for r in results for name, ms in r["layer_f"].items()}
    entries, fixed = calibrate(entries, stage_of_layers(names, held), measured, in_run)
    host = {**comm_costs(records), **host_costs(records), "F_fixed": fixed}
    host["comm"] = tomllib.loads(cost_text)["cost"].get("comm", 0.0)
    header = (
        f"pipecc run --profile-layers: {job.model}, {len(names)} layers, one microbatch of "
        f"{rows} rows; F timed inside this {job.program.schedule} run (P="
        f"{job.program.num_ranks}, M={job.program.num_microbatches}, {job.steps} timed steps), "
        "I and W timed alone and scaled to its stages; comm, post, wait, F_fixed: the run's"
    )
    return render_layers(entries, host, header)


def _profiled_cut(job: RunJob, model: ModelFile) -> RunJob:
    """--profile-layers without --partition runs the layers' uniform cut (equal counts, the
    earlier stages taking one more), so that each stage the run measures is made of the
    profiled layers (their times are scaled to it)."""
    if not job.profile_layers or job.layers is not None:
        return job
    names = layer_names(model.meta_layers_model())
    stages = job.program.placement.num_stages(0)
    if len(names) < stages:
        raise InputError(
            f"{job.model}: --profile-layers: build_layers_model() has {len(names)} layers, "
            f"fewer than the program's {stages} stages"
        )
    base, extra = divmod(len(names), stages)
    ends = list(itertools.accumulate(base + (s < extra) for s in range(stages)))
    cut = tuple(tuple(names[end - base - (s < extra) : end]) for s, end in enumerate(ends))
    return replace(job, layers=cut)


def _replicas(job: RunJob) -> int:
    """How many pipelines see different data (1 without a mesh)."""
    return 1 if job.mesh is None else job.mesh.dp_replicate * job.mesh.dp_shard * job.mesh.ep


def _recompute(job: RunJob, model: ModelFile) -> Spec:
    """--recompute, else the model file's `recompute`."""
    return job.recompute if job.recompute is not None else model.recompute


def _check_recompute(spec: Spec, model: ModelFile, stages: int) -> None:
    """A bad recompute spec is an InputError before any process starts: a mode or stage
    (`recomputed`), or a module selector that matches no submodule (of its stage, or of
    any stage for a mode of every stage), found on the stages built on the meta device
    (on the CPU where the model file cannot build there)."""
    recomputed(spec, stages)
    if not selections(spec, stages):
        return
    try:
        with torch.device("meta"):
            built = model.stages(range(stages), stages)
    except Exception:  # noqa: BLE001 - a model that needs real tensors to build: build it
        built = model.stages(range(stages), stages)
    check_selections(spec, stages, built, whole=True)


def _autocast(job: RunJob, model: ModelFile) -> torch.dtype | None:
    """--autocast, else the model file's `autocast`."""
    return job.autocast or model.autocast


def _worker(rank: int, world: int, job: RunJob) -> dict[str, Any]:
    model = load_model(job.model).with_cut(job.layers)
    program = job.program
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    num_stages = program.placement.num_stages(0)
    where = mesh_job.place(job.mesh, rank, device)  # the pipeline rank, the batch share
    slots = program.placement.chunks(where.pp_rank)
    whole = not model.own_stages  # build_stages: every rank builds every stage
    built = model.stages(range(num_stages) if whole else (s.stage for s in slots), num_stages)
    built = {stage: module.to(device) for stage, module in built.items()}
    mesh_job.parallelize(model, built, where)  # --mesh tp=N: the model file's parallelize
    # tied weights are found by identity, before FSDP2 gives each held stage its own copy;
    # the model file's shared(num_stages) declares those build_stage builds apart
    shared = shared_parameters(list(built.values())) if whole else ()
    shared = (*shared, *model.declared_shared(num_stages))
    if job.check and job.reference == "whole":  # the whole model cannot draw the stages' masks
        dropout_off(built.values())
    mesh_job.shard(built, {s.stage for s in slots}, where, program)  # dp_shard=N: FSDP2
    modules = {slot.chunk: built[slot.stage] for slot in slots}
    autocast = _autocast(job, model)
    gloo = job.gloo or GlooPosting()
    config = RuntimeConfig(
        timeout=job.timeout, device=device, shared=shared, seed=job.seed, sums_in_program=True,
        derive_rng=job.derive_rng, autocast=autocast, group=where.group,
        rank_map=where.rank_map, mesh=where.mesh, recompute=_recompute(job, model),
        gloo_poster_thread=gloo.poster_thread, gloo_direction_groups=gloo.direction_groups,
    )  # fmt: skip
    # the boundaries of each new shape signature are found along the pipeline on the
    # step's real data (every rank is given the batch); a file's boundaries() is checked
    boundaries = model.boundaries
    runtime = PipelineRuntime(program, modules, boundaries, loss_fn=model.loss_fn, config=config)
    out: dict[str, Any] = {"step_ms": [], "losses": [], "grads": [], "records": [], "aux": []}
    out["dtypes"] = param_dtypes(modules.values())
    out["shared_stages"] = shared_stages(shared)
    out["held"] = {  # --profile-layers: which stage held which parameter names
        slot.stage: [name for name, _ in modules[slot.chunk].named_parameters()] for slot in slots
    }
    clock = _layer_clock(job, modules, slots)
    for step in range(job.warmup + job.steps):
        timed = step >= job.warmup
        clock.step = step if timed and job.profile_layers else None
        recorder = Recorder(step=step) if job.profile and timed else None
        elapsed = _timed_step(
            runtime, modules, where.share(model.batch(job.batch_size, seed=step)), recorder
        )
        if timed:
            out["step_ms"].append(elapsed * 1e3)
        out["losses"].append({mb: float(v) for mb, v in runtime.losses.items()})
        out["aux"].append(reported_aux(runtime))
        if job.check and job.reference == "whole":
            out["grads"].append(
                held_grads(stages_of(program, where.pp_rank, modules), where.pp_rank)
            )
        elif job.check:
            out["grads"].append(_my_grads(program, where.pp_rank, modules))
        if recorder is not None:
            out["records"].append(recorder)
    clock.step = None
    out["layer_f"] = clock.means()
    if job.profile or job.memory:  # two more steps, untimed and unchecked
        after = job.warmup + job.steps
        batches = (where.share(model.batch(job.batch_size, seed=after)),
                   where.share(model.batch(job.batch_size, seed=after + 1)))  # fmt: skip
        optimizer = job.optimizer or model.optimizer or "adamw"
        out["memory"] = memory_steps(
            runtime, modules, batches, optimizer=optimizer, measure=job.memory
        )
    return out


def _layer_clock(
    job: RunJob, modules: dict[int, torch.nn.Module], slots: tuple[StageSlot, ...]
) -> LayerClock:
    """--profile-layers: a clock on every layer of this rank's stages (their names in the
    cut; `split_model` keeps the whole model's module names)."""
    clock = LayerClock()
    if job.profile_layers and job.layers is not None:
        for slot in slots:
            for name in job.layers[slot.stage]:
                clock.attach(modules[slot.chunk].get_submodule(name), name)
    return clock


def _memory_fields(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's byte fields from every rank's `memory_steps` (none without them)."""
    if "memory" not in results[0]:
        return {}
    found = [result["memory"] for result in results]
    measured = [m["measured"] for m in found]
    return {
        "memory_sizes": byte_keys([m["bytes"] for m in found]),
        "measured_bytes": None if None in measured else measured,
        "batch_bytes": found[0]["batch_bytes"],
    }


def _timed_step(
    runtime: PipelineRuntime,
    modules: dict[int, torch.nn.Module],
    batch: tuple[Any, ...],
    recorder: Recorder | None,
) -> float:
    for module in modules.values():
        module.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    runtime.step(
        batch[0], batch[1], context=batch[2] if len(batch) > 2 else None, recorder=recorder
    )
    dist.barrier()
    return time.perf_counter() - start


def _my_grads(
    program: Program, rank: int, modules: dict[int, torch.nn.Module]
) -> dict[ParamKey, torch.Tensor]:
    grads = {}
    for slot in program.placement.chunks(rank):
        for name, p in modules[slot.chunk].named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[(slot.stage, name)] = mesh_job.whole(grad).detach().cpu().clone()
    return grads


def _check(job: RunJob, model: ModelFile, results: list[dict[str, Any]], backend: str) -> Any:
    """The reference of every step against every rank's gradients (runtime/tools/checking.py)."""
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    options = Options(
        seed=job.seed, derive_rng=job.derive_rng, autocast=_autocast(job, model),
        device=device,
    )  # fmt: skip
    batches = [model.batch(job.batch_size, seed=step) for step in range(job.warmup + job.steps)]
    grads = [result["grads"] for result in results]
    if job.reference == "whole":
        return check_whole_run(model, batches, job.program.num_microbatches, options, grads)
    num_stages = job.program.placement.num_stages(0)
    microbatches = job.program.num_microbatches * _replicas(job)  # the whole batch
    return check_run(model, num_stages, batches, microbatches, options, grads)


def _records(results: list[dict[str, Any]]) -> list[Recorder]:
    return [record for result in results for record in result["records"]]


# the header's lines on `comm`: without a replay, and calibrated with one (recorder.py)
_COMM_LINES = {
    False: ("comm = the latency under which the rendezvous rule reproduces the run's waits;",),
    True: (
        "comm = the message latency under which this program's replay with these costs",
        "lasts as long as its timed steps did (the median span of its instructions);",
    ),
}


def _cost_text(job: RunJob, results: list[dict[str, Any]]) -> str:
    program = job.program
    header = "\n".join(
        (
            f"pipecc run --profile: {program.schedule}, P={program.num_ranks}, "
            f"M={program.num_microbatches}, batch {job.batch_size} rows, model {job.model}, "
            f"comm policy {program.comm}",
            f"measured on {backend_for(program.num_ranks)} over {job.steps} timed step(s), "
            "in ms: F, B, I, W, FB, FI = the",
            "wall time of each compute op (FB/FI: a fused F&B/F&I, under its forward's stage),",
            "the median over the timed steps of each step's mean;",
            "[cost] holds them per share of the model (1/P: the mean over the stages, its",
            "part above dispatch x S/P); dispatch = the median time of a forward outside its",
            "stage's module: host time per op that does not scale with a stage's share;",
            "placement, ranks, stages = the program measured on (P, S stages per pipe);",
            "[cost.stage.N]: N is the program's stage index (both pipes' stage N together);",
            "post = host time of a send or recv; wait = host time of a wait after its release;",
            *_COMM_LINES[job.replay is not None],
            "sync = the gradient sum of parameters held by several ranks (duplicated stages,",
            "shared weights), per step; shared = the groups of stages that hold one parameter;",
            "bytes = median message size (per stage: its largest receive buffer); byte keys",
            "(act_bytes, param_bytes, ...: docs/simulate.md) from one byte-profiled step;",
            "[profile]: the timed steps; spread = of each stage's compute time per step,",
            "(Q3 - Q1) / median, the worst stage's (per stage: spread, and X_spread of each",
            "op's per-step means)",
        )
    )
    shared = results[0]["shared_stages"]
    sizes = _memory_fields(results).get("memory_sizes")
    return render_cost_file(
        _records(results), header, measured_on=program, shared=shared, sizes=sizes,
        replay=job.replay,
    )  # fmt: skip
