"""`pipecc run --mesh`: where a process sits on the device mesh, and its share of the batch.

Process g of the world builds the mesh (`init_device_mesh` with torchtitan's dimension names,
pp outermost, as pipecc numbers global ranks: ir/mesh.py), runs pipeline rank `pp_rank` of
the program in the pipeline of its coordinates, and takes its replica's contiguous share of
the global batch: the replicas are the pipelines that see different data (dp_replicate,
dp_shard and ep: an EP rank is a data-parallel replica for the dense parameters), so
replica d of D gets rows d·N/D .. (d+1)·N/D − 1; the ranks of a tp group take the same
rows. With tp > 1 the model file's `parallelize` shards each stage module; with
dp_shard > 1 `fully_shard` wraps each stage this process holds (a MoE stage's experts kept
to this EP rank's first).
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pipecc.diagnostics import InputError
from pipecc.ir.mesh import DIMS, Mesh
from pipecc.ir.ops import Phase
from pipecc.ir.program import Program

from ..comm.mesh import pipeline_of
from ..engine.moe_block import keep_experts


class Place(NamedTuple):
    """One process on the mesh (none: the pipeline is the world)."""

    mesh: Any  # the torch DeviceMesh, or None
    pp_rank: int
    replica: int
    replicas: int
    group: Any = None  # the pipeline's process group
    rank_map: tuple[int, ...] | None = None

    def share(self, batch: tuple[Any, ...]) -> tuple[Any, ...]:
        """This replica's contiguous share of a global batch (inputs, targets and, when the
        model file gives one, the context: every part is split alike along dim 0)."""
        if self.replicas == 1:
            return batch
        return tuple(_rows(part, self.replica, self.replicas) for part in batch)


def place(mesh: Mesh | None, rank: int, device: torch.device) -> Place:
    """Where global `rank` sits (module docstring)."""
    if mesh is None:
        return Place(None, rank, 0, 1)
    names = tuple(d for d in DIMS if mesh.size(d) > 1 or d == "pp")
    torch_mesh = init_device_mesh(
        device.type, tuple(mesh.size(d) for d in names), mesh_dim_names=names
    )
    coords = dict(zip(DIMS, mesh.coords(rank), strict=True))
    replicas = mesh.dp_replicate * mesh.dp_shard * mesh.ep  # an EP rank is a replica
    replica = (coords["dp_replicate"] * mesh.dp_shard + coords["dp_shard"]) * mesh.ep + coords["ep"]
    group, rank_map = pipeline_of(torch_mesh, "pp")
    return Place(torch_mesh, coords["pp"], replica, replicas, group, rank_map)


def parallelize(model: Any, built: dict[int, torch.nn.Module], where: Place) -> None:
    """With tp > 1, the model file's `parallelize(module, stage, tp_mesh)` on every stage
    built (before shared parameters are found: it replaces the parameters it shards)."""
    mesh = where.mesh
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return
    if model.parallelize is None:
        raise InputError(
            f"{model.path}: --mesh tp=N needs the model file's parallelize(module, stage, "
            "tp_mesh) (docs/parallelism.md)"
        )
    for stage, module in built.items():
        model.parallelize(module, stage, mesh["tp"])


def shard(
    built: dict[int, torch.nn.Module], held: set[int], where: Place, program: Program
) -> None:
    """With dp_shard > 1, FSDP2's `fully_shard` on every stage this process holds, over the
    mesh's dp_shard dimension, with gradient sync off: the program's REDUCE_GRAD reduces
    once, after the stage's last backward, and its UNSHARD and RESHARD place the gathers
    (torchtitan applies TP first, then FSDP: `parallelize` runs before this). The stages
    the program runs in MoE phases keep this EP rank's experts first, so FSDP shards only
    those (the runtime would keep them too late: `keep_experts`)."""
    mesh = where.mesh
    if mesh is None or "dp_shard" not in (mesh.mesh_dim_names or ()):
        return
    phased = {x.op.stage for x in program.ranks[where.pp_rank] if type(x) is Phase}
    keep_experts([built[stage] for stage in sorted(held & phased)], mesh)
    for stage in sorted(held):
        module = built[stage]
        fully_shard(module, mesh=mesh["dp_shard"], reshard_after_forward=False)
        cast(Any, module).set_requires_gradient_sync(False)


def whole(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a whole tensor (a tensor-parallel parameter's gathered)."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _rows(value: Any, replica: int, replicas: int) -> Any:
    """Rows replica·N/D .. of every tensor of a batch (a tensor, or a tuple, list or dict of
    them, split along dimension 0)."""
    if isinstance(value, torch.Tensor):
        rows = value.shape[0] // replicas
        return value[replica * rows : (replica + 1) * rows]
    if isinstance(value, dict):
        return {k: _rows(v, replica, replicas) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_rows(v, replica, replicas) for v in value)
    return value
