"""The mesh's passes (docs/parallelism.md): FSDP's stage actions with a residency policy and a
prefetch lookahead, the data-parallel reductions, and the whole mesh written out.

Every bundled schedule, at a few sizes, with each combination of options, compiles to a
program that passes every check under every comm model once written out for its mesh.
"""

from __future__ import annotations

import pytest
from helpers import SCHEDULES, compile_bundled

from pipecc.diagnostics import InputError
from pipecc.driver.check import verify_program
from pipecc.driver.mesh import MeshOptions, place_mesh, whole_mesh
from pipecc.ir.mesh import Mesh, parse_mesh
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Instr,
    StageAction,
    StageOp,
    Wait,
    computations,
    is_compute,
)
from pipecc.ir.program import Program
from pipecc.passes.expand_mesh import expand_mesh
from pipecc.passes.insert_dp_reduction import insert_dp_reduction
from pipecc.passes.insert_fsdp_actions import FsdpPolicy, insert_fsdp_actions
from pipecc.passes.splice import splice
from pipecc.verify import ALL_MODELS, Options

ALL = Options(models=ALL_MODELS)
FILES = sorted(p.stem for p in SCHEDULES.glob("*.sched"))
SIZES = {"dualpipe": ((2, 4), (4, 8)), "dualpipev": ((2, 4), (4, 8)), "zbv": ((2, 4), (4, 8))}
MESHES = (
    MeshOptions("dp_shard=2"),
    MeshOptions("dp_replicate=2"),
    MeshOptions("dp_replicate=2,dp_shard=2", policy=FsdpPolicy(2, 2)),
    MeshOptions("tp=2,dp_shard=2", policy=FsdpPolicy(None, 0)),
    MeshOptions("", fsdp=True, policy=FsdpPolicy(2, 1)),
)


def _sizes(name: str) -> tuple[tuple[int, int], ...]:
    return SIZES.get(name, ((2, 4), (4, 8), (3, 5)))


@pytest.mark.parametrize("name", FILES)
def test_every_mesh_program_verifies_under_every_model(name: str) -> None:
    checked = 0
    for ranks, microbatches in _sizes(name):
        try:
            base = compile_bundled(name, ranks, microbatches)
        except InputError:  # a size the schedule's requires refuse
            continue
        for options in MESHES:
            program = place_mesh(base, options)
            report, _ = verify_program(program, ALL)
            assert report.ok, f"{name} P={ranks} M={microbatches} {options}\n" + "\n".join(
                str(v) for v in report.violations
            )
            checked += 1
    assert checked >= len(MESHES)


def _active(instrs: tuple[Instr, ...]) -> int:
    """The most stages unsharded at once on a rank."""
    now: set[int] = set()
    most = 0
    for x in instrs:
        if type(x) is StageOp and x.kind is StageAction.UNSHARD:
            now.add(x.stage)
        elif type(x) is StageOp and x.kind is StageAction.RESHARD:
            now.discard(x.stage)
        most = max(most, len(now))
    return most


def _kinds(instrs: tuple[Instr, ...], kind: StageAction) -> int:
    return sum(type(x) is StageOp and x.kind is kind for x in instrs)


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv", "dualpipev", "dualpipe"])
def test_residency_bounds_the_unsharded_stages_and_costs_gathers(name: str) -> None:
    base = compile_bundled(name, 4, 8)
    free = insert_fsdp_actions(base)
    for instrs in free.ranks:  # no bound: each held stage gathered once
        assert _kinds(instrs, StageAction.UNSHARD) == len({x.stage for x in _ops(instrs)})
    limit = 1 if name in ("interleaved_1f1b", "zbv") else 2
    tight = insert_fsdp_actions(base, policy=FsdpPolicy(limit, 1))
    for instrs in tight.ranks:
        assert _active(instrs) <= limit
        assert _kinds(instrs, StageAction.UNSHARD) == _kinds(instrs, StageAction.RESHARD)
        assert _kinds(instrs, StageAction.REDUCE_GRAD) == len({x.stage for x in _ops(instrs)})
    if limit == 1:  # two chunks per rank, one resident: they alternate, and gather again
        assert sum(_kinds(i, StageAction.UNSHARD) for i in tight.ranks) > 2 * base.num_ranks
    report, _ = verify_program(tight, ALL)
    assert report.ok, [str(v) for v in report.violations]


def _ops(instrs: tuple[Instr, ...]) -> list[Compute]:
    return [op for x in instrs for op in computations(x)]


def test_a_residency_below_a_fused_ops_stages_is_refused() -> None:
    base = compile_bundled("dualpipe", 4, 8)
    with pytest.raises(InputError, match=r"--max-active-stages 1: rank 0 @\d+ computes on 2"):
        insert_fsdp_actions(base, policy=FsdpPolicy(1, 1))


def test_prefetch_unshards_ahead_of_the_first_use() -> None:
    base = compile_bundled("interleaved_1f1b", 2, 4)
    for prefetch, ahead in ((0, 0), (1, 1)):
        instrs = insert_fsdp_actions(base, policy=FsdpPolicy(None, prefetch)).ranks[0]
        computes = [i for i, x in enumerate(instrs) if is_compute(x)]
        unshard = [i for i, x in enumerate(instrs) if type(x) is StageOp and x.chunk == 1][0]
        first = next(i for i in computes if computations(instrs[i])[0].chunk == 1)
        # chunk 1's UNSHARD lies before the `ahead`-th computation preceding its first use
        before = [i for i in computes if i < first]
        assert unshard < (before[-ahead] if ahead else first)
        if ahead:
            assert unshard > before[-ahead - 1]


def test_dp_reduction_follows_each_stages_last_gradient_op() -> None:
    base = compile_bundled("zb_h1", 2, 4)
    program = insert_dp_reduction(base)
    for rank, instrs in enumerate(program.ranks):
        (at,) = [i for i, x in enumerate(instrs) if type(x) is Collective]
        op = instrs[at]
        assert op == Collective(
            CollectiveKind.ALL_REDUCE, (rank,), f"dp-grad s{rank}", True, ("dp_replicate",), (rank,)
        )
        last = max(
            i for i, x in enumerate(instrs) if any(c.kind.value == "W" for c in computations(x))
        )
        assert at == last + 1
        assert instrs[-1] == Wait((at,)) or at in [
            o for x in instrs[at:] if type(x) is Wait for o in x.ops
        ]
    assert insert_dp_reduction(program) == program  # placed again, the same


def test_fsdp_actions_are_idempotent_and_keep_waits() -> None:
    base = compile_bundled("1f1b", 2, 4)
    once = insert_fsdp_actions(base)
    assert insert_fsdp_actions(once) == once
    stripped = Program(
        **{
            **_fields(once),
            "ranks": tuple(splice(i, drop=lambda x: type(x) is StageOp) for i in once.ranks),
        }
    )
    assert stripped.ranks == base.ranks


def _fields(program: Program) -> dict[str, object]:
    return {f: getattr(program, f) for f in Program.__dataclass_fields__}


def test_the_whole_mesh_names_every_rank_and_collective() -> None:
    program = place_mesh(compile_bundled("1f1b", 2, 2), MeshOptions("dp_replicate=2,dp_shard=2"))
    whole = expand_mesh(program)
    mesh = Mesh(pp=2, dp_replicate=2, dp_shard=2)
    assert whole.num_ranks == 8 and whole.num_microbatches == 8 and whole.is_whole_mesh
    # pipeline l = 1 (dp_replicate 0, dp_shard 1): rank 1 of it is global 1·4 + 1 = 5
    peers = {x.peer for x in whole.ranks[1] if hasattr(x, "peer")}
    assert peers == {5}
    gathers = [x for x in whole.ranks[1] if type(x) is Collective]
    assert [(x.kind, x.ranks) for x in gathers] == [
        (CollectiveKind.ALL_GATHER, (0, 1)),
        (CollectiveKind.REDUCE_SCATTER, (0, 1)),
        (CollectiveKind.ALL_REDUCE, (1, 3)),
    ]
    assert mesh.group(1, ("dp_replicate",)) == (1, 3)
    assert whole_mesh(program)[0] == whole


def test_mesh_flags_are_checked() -> None:
    with pytest.raises(InputError, match="pp=4 but the program has P=2"):
        parse_mesh("pp=4,dp_shard=2", pp=2)
    with pytest.raises(InputError, match="expected DIM=SIZE"):
        parse_mesh("dp=2")
    base = compile_bundled("1f1b", 2, 2)
    with pytest.raises(InputError, match="residency policy"):
        place_mesh(base, MeshOptions("dp_replicate=2", policy=FsdpPolicy(2, 1)))
    whole = expand_mesh(place_mesh(base, MeshOptions("dp_replicate=2")))
    with pytest.raises(InputError, match="written for the whole mesh"):
        place_mesh(whole, MeshOptions("dp_replicate=2"))
