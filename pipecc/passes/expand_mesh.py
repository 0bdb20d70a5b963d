"""A pipeline's program on a mesh, written out for the whole mesh: one list per global rank.

Every pipeline of the mesh runs the pipeline's program (`ir/mesh.py`): pipeline l's rank r is
global rank r·R + l. Written out, each pipeline gets its own pipes and microbatch numbers so
that every message and computation of the mesh has its own name, and the verifier's and the
simulator's one replay checks all of them together:

- pipe p of pipeline l is pipe l·N + p (N: the program's pipes), and its microbatch m is
  l·M + m: for data-parallel pipelines that is the microbatch's number in the global batch
  (each replica takes its contiguous share), for tensor- or context-parallel ones only a name;
- a send's or receive's peer is the peer's global rank in the same pipeline;
- a collective's members are its pipeline ranks times every coordinate along its `dims`
  (the rank's own along the others), global ranks; its `what` is kept, so the members of an
  all-to-all over `ep` (pipelines of their own, each with its microbatches) name it alike;
- a MoE phase is its op's, renamed as the op;
- with dp_shard > 1 a stage's UNSHARD is followed by the all_gather FSDP issues in it, over
  the rank's dp_shard group (async, waited just before the stage's next computation), and its
  REDUCE_GRAD by the reduce_scatter (async, waited before the next collective carrying that
  stage, or at the end of the step): the collectives of a step that FSDP runs inside the
  stage actions are instructions of the replay too.

Collectives inside a stage's computation (tensor parallelism's, in the layers) stay out: they
belong to the module (docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipecc.diagnostics import InputError
from pipecc.ir.mesh import Mesh, dims_valid
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Instr,
    Phase,
    Recv,
    Send,
    Sequential,
    StageAction,
    StageOp,
    Wait,
    works_on,
)
from pipecc.ir.placement import Placement, StageSlot
from pipecc.ir.program import Program
from pipecc.passes.splice import positions, splice

FSDP_KINDS = {
    StageAction.UNSHARD: (CollectiveKind.ALL_GATHER, "unshard"),
    StageAction.REDUCE_GRAD: (CollectiveKind.REDUCE_SCATTER, "reduce-grad"),
}


def expand_mesh(prog: Program) -> Program:
    """The whole mesh's program of a pipeline's program on a mesh (module docstring).

    Requires: `prog.mesh` set and `prog.num_ranks == prog.mesh.pp`; every collective's `dims`
    are dimensions of the mesh other than pp (InputError otherwise, naming it).
    Ensures: `mesh.world` lists; list r·R + l is pipeline l's copy of list r, renamed as the
    module docstring says, with FSDP's collectives added when dp_shard > 1; the placement
    holds every pipeline's pipes; the microbatches are R·M; `mesh` is kept.
    """
    mesh = prog.mesh
    if mesh is None or prog.num_ranks != mesh.pp:
        raise InputError(
            f"a pipeline's program on a mesh has pp={mesh.pp if mesh else '?'} lists, "
            f"this one has {prog.num_ranks}"
        )
    _check_dims(prog)
    pipes = prog.placement.num_pipes
    lists: list[tuple[Instr, ...]] = [()] * mesh.world
    for r, instrs in enumerate(prog.ranks):
        for pipeline in range(mesh.pipelines):
            g = mesh.global_rank(r, pipeline)
            renamed = _Renamer(mesh, pipeline, pipes, prog.num_microbatches).rank(instrs)
            lists[g] = _with_fsdp(mesh, g, renamed) if mesh.dp_shard > 1 else renamed
    return replace(
        prog,
        num_ranks=mesh.world,
        num_microbatches=prog.num_microbatches * mesh.pipelines,
        placement=_placement(prog.placement, mesh),
        ranks=tuple(lists),
    )


def _check_dims(prog: Program) -> None:
    for rank, instrs in enumerate(prog.ranks):
        for index, instr in enumerate(instrs):
            if type(instr) is Collective and not dims_valid(instr.dims):
                raise InputError(
                    f"rank {rank} @{index}: collective {instr.what!r} spans dims "
                    f"{list(instr.dims)}: expected mesh dimensions other than pp, each once"
                )


def _placement(placement: Placement, mesh: Mesh) -> Placement:
    pipes = placement.num_pipes
    slots = tuple(
        StageSlot(mesh.global_rank(s.rank, pipeline), s.chunk, pipeline * pipes + s.pipe, s.stage)
        for pipeline in range(mesh.pipelines)
        for s in placement.slots
    )
    return Placement(f"{placement.name} on {mesh.describe()}", slots)


class _Renamer:
    """One pipeline's copy of a list: pipes, microbatches, peers and members renamed."""

    def __init__(self, mesh: Mesh, pipeline: int, pipes: int, microbatches: int) -> None:
        self.mesh = mesh
        self.pipeline = pipeline
        self.pipe0 = pipeline * pipes
        self.mb0 = pipeline * microbatches

    def rank(self, instrs: Sequence[Instr]) -> tuple[Instr, ...]:
        return tuple(self.instr(x) for x in instrs)

    def compute(self, op: Compute) -> Compute:
        return op._replace(pipe=op.pipe + self.pipe0, mb=op.mb + self.mb0)

    def instr(self, x: Instr) -> Instr:
        match x:
            case Compute():
                return self.compute(x)
            case Fused():
                return x._replace(
                    forward=self.compute(x.forward), backward=self.compute(x.backward)
                )
            case Sequential():
                return x._replace(parts=tuple(self.compute(op) for op in x.parts))
            case Phase():
                return x._replace(op=self.compute(x.op))
            case Send() | Recv():
                peer = (
                    self.mesh.global_rank(x.peer, self.pipeline)
                    if x.peer < self.mesh.pp
                    else x.peer
                )
                return x._replace(pipe=x.pipe + self.pipe0, mb=x.mb + self.mb0, peer=peer)
            case StageOp():
                return x._replace(pipe=x.pipe + self.pipe0)
            case Collective():
                return x._replace(ranks=self.members(x), dims=())
            case Wait():
                return x
            case _:
                raise AssertionError(f"unknown instruction {x!r}")

    def members(self, op: Collective) -> tuple[int, ...]:
        """The global ranks of a collective named by pipeline ranks and dims; a rank outside
        the pipeline is kept as a number no rank has (the verifier reports it)."""
        found: set[int] = set()
        for r in op.ranks:
            if r >= self.mesh.pp:
                found.add(self.mesh.world + r)
                continue
            found.update(self.mesh.group(self.mesh.global_rank(r, self.pipeline), op.dims))
        return tuple(sorted(found))


def _with_fsdp(mesh: Mesh, rank: int, instrs: tuple[Instr, ...]) -> tuple[Instr, ...]:
    """`instrs` with FSDP's all_gather after each UNSHARD and reduce_scatter after each
    REDUCE_GRAD, over the rank's dp_shard group, each waited where its result is needed."""
    group = mesh.group(rank, ("dp_shard",))
    after: dict[int, list[Instr]] = {}
    due: dict[int, list[Collective]] = {}  # index of `instrs` (len: the end) -> collectives
    for i, x in enumerate(instrs):
        if type(x) is StageOp and x.kind in FSDP_KINDS:
            kind, verb = FSDP_KINDS[x.kind]
            op = Collective(kind, group, f"{verb} s{x.stage}", True, (), (x.stage,))
            after[i] = [op]
            due.setdefault(_due(instrs, i, x), []).append(op)
    waits = {j: Wait(()) for j in due}  # placeholders, filled in once the indices are known
    placed = splice(instrs, after=after, before={j: [w] for j, w in waits.items()})
    filled = {id(w): Wait(positions(placed, due[j])) for j, w in waits.items()}
    return tuple(filled.get(id(x), x) for x in placed)


def _due(instrs: Sequence[Instr], i: int, op: StageOp) -> int:
    """Where the collective of stage action i must have completed (an index of `instrs`,
    len for the end): an UNSHARD's gather before the stage's next computation, a
    REDUCE_GRAD's reduction before the next collective carrying the stage or a blocking one."""
    for j in range(i + 1, len(instrs)):
        x = instrs[j]
        if op.kind is StageAction.UNSHARD:
            if any(c.chunk == op.chunk for c in works_on(x)):
                return j
        elif type(x) is Collective and (op.stage in x.stages or not x.asynchronous):
            return j
    return len(instrs)
