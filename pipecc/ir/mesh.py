"""The device mesh a program runs on: pipelines times data, FSDP and tensor parallelism.

A mesh names its dimensions as torchtitan does, outermost first: `pp` (the pipeline),
`dp_replicate` (data-parallel replicas, DDP), `dp_shard` (FSDP's sharding), `ep` (expert
parallel: a data-parallel replica for the dense parameters, 1/ep of the experts), `cp` (context
parallel), `tp` (tensor parallel). Global ranks are numbered row-major in that order, as
`init_device_mesh(..., mesh_dim_names=DIMS)` numbers them: pipeline rank r of pipeline l (l
the row-major index over the dimensions after `pp`) is global rank r·R + l, R = world / pp.

A program is on a mesh in one of two forms (`Program.mesh`, docs/parallelism.md):

- a pipeline's program: `pp` instruction lists, the same program for every pipeline; a
  collective names pipeline ranks and, in `dims`, the mesh dimensions it spans;
- the whole mesh: one instruction list per global rank, peers and collective members global
  (`passes/expand_mesh.py` builds it from the first form: what verify and simulate replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from pipecc.diagnostics import InputError

DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")  # torchtitan's names, outermost first


@dataclass(frozen=True, slots=True)
class Mesh:
    """The size of each dimension of `DIMS` (1: not used)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1  # expert parallelism: each EP rank holds 1/ep of every MoE layer's experts
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            if self.size(name) < 1:
                raise InputError(f"mesh: {name} must be ≥ 1, got {self.size(name)}")

    def size(self, dim: str) -> int:
        """The size of dimension `dim` (one of `DIMS`)."""
        value: int = getattr(self, dim)
        return value

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.size(d) for d in DIMS)

    @property
    def world(self) -> int:
        """The number of processes: the product of the sizes."""
        return prod(self.sizes)

    @property
    def pipelines(self) -> int:
        """R: how many pipelines run side by side (world / pp)."""
        return self.world // self.pp

    def global_rank(self, pp_rank: int, pipeline: int) -> int:
        """The global rank of pipeline rank `pp_rank` in pipeline `pipeline`."""
        return pp_rank * self.pipelines + pipeline

    def coords(self, rank: int) -> tuple[int, ...]:
        """The coordinates of global `rank`, one per dimension of `DIMS`."""
        found = []
        for size in reversed(self.sizes):
            found.append(rank % size)
            rank //= size
        return tuple(reversed(found))

    def rank_of(self, coords: tuple[int, ...]) -> int:
        """The global rank at `coords` (one per dimension of `DIMS`)."""
        rank = 0
        for c, size in zip(coords, self.sizes, strict=True):
            rank = rank * size + c
        return rank

    def group(self, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        """The global ranks that differ from `rank` only along `dims` (sorted)."""
        found = [self.coords(rank)]
        for dim in dims:
            at = DIMS.index(dim)
            found = [c[:at] + (v,) + c[at + 1 :] for c in found for v in range(self.size(dim))]
        return tuple(sorted({self.rank_of(c) for c in found}))

    def describe(self) -> str:
        """`pp=2,dp_shard=2`: pp and every dimension larger than 1, in mesh order."""
        return ",".join(f"{d}={self.size(d)}" for d in DIMS if d == "pp" or self.size(d) > 1)

    def to_dict(self) -> dict[str, int]:
        """The JSON form: pp and every dimension larger than 1."""
        return {d: self.size(d) for d in DIMS if d == "pp" or self.size(d) > 1}


def parse_mesh(text: str, *, pp: int | None = None) -> Mesh:
    """`dp_shard=2,tp=2` (or with `pp=2`): a mesh; a missing `pp` is `pp` (the program's P).
    InputError for an unknown dimension, a repeated one, or a size that is not a positive
    integer."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in DIMS:
            raise InputError(
                f"--mesh {text}: expected DIM=SIZE with DIM one of {', '.join(DIMS)}, got {item!r}"
            )
        if name in sizes:
            raise InputError(f"--mesh {text}: {name} is given twice")
        if not value.strip().isdigit() or int(value) < 1:
            raise InputError(f"--mesh {text}: {name} must be a positive integer, got {value!r}")
        sizes[name] = int(value)
    if pp is not None:
        if sizes.setdefault("pp", pp) != pp:
            raise InputError(f"--mesh {text}: pp={sizes['pp']} but the program has P={pp} ranks")
    return Mesh(**sizes)


def dims_valid(dims: tuple[str, ...]) -> bool:
    """Every name is a dimension of `DIMS`, none twice, and not `pp` (a pipeline's program
    names the pipeline ranks of a collective itself)."""
    return len(set(dims)) == len(dims) and all(d in DIMS and d != "pp" for d in dims)
