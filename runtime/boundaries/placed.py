"""DTensor boundaries: a stage output that is a DTensor travels as its local shard.

A tensor-parallel stage may return a DTensor (a sequence-parallel plan ending sharded:
`RowwiseParallel(output_layouts=Shard(1), use_local_output=False)`, `SequenceParallel()`).
Its boundary leaf records, besides the local shape and dtype that travel, a `Placed`: the
names of the DTensor's mesh dimensions (its `tp` submesh), its placements and its global
shape and stride. Each rank of the tp group sends its own local data (`to_local()`) to the
rank of the same tp coordinate in the next stage, as a plain tensor would go; the receiver
rebuilds `DTensor.from_local(local, mesh[dims], placements, shape=..., stride=...)` over the
runtime's mesh (`RuntimeConfig(mesh=...)`) from the detached local leaf, so the next stage
takes a DTensor and the input gradient that comes out of its backward is the local part of
the DTensor's gradient (from_local's backward redistributes it to the input's placements
first: a Partial gradient of a replicated input is summed over the tp group there). On the
sender the output's `to_local()` stays in the graph, and its backward wraps the received
local gradient back into a DTensor with the output's placements, so the backward (B, I and
W, the graph walk, fused F&B) starts from the DTensor output as it would inside one module.

Only `Replicate()` and `Shard(d)` placements travel: a `Partial` output (an unreduced sum)
is refused with the stage's leaf named, as is a DTensor over a mesh without dimension
names.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from pipecc.diagnostics import InputError, SetupError

from ..compat import dtensor_local_shape


class Placed(NamedTuple):
    """How a DTensor leaf is laid out over its mesh: what the receiver rebuilds."""

    dims: tuple[str, ...]  # the names of the DTensor's mesh dimensions
    placements: tuple[str, ...]  # "R" or "S(d)", one per mesh dimension
    shape: tuple[int, ...]  # the global shape
    stride: tuple[int, ...]  # the global stride

    def describe(self) -> str:
        """As `DTensor(tp: S(1); global [2, 8, 16])`."""
        places = ", ".join(f"{d}: {p}" for d, p in zip(self.dims, self.placements, strict=True))
        return f"DTensor({places}; global [{', '.join(str(s) for s in self.shape)}])"

    def text(self) -> list[list[Any]]:
        return [list(self.dims), list(self.placements), list(self.shape), list(self.stride)]

    @classmethod
    def from_text(cls, fields: list[list[Any]]) -> Placed:
        dims, places, shape, stride = fields
        return cls(
            tuple(str(d) for d in dims),
            tuple(str(p) for p in places),
            tuple(int(s) for s in shape),
            tuple(int(s) for s in stride),
        )


def placed_of(tensor: torch.Tensor) -> Placed | None:
    """The layout of a DTensor leaf (None for a plain tensor); an InputError for a layout
    that cannot travel (module docstring)."""
    if not isinstance(tensor, DTensor):
        return None
    names = tensor.device_mesh.mesh_dim_names
    if names is None:
        raise InputError(
            "a DTensor at a stage boundary is over a mesh without dimension names: build "
            "the mesh with mesh_dim_names (init_device_mesh(..., mesh_dim_names=...))"
        )
    return Placed(
        tuple(names),
        tuple(_text(p) for p in tensor.placements),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def _text(placement: Placement) -> str:
    if isinstance(placement, Replicate):
        return "R"
    if type(placement) is Shard:
        return f"S({placement.dim})"
    raise InputError(
        f"a DTensor with placement {placement} at a stage boundary is not supported (only "
        "Replicate() and Shard(d) travel): redistribute it before the stage returns it"
    )


def _placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    return Shard(int(text.removeprefix("S(").removesuffix(")")))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What travels for a leaf: a DTensor's local data (differentiable: its backward wraps
    the local gradient into a DTensor with the same placements), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of what travels for a leaf."""
    if isinstance(tensor, DTensor):
        return dtensor_local_shape(tensor)
    return tuple(tensor.shape)


def mesh_problem(placed: Placed, mesh: Any) -> str | None:
    """Why a boundary leaf laid out as `placed` cannot be rebuilt over the runtime's `mesh`
    (None: it can)."""
    if mesh is None:
        return (
            f"is a {placed.describe()}: rebuilding it on the next stage needs the device "
            "mesh, RuntimeConfig(mesh=...)"
        )
    names = mesh.mesh_dim_names or ()
    missing = [d for d in placed.dims if d not in names]
    if missing:
        return (
            f"is a {placed.describe()}, but the runtime's mesh has no dimension "
            f"{', '.join(missing)} (it has {', '.join(names)})"
        )
    return None


def rebuilt(tensor: torch.Tensor, placed: Placed, mesh: Any) -> torch.Tensor:
    """The DTensor a receiver rebuilds from a received local `tensor` over the runtime's
    `mesh` (its submesh of `placed.dims`); differentiable back to `tensor`."""
    problem = mesh_problem(placed, mesh)
    if problem is not None:
        raise SetupError(f"a stage boundary {problem}")
    sub = mesh[placed.dims[0]] if len(placed.dims) == 1 else mesh[placed.dims]
    return DTensor.from_local(
        tensor,
        sub,
        tuple(_placement(p) for p in placed.placements),
        run_check=False,
        shape=torch.Size(placed.shape),
        stride=placed.stride,
    )
