"""Mesh cases run inside one spawned process group of 4 (gloo): a pipeline of 2 times 2
data-parallel replicas, `init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp",
"dp_replicate"))`, a pipeline of 2 times a tensor-parallel group of 2 (`("pp", "tp")`,
examples/gpt.py's `parallelize`: every block's MLP split over tp), and a pipeline of 2 times
2 FSDP2 shards (`("pp", "dp_shard")`, `fully_shard` on every held stage, gradient sync off but
at the program's REDUCE_GRAD), the GPT of examples/gpt.py with tied embeddings; and a
pipeline of 2 times an EP group of 2 (`("pp", "ep")`, moe_cases.py: examples/moe_ep.py; its
cases may name another mesh, `pp=1,dp_shard=2,ep=2`, made here once for all of them). FSDP
cases also count FSDP's all-gathers and reduce-scatters of every step (the step's only ones
must be the program's UNSHARDs and REDUCE_GRADs), and `walk` cases split the backward by the
graph walk instead of the weight-gradient contract (runtime/engine/split_backward.py).

Each case compiles a schedule with the tie's sum (and, with replicas, their reductions:
`--shared 0+S --mesh dp_replicate=2`), gives each replica its contiguous share of the global
batch (the ranks of a tp group take the same rows), and compares every gradient of this
rank's stages (a tensor-parallel one gathered whole) and the global loss with one process
training the whole batch; training cases take 3 AdamW steps with clipping on both sides.
Functions here run in the spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, NamedTuple, cast
from unittest import mock

import torch
import torch.distributed as dist
from discovery_cases import Counts, counting
from gpt_cases import ROWS, _gpt, _worst, build, config, loss_fn
from moe_cases import MoECase, run_moe_case
from pipecc.runtime import (
    PipelineRuntime,
    RuntimeConfig,
    infer_boundaries,
    load_checkpoint,
    save_checkpoint,
    shared_parameters,
)
from pipecc.runtime.tools.reference import Options, gradients, reference_step
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial

from pipecc.diagnostics import PipeccError
from pipecc.ir.ops import StageAction, StageOp
from pipecc.ir.program import Program

OPTIONS = Options(seed=3)
# Adam divides by sqrt(v) + eps: a gradient that is zero but for rounding (1e-9 here) gets a
# step of either sign; the replicas add their halves in another order than one process adds
# the whole batch, so such noise differs, and an eps far above it (real gradients are
# above 1e-3) keeps it from moving the weights (gpt_cases.py uses 1e-6 for one pipeline)
EPS = 1e-4


class MeshCase(NamedTuple):
    """One case: its name, the pipeline's program, the mesh's second dimension, training."""

    name: str
    program: Program
    dim: str  # "dp_replicate", "tp" or "dp_shard"
    train: bool = False
    walk: bool = False  # split backward by the graph walk, no weight-gradient contract
    tied: bool = False  # FSDP stages with the tied embedding (tied on every other mesh)
    sp: bool = False  # tp by examples/gpt.py's parallelize_sequence: DTensor boundaries
    no_mesh: bool = False  # the pipeline's group and rank map given, not the mesh
    recompute: bool = False  # every stage recomputed in full before its backward
    partial: bool = False  # stage 0 returns its output as a Partial DTensor (refused)
    folder: str = ""  # a checkpoint saved after step 0 there, loaded by a new job (_resume)


def run_mesh_cases(rank: int, world: int, cases: list[MeshCase | MoECase]) -> dict[str, Any]:
    """Every case on this rank (global rank `rank` of 4); per case what the tests assert."""
    meshes = {
        dim: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", dim))
        for dim in ("dp_replicate", "tp", "dp_shard", "ep")
    }
    layouts = {f"pp={world // 2},{dim}=2": mesh for dim, mesh in meshes.items()}
    for case in cases:  # the MoE cases' other meshes, made in one order on every rank
        if isinstance(case, MoECase) and case.mesh not in layouts:
            layouts[case.mesh] = _device_mesh(case.mesh)
    results: dict[str, Any] = {}
    for case in cases:
        if isinstance(case, MoECase):  # expert parallelism (moe_cases.py)
            results[case.name] = run_moe_case(layouts[case.mesh], case)
            continue
        try:
            run = _resume if case.folder else _train if case.train else _check
            results[case.name] = run(meshes[case.dim], case)
        except PipeccError as err:
            results[case.name] = {"error": type(err).__name__, "message": str(err)}
    return results


def _device_mesh(text: str) -> Any:
    """The CPU device mesh "pp=1,dp_shard=2,ep=2" names, its dimensions in that order."""
    sizes = dict(part.split("=") for part in text.split(","))
    return init_device_mesh(
        "cpu", tuple(int(v) for v in sizes.values()), mesh_dim_names=tuple(sizes)
    )


def _replicas(case: MeshCase) -> int:
    return 1 if case.dim == "tp" else 2


def _variant(case: MeshCase) -> str:
    return "plain" if case.dim == "dp_shard" and not case.tied else "tied"


def _share(case: MeshCase, mesh: Any, batch: tuple[Any, Any]) -> tuple[Any, Any]:
    """This replica's contiguous share of the global batch (all of it in a tp group)."""
    if case.dim == "tp":
        return batch
    rows, at = batch[0].shape[0] // 2, mesh.get_coordinate()[1]
    return batch[0][at * rows : (at + 1) * rows], batch[1][at * rows : (at + 1) * rows]


def _global_batch(case: MeshCase, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = ROWS * case.program.num_microbatches * _replicas(case)
    batch: tuple[torch.Tensor, torch.Tensor] = _gpt().make_batch(
        rows, seed=step, config=config(_variant(case))
    )
    return batch


def _stages(case: MeshCase, mesh: Any) -> tuple[list[nn.Module], Any]:
    """The stages, parallelized or sharded as the case says, and the shared parameters
    (found by identity before FSDP replaces the held stages' parameters)."""
    stages = build(_variant(case), case.program.placement.num_stages(0))
    if case.dim == "tp":
        plan = _gpt().parallelize_sequence if case.sp else _gpt().parallelize
        for stage, module in enumerate(stages):
            plan(module, stage, mesh["tp"])
        if case.partial:
            stages[0].register_forward_hook(_as_partial)
    shared = shared_parameters(stages)
    if case.dim == "dp_shard":
        held = {s.stage for s in case.program.placement.chunks(mesh.get_coordinate()[0])}
        for stage in sorted(held):
            fully_shard(stages[stage], mesh=mesh["dp_shard"], reshard_after_forward=False)
            cast(Any, stages[stage]).set_requires_gradient_sync(False)
    return stages, shared


def _as_partial(module: nn.Module, args: Any, output: Any) -> Any:
    """A stage output as an unreduced sum: each rank's half of the whole value."""
    del module, args
    whole = output.full_tensor() / 2
    return DTensor.from_local(whole, output.device_mesh, [Partial()], run_check=False)


def _runtime(mesh: Any, case: MeshCase, stages: list[nn.Module], shared: Any) -> PipelineRuntime:
    cfg = RuntimeConfig(
        shared=shared, seed=OPTIONS.seed, mesh=mesh, recompute="full" if case.recompute else None
    )
    if case.no_mesh:  # the same pipeline, without the mesh DTensor boundaries need
        group = mesh.get_group("pp")
        ranks = tuple(dist.get_process_group_ranks(group))
        cfg = RuntimeConfig(shared=shared, seed=OPTIONS.seed, group=group, rank_map=ranks)
    chunks = case.program.placement.chunks(mesh.get_coordinate()[0])
    modules = {s.chunk: stages[s.stage] for s in chunks}
    # the split-backward method is chosen when the runtime binds its chunks
    walk = mock.patch("pipecc.runtime.engine.bound.contracted", return_value=False)
    with walk if case.walk else nullcontext():
        return PipelineRuntime(
            case.program, modules, lambda sample: infer_boundaries(stages, sample),
            loss_fn=loss_fn, config=cfg,
        )  # fmt: skip


FSDP_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")  # what FSDP2 calls


def _step(runtime: PipelineRuntime, batch: tuple[Any, Any], found: list[list[int]]) -> None:
    """One step, its FSDP collectives appended to `found` (all-gathers, reduce-scatters)."""
    counts = Counts()
    with counting(counts, ((dist, FSDP_COLLECTIVES),)):
        runtime.step(*batch)
    found.append([counts.calls.get(name, 0) for name in FSDP_COLLECTIVES])


def _actions(case: MeshCase, rank: int) -> list[int]:
    """The UNSHARDs and REDUCE_GRADs of the program on pipeline rank `rank`."""
    ops = [op for op in case.program.ranks[rank] if isinstance(op, StageOp)]
    return [sum(op.kind is kind for op in ops)
            for kind in (StageAction.UNSHARD, StageAction.REDUCE_GRAD)]  # fmt: skip


def _whole(tensors: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tensors.items()}


def _check(mesh: Any, case: MeshCase) -> dict[str, Any]:
    stages, shared = _stages(case, mesh)
    reference = build(_variant(case), case.program.placement.num_stages(0))
    runtime = _runtime(mesh, case, stages, shared)
    held = {slot.stage for slot in case.program.placement.chunks(runtime.rank)}
    data = _global_batch(case, 0)
    collectives: list[list[int]] = []
    _step(runtime, _share(case, mesh, data), collectives)
    microbatches = case.program.num_microbatches * _replicas(case)
    want_loss, want = reference_step(reference, data, microbatches, loss_fn, OPTIONS)
    loss = float(runtime.global_loss())
    found = {
        "grad_rel": _worst(_whole(gradients(stages)), want, held), "loss": (loss, want_loss),
        "collectives": collectives, "actions": _actions(case, runtime.rank),
        "boundaries": _placed(runtime),
    }  # fmt: skip
    if case.sp:  # forward only (evaluation) over the same DTensor boundaries
        runtime.forward(*_share(case, mesh, data))
        found["eval_loss"] = (float(runtime.global_loss()), want_loss)
    return found


def _placed(runtime: PipelineRuntime) -> list[str]:
    """The DTensor layouts of the boundaries this runtime's signature crosses."""
    found = runtime.boundaries
    return [spec.describe() for b in found.values() for spec in b.tensors if spec.placed]


def _train(mesh: Any, case: MeshCase) -> dict[str, Any]:
    stages, shared = _stages(case, mesh)
    single = build(_variant(case), case.program.placement.num_stages(0))
    runtime = _runtime(mesh, case, stages, shared)
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=1e-2, eps=EPS)
    params = list({id(p): p for s in single for p in s.parameters()}.values())
    reference_optimizer = torch.optim.AdamW(params, lr=1e-2, eps=EPS)
    microbatches = case.program.num_microbatches * _replicas(case)
    losses, norms = [], []
    collectives: list[list[int]] = []
    for step in range(3):
        data = _global_batch(case, step)
        optimizer.zero_grad(set_to_none=True)
        _step(runtime, _share(case, mesh, data), collectives)
        norm = runtime.clip_grad_norm_(0.5)
        optimizer.step()
        want_loss, _ = reference_step(single, data, microbatches, loss_fn,
                                      OPTIONS._replace(step=step))  # fmt: skip
        want_norm = nn.utils.clip_grad_norm_(params, 0.5)
        reference_optimizer.step()
        losses.append((float(runtime.global_loss()), want_loss))
        norms.append((float(norm), float(want_norm)))
    held = {slot.stage for slot in case.program.placement.chunks(runtime.rank)}
    got = _whole(
        {(i, n): p.detach() for i, s in enumerate(stages) for n, p in s.named_parameters()}
    )
    want = {(i, n): p.detach() for i, s in enumerate(single) for n, p in s.named_parameters()}
    return {
        "weight_rel": _worst(got, want, held), "losses": losses, "norms": norms,
        "collectives": collectives, "actions": _actions(case, runtime.rank),
    }  # fmt: skip


def _resume(mesh: Any, case: MeshCase) -> dict[str, Any]:
    """3 AdamW steps with a checkpoint saved after step 0; new stages (sharded or
    parallelized again), runtime and AdamW load it and take steps 1 and 2."""
    first, first_optimizer = _job(mesh, case)
    losses = []
    for step in range(3):
        losses.append(_adamw_step(mesh, case, first, first_optimizer, step))
        if step == 0:
            save_checkpoint(case.folder, first, first_optimizer)
    second, second_optimizer = _job(mesh, case)
    load_checkpoint(case.folder, second, second_optimizer)
    resumed = [_adamw_step(mesh, case, second, second_optimizer, step) for step in (1, 2)]
    sharded = [isinstance(p, DTensor) for p in second.parameters()]
    return {"losses": losses[1:], "resumed": resumed, "sharded": any(sharded)}


def _job(mesh: Any, case: MeshCase) -> tuple[PipelineRuntime, torch.optim.Optimizer]:
    stages, shared = _stages(case, mesh)
    runtime = _runtime(mesh, case, stages, shared)
    return runtime, torch.optim.AdamW(runtime.parameters(), lr=1e-2, eps=EPS)


def _adamw_step(
    mesh: Any, case: MeshCase, runtime: PipelineRuntime, optimizer: Any, step: int
) -> float:
    optimizer.zero_grad(set_to_none=True)
    runtime.step(*_share(case, mesh, _global_batch(case, step)))
    runtime.clip_grad_norm_(0.5)
    optimizer.step()
    return float(runtime.global_loss())
