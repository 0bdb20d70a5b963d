"""`--mesh`, `--fsdp`, `--max-active-stages`, `--prefetch`: a program placed for a device mesh.

`place_mesh` is one step of the one resolution (`driver/load.resolve_source`): the program
resolved without the mesh gets FSDP's stage actions (`passes/insert_fsdp_actions`: with
`--fsdp`, or whenever dp_shard > 1), then each stage's data-parallel all_reduce
(`passes/insert_dp_reduction`: when dp_replicate > 1), and carries the mesh
(`Program.mesh`), so that compile writes it, verify and simulate replay the whole mesh
(`expand_mesh`) and the runtime runs it. With `ep` > 1 the dense parameters' reductions
span `ep` too, and a MoE stage's experts get their own (`insert_dp_reduction`).

`place_moe` is the step after it (`--moe K`, `--moe-overlap`): each MoE stage's F, B and I
split into phases with the expert-parallel all-to-alls (`passes/expand_moe`).
docs/parallelism.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipecc.diagnostics import InputError
from pipecc.ir.mesh import Mesh, parse_mesh
from pipecc.ir.ops import Collective
from pipecc.ir.program import Program
from pipecc.passes.expand_mesh import expand_mesh
from pipecc.passes.expand_moe import expand_moe
from pipecc.passes.insert_dp_reduction import insert_dp_reduction
from pipecc.passes.insert_fsdp_actions import DEFAULT_POLICY, FsdpPolicy, insert_fsdp_actions


@dataclass(frozen=True, slots=True)
class MoeOptions:
    """`--moe K`: K MoE layers in every stage, `stages` a cost file's per-stage `moe_layers`
    over it ((stage, K) pairs); `--moe-overlap on|off`: a fused F&B of MoE stages
    interleaved (DualPipe's overlap) or its halves in sequence."""

    layers: int
    stages: tuple[tuple[int, int], ...] = ()
    overlap: bool = True

    def per_stage(self, stages: int) -> tuple[int, ...]:
        """The MoE layers of each of `stages` stages; InputError for a stage it lacks."""
        given = dict(self.stages)
        for stage in given:
            if stage >= stages:
                raise InputError(
                    f"moe_layers of stage {stage}: the program has stages 0..{stages - 1}"
                )
        return tuple(given.get(s, self.layers) for s in range(stages))


@dataclass(frozen=True, slots=True)
class MeshOptions:
    """The mesh flags: `--mesh` as written (pp may be left out: the program's P), `--fsdp`
    and its residency policy, and the MoE layers (`--moe`, None: none)."""

    mesh: str = ""
    fsdp: bool = False
    policy: FsdpPolicy = DEFAULT_POLICY
    moe: MoeOptions | None = None


def place_mesh(program: Program, options: MeshOptions) -> Program:
    """`program` placed for the mesh (module docstring).

    Requires: a pipeline's program, its comm ops placed. Raises InputError for a program
    written for a whole mesh, a mesh whose pp is not the program's P, or a residency policy
    given without FSDP."""
    if program.is_whole_mesh:
        raise InputError(
            "the program is written for the whole mesh (one list per global rank): --mesh "
            "and --fsdp place actions in a pipeline's program"
        )
    mesh = _mesh(program, options.mesh)
    fsdp = options.fsdp or (mesh is not None and mesh.dp_shard > 1)
    if not fsdp and options.policy != DEFAULT_POLICY:
        raise InputError(
            "--max-active-stages and --prefetch are FSDP's residency policy: give --fsdp or "
            "a mesh with dp_shard > 1"
        )
    if fsdp:
        program = insert_fsdp_actions(program, policy=options.policy)
    if mesh is None and options.moe is not None:  # --moe without --mesh: pp alone, ep=1
        mesh = Mesh(pp=program.num_ranks)
    dims = tuple(d for d in ("dp_replicate", "ep") if mesh is not None and mesh.size(d) > 1)
    if dims:
        shards = mesh.dp_shard if mesh is not None and fsdp else 1
        moe = _moe(program, options.moe)
        program = insert_dp_reduction(program, shards=shards, dims=dims, moe=moe)
    return replace(program, mesh=mesh)


def place_moe(program: Program, options: MeshOptions) -> Program:
    """The --moe step of the resolution: `program` (placed for its mesh by `place_mesh`)
    with its MoE stages split into phases and all-to-alls over `ep` (`expand_moe`); as it
    is without --moe."""
    moe = _moe(program, options.moe)
    if moe is None or options.moe is None:
        return program
    return expand_moe(program, moe, overlap=options.moe.overlap)


def _moe(program: Program, options: MoeOptions | None) -> tuple[int, ...] | None:
    return None if options is None else options.per_stage(program.placement.num_stages(0))


def _mesh(program: Program, text: str) -> Mesh | None:
    if not text:
        return program.mesh
    return parse_mesh(text, pp=program.num_ranks)


def whole_mesh(program: Program) -> tuple[Program, tuple[str, ...]]:
    """The program verify and simulate replay: a pipeline's program on a mesh written out for
    every global rank (`expand_mesh`), with a note saying so; any other as it is."""
    mesh = program.mesh
    if mesh is None or program.is_whole_mesh or program.num_ranks != mesh.pp:
        return program, ()
    if mesh.pipelines == 1 and not _has_dims(program):
        return program, ()
    note = (
        f"a pipeline's program on mesh {mesh.describe()}: replayed as the whole mesh, "
        f"{mesh.world} ranks (pipeline l's rank r is global rank r·{mesh.pipelines} + l, "
        f"its microbatch m is l·{program.num_microbatches} + m; docs/parallelism.md)"
    )
    return expand_mesh(program), (note,)


def _has_dims(program: Program) -> bool:
    return any(isinstance(x, Collective) and x.dims for instrs in program.ranks for x in instrs)


def run_mesh(text: str, processes: int | None) -> Mesh:
    """`pipecc run --mesh TEXT --nproc N`: the mesh, its pp given or N over the product of the
    other sizes; InputError when N is not the mesh's world size, or for a dimension the
    runtime cannot run yet (context parallel: docs/parallelism.md)."""
    given = parse_mesh(text)
    others = given.world // given.pp
    if "pp=" not in text.replace(" ", ""):
        if processes is None or processes % others:
            raise InputError(
                f"--mesh {text}: --nproc {processes} is not a multiple of {others}, the "
                "product of the mesh's sizes (give pp=, or --nproc as the world size)"
            )
        given = replace(given, pp=processes // others)
    if processes is not None and processes != given.world:
        raise InputError(
            f"--mesh {text}: the mesh has {given.world} processes, not --nproc {processes}"
        )
    if given.cp > 1:
        raise InputError(
            f"--mesh {text}: pipecc run runs pp × dp_replicate × dp_shard × tp meshes; cp "
            "(context parallel) is compiled, verified and simulated, but not run yet "
            "(docs/parallelism.md)"
        )
    return given
