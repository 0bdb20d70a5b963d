"""The device mesh in the runtime: the pipeline's group from the mesh, and the data-parallel
reductions the program places.

`RuntimeConfig(mesh=DeviceMesh, pp_dim="pp")` (docs/parallelism.md): the pipeline's process
group is the mesh's group along `pp_dim` through this rank, and pipeline rank r is the global
rank at coordinate r along it (`pipeline_of`). The other dimensions are the user's, named as
torchtitan names them.

A collective with `dims` (`all_reduce dp-grad s3 over pipeline rank r × dp_replicate`,
passes/insert_dp_reduction.py) is run by `DataParallel`: over the mesh's group along those
dimensions through this rank, each gradient of the stages it carries is divided by the
group's size and all_reduced in place (SUM), so every replica ends with the mean over all
replicas' microbatches, the gradient of the global batch. An EP rank is such a replica for
the dense parameters (`ep` among the dimensions). What a reduction carries is what the
compiler's `what` says: a MoE stage's `dp-grad dense sN` (over dp_replicate × ep) its dense
parameters, its `dp-grad experts sN` (over dp_replicate) its experts, a plain `dp-grad sN`
every parameter. An expert parameter (`experts`: each EP rank holds its own) got the
gradient of every EP rank's tokens, each scaled by its pipeline's 1/M: the `dense`
reduction (over `ep`) divides it by the EP size and moves nothing; the `experts` one
reduces it as a dense one (FSDP2's reduce_scatter over dp_shard, the program's
REDUCE_GRAD, comes before both). An async one is posted and completed
by the program's `wait` that lists it, like a send. A parameter held by two stages of this rank
(a tied embedding on a V shape's rank 0) is reduced once, by the last of their reductions in
the program (an earlier one would miss the later backwards' gradients); a parameter without a
gradient gets zeros first, so every replica reduces the same tensors in the same order.
The groups of this rank's reductions are made (a flattened mesh's too) and warmed at set-up,
given the runtime's device: one tiny all_reduce on each, the dimensions in sorted order (the
replicas along them run one program, so one order); NCCL never makes a communicator in a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Work
from torch.distributed.tensor import DTensor

from pipecc.ir.ops import Collective, CollectiveKind
from pipecc.ir.program import Program

from .shared import warm


def pipeline_of(mesh: Any, pp_dim: str) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
    """The pipeline's process group and rank map: the mesh's group along `pp_dim` through
    this rank, and the global rank at each coordinate along it."""
    names = tuple(mesh.mesh_dim_names or ())
    if pp_dim not in names:
        raise ValueError(f"the mesh has no dimension {pp_dim!r} (its dimensions: {names})")
    at = list(mesh.get_coordinate())
    at[names.index(pp_dim)] = slice(None)
    ranks = tuple(int(r) for r in mesh.mesh[tuple(at)].flatten().tolist())
    return mesh.get_group(pp_dim), ranks


class DataParallel:
    """Runs this rank's collectives over mesh dimensions (module docstring)."""

    def __init__(
        self,
        program: Program,
        rank: int,
        modules: Mapping[int, torch.nn.Module],
        mesh: Any,
        device: torch.device | None = None,
        experts: frozenset[int] = frozenset(),
    ) -> None:
        self.mesh = mesh
        self.experts = experts  # ids of expert parameters: not reduced over `ep`
        self.mine = [
            (i, op)
            for i, op in enumerate(program.ranks[rank])
            if type(op) is Collective and op.dims and op.kind is not CollectiveKind.ALL_TO_ALL
        ]
        self.params = _reduced_params(program, rank, modules, self.mine, experts)
        self.expert_params = _expert_params(program, rank, modules, self.mine, experts)
        self.groups: dict[tuple[str, ...], tuple[dist.ProcessGroup, int]] = {}
        if mesh is not None and device is not None and not self.problems():
            for dims in sorted({op.dims for _, op in self.mine}):  # one order on every replica
                warm(self._group(dims)[0], device)

    def problems(self) -> list[str]:
        """What this runtime cannot run: reductions without a mesh, over dimensions the mesh
        lacks, of another kind than all_reduce."""
        found = []
        names = tuple(self.mesh.mesh_dim_names or ()) if self.mesh is not None else ()
        for index, op in self.mine:
            where = f"instruction {index} ({op.kind.value} {op.what} over {', '.join(op.dims)})"
            if self.mesh is None:
                found.append(f"{where}: the program is for a mesh, and no mesh was given "
                             "(RuntimeConfig(mesh=...))")  # fmt: skip
            elif any(d not in names for d in op.dims):
                found.append(f"{where}: the mesh has dimensions {', '.join(names)}")
            elif op.kind is not CollectiveKind.ALL_REDUCE:
                found.append(f"{where}: this runtime reduces gradients with all_reduce only")
        return found

    def post(self, index: int, op: Collective) -> list[Work]:
        """Post the reduction of instruction `index` (the interpreter completes the works:
        at once for a blocking one, at its `wait` for an async one)."""
        group, size = self._group(op.dims)
        works = []
        for param in self.params.get(index, ()):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad.div_(size)
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad  # a tp shard
            works.append(dist.all_reduce(local, group=group, async_op=True))
        for param in self.expert_params.get(index, ()):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if _part(op) == "dense":  # each expert lives on one EP rank: scaled, not reduced
                param.grad.div_(self._group(("ep",))[1])
            else:  # `dp-grad experts sN`: over the dimensions but ep, as a dense one
                param.grad.div_(size)
                grad = param.grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad  # FSDP's shard
                works.append(dist.all_reduce(local, group=group, async_op=True))
        return works

    def _group(self, dims: tuple[str, ...]) -> tuple[dist.ProcessGroup, int]:
        if dims not in self.groups:
            sub = self.mesh[dims[0]] if len(dims) == 1 else self.mesh[dims]._flatten()
            self.groups[dims] = (sub.get_group(), sub.size())
        return self.groups[dims]


def _part(op: Collective) -> str:
    """What a reduction carries of its stages, by the `what` the compiler gave it
    (passes/insert_dp_reduction.py): "dense" (`dp-grad dense sN`: the dense parameters,
    the experts only scaled), "experts" (`dp-grad experts sN`: the experts alone), else
    "all" (`dp-grad sN`: every parameter, as a replica's)."""
    words = op.what.split()
    return words[1] if len(words) > 2 and words[1] in ("dense", "experts") else "all"


def _reduced_params(
    program: Program,
    rank: int,
    modules: Mapping[int, torch.nn.Module],
    mine: Sequence[tuple[int, Collective]],
    experts: frozenset[int] = frozenset(),
) -> dict[int, list[torch.nn.Parameter]]:
    """The parameters each reduction reduces as a replica's: those of its stages' modules
    on this rank, the experts of a `dense` one apart, none for an `experts` one; each object
    with the last reduction that names a stage holding it (a tied parameter once)."""

    def carries(op: Collective, param: torch.nn.Parameter) -> bool:
        return _part(op) == "all" or (_part(op) == "dense" and id(param) not in experts)

    return _last(program, rank, modules, mine, carries)


def _expert_params(
    program: Program,
    rank: int,
    modules: Mapping[int, torch.nn.Module],
    mine: Sequence[tuple[int, Collective]],
    experts: frozenset[int],
) -> dict[int, list[torch.nn.Parameter]]:
    """The expert parameters of each `dense` and `experts` reduction's stages, each with the
    last of either part (a `dense` one over `ep` scales them by 1/ep; an `experts` one over
    the other dimensions reduces them: the program's `dp-grad dense sN` and `dp-grad
    experts sN`); a plain `dp-grad sN` reduces a stage's experts with its other parameters
    (experts the program does not run in phases are whole on every EP rank)."""
    found: dict[int, list[torch.nn.Parameter]] = {}
    for part in ("dense", "experts"):

        def carries(op: Collective, param: torch.nn.Parameter, part: str = part) -> bool:
            return _part(op) == part and id(param) in experts

        for index, params in _last(program, rank, modules, mine, carries).items():
            found.setdefault(index, []).extend(params)
    return found


def _last(
    program: Program,
    rank: int,
    modules: Mapping[int, torch.nn.Module],
    mine: Sequence[tuple[int, Collective]],
    carries: Callable[[Collective, torch.nn.Parameter], bool],
) -> dict[int, list[torch.nn.Parameter]]:
    """Each parameter of the reductions' stages that `carries(op, param)` says a reduction
    carries, with the last such reduction (by instruction index)."""
    chunk_of = {slot.stage: slot.chunk for slot in program.placement.chunks(rank)}
    last: dict[int, tuple[int, torch.nn.Parameter]] = {}
    for index, op in mine:
        for stage in op.stages:
            module = modules.get(chunk_of.get(stage, -1))
            for param in module.parameters() if module is not None else ():
                if carries(op, param):
                    last[id(param)] = (index, param)
    found: dict[int, list[torch.nn.Parameter]] = {}
    for index, param in last.values():
        found.setdefault(index, []).append(param)
    return found


DATA_DIMS = ("dp_replicate", "dp_shard", "ep")


def replica_index(mesh: Any, pp_dim: str) -> int:
    """This process's data-parallel index on the mesh: its coordinates along `DATA_DIMS`,
    row-major (0 without a mesh or without those dimensions; tp and cp ranks share theirs)."""
    if mesh is None:
        return 0
    index = 0
    for dim in DATA_DIMS:
        if dim in (mesh.mesh_dim_names or ()) and dim != pp_dim:
            index = index * mesh[dim].size() + mesh.get_local_rank(dim)
    return index


def replicas_mean(loss: torch.Tensor, mesh: Any, pp_dim: str) -> torch.Tensor:
    """`loss` (a pipeline's mean) averaged over every pipeline of the mesh: the mean over the
    global batch, each pipeline's microbatches being as many (a collective over the mesh's
    dimensions other than `pp_dim`; the loss itself when there are none)."""
    if mesh is None:
        return loss
    others = tuple(d for d in mesh.mesh_dim_names or () if d != pp_dim)
    if not others or mesh.size() == mesh[pp_dim].size():
        return loss
    sub = mesh[others[0]] if len(others) == 1 else mesh[others]._flatten()
    total = loss.detach().double().clone()
    dist.all_reduce(total, group=sub.get_group())
    mean: torch.Tensor = (total / sub.size()).float()
    return mean
