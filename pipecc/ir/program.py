"""The compiled program: one instruction list per rank, plus what it was compiled for."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pipecc.ir.mesh import Mesh
from pipecc.ir.ops import Instr
from pipecc.ir.placement import Placement


class Backend(enum.Enum):
    """What a program needs of the backend that carries its messages (DESIGN §5)."""

    ANY = "any"  # runs to completion under every comm model
    # needs every posted op to progress on its own (gloo: the `rendezvous` model); under
    # NCCL's ordered streams it deadlocks by design (the early-recv policy, docs/compile.md)
    INDEPENDENT_PROGRESS = "independent-progress"


@dataclass(frozen=True, slots=True)
class Program:
    """A schedule compiled for P ranks and M microbatches (DESIGN §4).

    `ranks[r]` is rank r's instruction list in execution order. `comm` names the lowering
    policy that placed the communication ops ("none" for a compute-only program); `backend`
    is what that policy needs of the backend, which the verifier and the runtime read.
    `mesh`: the device mesh it runs on (`ir/mesh.py`), None for a pipeline on its own; with
    a mesh, `ranks` holds either the pipeline's `mesh.pp` lists (every pipeline runs them)
    or one list per global rank (`is_whole_mesh`). `recompute`: the stages (pipe 0's
    numbering, ascending) that recompute their forward in full in their backward (the
    runtime's recomputation; `pipecc search --layers` chooses them), none by default.
    `moe`: K per stage, the MoE layers its F, B and I are split at (`Phase`s and all-to-alls
    over `ep`, `passes/expand_moe.py`); None when the program has none.
    """

    schedule: str
    source: str
    num_ranks: int
    num_microbatches: int
    params: tuple[tuple[str, int], ...]
    comm: str
    placement: Placement
    ranks: tuple[tuple[Instr, ...], ...]
    backend: Backend = Backend.ANY
    mesh: Mesh | None = None
    recompute: tuple[int, ...] = ()  # the stages whose forward runs again in their backward
    # the MoE layers of each stage (pipe 0's numbering; `passes/expand_moe.py`), None: no MoE
    moe: tuple[int, ...] | None = None

    @property
    def is_whole_mesh(self) -> bool:
        """On a mesh of more than one pipeline, with one list per global rank."""
        mesh = self.mesh
        return mesh is not None and mesh.pipelines > 1 and self.num_ranks == mesh.world

    @property
    def pipeline_ranks(self) -> int:
        """P: the ranks of one pipeline (the mesh's pp, else every rank)."""
        return self.mesh.pp if self.mesh is not None else self.num_ranks

    def num_instructions(self) -> int:
        return sum(len(instrs) for instrs in self.ranks)
