"""Expert-parallel cases, run inside mesh_cases.py's process group of 4 (gloo): a pipeline of 2
times an EP group of 2, `init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))`, or
one pipeline rank times 2 data-parallel ranks times an EP group of 2 (`("pp", "dp_shard",
"ep")`: FSDP2 on dp_shard over the experts each EP rank keeps, as `pipecc run` shards;
`("pp", "dp_replicate", "ep")`), the MoE model of examples/moe_ep.py (every stage two MoE
blocks of 4 experts, top 2, the Switch balancing loss added with `add_loss`; layer 1 of
every stage routes nothing to experts 2 and 3, so EP rank 1 receives no token there).

Each case runs the pipeline's program split into MoE phases (the compiler's expand_moe:
the fused F&B interleaved, or in sequence), each data-parallel rank (dp_replicate, dp_shard,
ep) on its contiguous share of the global batch, and compares the loss, the added loss and
every gradient of this rank's stages, each expert's by name (gathered whole from FSDP's
shards), with one process training the whole batch on the whole model.
The cases' programs are compiled in the parent (`moe_cases`); the rest runs in the spawned
processes: keep it importable and picklable.
"""

from __future__ import annotations

import functools
import runpy
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from discovery_cases import Counts, counting
from pipecc.runtime import PipelineRuntime, RuntimeConfig
from pipecc.runtime.comm.mesh import replica_index
from pipecc.runtime.engine.moe_block import MoEBlock
from pipecc.runtime.tools import mesh_job
from pipecc.runtime.tools.mesh_job import Place
from pipecc.runtime.tools.reference import Options, gradients, reference_step
from runtime_cases import compile_case
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pipecc.diagnostics import PipeccError
from pipecc.driver.mesh import MeshOptions, MoeOptions, place_mesh, place_moe
from pipecc.ir.ops import Collective, CollectiveKind, StageAction, StageOp
from pipecc.ir.program import Program

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = Options(seed=3)
ROWS = 2  # rows per microbatch
FSDP_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")  # what FSDP2 calls


class MoECase(NamedTuple):
    """One case: its name, the program split into phases, and what else it runs."""

    name: str
    program: Program
    forward: bool = False  # also a forward-only step (evaluation)
    recompute: str | None = None  # "full", or the submodules recomputed selectively
    fsdp: bool = False  # every held stage under FSDP2 on dp_shard (its EP rank's experts)
    short: bool = False  # every stage keeps only its first block: refused
    mesh: str = "pp=2,ep=2"  # the device mesh, pp outermost (mesh_cases.py builds it)
    late: bool = False  # fully_shard before the EP rank's experts are kept: refused


def _model() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "examples" / "moe_ep.py"), run_name="pipecc_model")


# the cases test_mesh_runtime.py runs (programs built in the parent, before the spawn):
# PP=2 x EP=2, every stage 2 MoE layers
MOE_SCHEDULES = ("dualpipev", "zbv", "dualpipe", "1f1b")
MOE_FSDP = ("zbv", "dualpipev")


def moe_program(name: str, overlap: bool = True, microbatches: int = 4) -> Program:
    """The program `pipecc run --mesh ep=2 --moe 2` resolves (the compiler's expand_moe)."""
    options = MeshOptions("ep=2", moe=MoeOptions(2, overlap=overlap))
    return place_moe(place_mesh(compile_case(name, 2, microbatches), options), options)


def moe_fsdp_program(name: str) -> Program:
    """PP=2 x dp_shard=2 (FSDP2 stages, every expert on each rank: ep = 1) in MoE phases."""
    options = MeshOptions("dp_shard=2", moe=MoeOptions(2))
    return place_moe(place_mesh(compile_case(name, 2, 4), options), options)


# EP composed with data parallelism on 4 ranks: one pipeline rank (1F1B, M=2) times 2
# data-parallel ranks (FSDP2 on dp_shard, or replicas) times an EP group of 2
MOE_DP = ("dp_shard", "dp_replicate")


@functools.cache
def moe_dp_program(dim: str) -> Program:
    """`pipecc run 1f1b -P 1 --mesh <dim>=2,ep=2 --moe 2`'s program (whole mesh: pp = 1)."""
    options = MeshOptions(f"{dim}=2,ep=2", moe=MoeOptions(2))
    return place_moe(place_mesh(compile_case("1f1b", 1, 2), options), options)


def moe_cases() -> list[MoECase]:
    """Every MoE case of the mesh group (test_mesh_runtime.py asserts on them by name)."""
    found = [MoECase(f"moe-{n}", moe_program(n)) for n in MOE_SCHEDULES]
    found.append(MoECase("moe-sequential-dualpipev", moe_program("dualpipev", False)))
    found.append(MoECase("moe-forward-dualpipev", moe_program("dualpipev"), forward=True))
    found += [
        MoECase(f"moe-recompute-{mode}-{n}", moe_program(n), recompute=mode)
        for n in ("zbv", "dualpipev")
        for mode in ("full", "mixer")
    ]
    found += [
        MoECase(f"moe-fsdp-{n}", moe_fsdp_program(n), fsdp=True, mesh="pp=2,dp_shard=2")
        for n in MOE_FSDP
    ]
    found.append(MoECase("moe-short", moe_program("dualpipev"), short=True))
    found += [
        MoECase(f"moe-{dim}-ep", moe_dp_program(dim), fsdp=dim == "dp_shard",
                mesh=f"pp=1,{dim}=2,ep=2")
        for dim in MOE_DP
    ]  # fmt: skip
    found.append(MoECase("moe-fsdp-before-ep", moe_dp_program("dp_shard"), fsdp=True,
                         mesh="pp=1,dp_shard=2,ep=2", late=True))  # fmt: skip
    return found


def reductions(program: Program) -> list[tuple[str, tuple[str, ...]]]:
    """The program's FSDP reduce-scatters and data-parallel all-reduces, in order."""
    return [
        (f"{op.kind.value} {getattr(op, 'what', '')}".strip(), getattr(op, "dims", ()))
        for op in program.ranks[0]
        if (isinstance(op, StageOp) and op.kind is StageAction.REDUCE_GRAD)
        or (isinstance(op, Collective) and op.kind is CollectiveKind.ALL_REDUCE)
    ]


def run_moe_case(mesh: Any, case: MoECase) -> dict[str, Any]:
    """One case on this rank of the case's mesh: what the tests assert."""
    try:
        return _check(mesh, case)
    except PipeccError as err:
        return {"error": type(err).__name__, "message": str(err)}


def _check(mesh: Any, case: MoECase) -> dict[str, Any]:
    model = _model()
    stages_total = case.program.placement.num_stages(0)
    stages: list[nn.Module] = model["build_stages"](stages_total)
    reference: list[nn.Module] = model["build_stages"](stages_total)
    if case.short:
        for stage in stages:
            stage.moe_blocks = nn.ModuleList(list(stage.moe_blocks)[:1])
    chunks = case.program.placement.chunks(mesh.get_local_rank("pp"))
    modules = {slot.chunk: stages[slot.stage] for slot in chunks}
    received = _counting([stages[slot.stage] for slot in chunks])
    calls = _calls([stages[slot.stage] for slot in chunks])
    if case.fsdp:
        _fully_shard(stages, {slot.stage for slot in chunks}, mesh, case)
    config = RuntimeConfig(seed=OPTIONS.seed, mesh=mesh, recompute=case.recompute)
    runtime = PipelineRuntime(case.program, modules, loss_fn=model["loss_fn"], config=config)
    # every data-parallel rank (dp_replicate, dp_shard, ep) its contiguous share of the rows
    replica, replicas = replica_index(mesh, "pp"), mesh.size() // mesh["pp"].size()
    microbatches = case.program.num_microbatches * replicas
    data = model["make_batch"](ROWS * microbatches, 0)
    share = tuple(part[replica * len(part) // replicas : (replica + 1) * len(part) // replicas]
                  for part in data)  # fmt: skip
    counts = Counts()
    with counting(counts, ((dist, FSDP_COLLECTIVES),)):
        runtime.step(*share)
    breakdown = runtime.global_loss(breakdown=True)
    want_loss, want = reference_step(reference, data, microbatches, model["loss_fn"], OPTIONS)
    held = {slot.stage for slot in chunks}
    got = {k: _full(v) for k, v in gradients(stages).items() if k[0] in held}
    found = {
        "loss": (breakdown.main, want_loss), "added": breakdown.added,
        "grad_rel": _worst(got, want),
        "experts": sorted(n for (s, n) in got if ".experts." in n and s == min(held)),
        "received": received, "mixer_calls": len(calls),
        "expert_share": _share_held(stages, held), "carried": _carried(runtime),
        "collectives": [counts.calls.get(name, 0) for name in FSDP_COLLECTIVES],
    }  # fmt: skip
    if case.forward:
        runtime.forward(*share)
        found["eval_loss"] = (runtime.global_loss(breakdown=True).main, want_loss)
    return found


def _fully_shard(stages: list[nn.Module], held: set[int], mesh: Any, case: MoECase) -> None:
    """FSDP2 on every held stage over dp_shard, gradient sync off but at the program's
    REDUCE_GRAD, after this EP rank's experts are kept: as `pipecc run` does it
    (runtime/tools/mesh_job.py `shard`); `late`: fully_shard first, the wrong order."""
    if not case.late:
        replicas = mesh.size() // mesh["pp"].size()
        where = Place(mesh, mesh.get_local_rank("pp"), replica_index(mesh, "pp"), replicas)
        mesh_job.shard(dict(enumerate(stages)), held, where, case.program)
        return
    for stage in sorted(held):
        fully_shard(stages[stage], mesh=mesh["dp_shard"], reshard_after_forward=False)
        cast(Any, stages[stage]).set_requires_gradient_sync(False)


def _carried(runtime: PipelineRuntime) -> dict[str, list[int]]:
    """Each data-parallel reduction of this rank (by its `what`): how many dense parameters
    it reduces, how many experts it reduces or scales (runtime/comm/mesh.py)."""
    reductions = runtime.mesh
    ops = runtime.program.ranks[runtime.rank]
    indices = set(reductions.params) | set(reductions.expert_params)
    return {
        cast(Collective, ops[i]).what: [
            len(reductions.params.get(i, ())),
            len(reductions.expert_params.get(i, ())),
        ]
        for i in sorted(indices)
    }


def _share_held(stages: list[nn.Module], held: set[int]) -> float:
    """The part of its experts' parameters this rank holds (FSDP's shards of them)."""
    local = whole = 0
    for stage in held:
        for name, param in stages[stage].named_parameters():
            if ".experts." in name:
                local += (param.to_local() if isinstance(param, DTensor) else param).numel()
                whole += param.numel()
    return local / whole


def _counting(stages: list[nn.Module]) -> dict[str, list[int]]:
    """Rows each block's experts receive on this rank, by (stage position, layer)."""
    found: dict[str, list[int]] = {}
    for index, stage in enumerate(stages):
        for layer, block in enumerate(getattr(stage, "moe_blocks", ())):
            assert isinstance(block, MoEBlock)
            rows = found.setdefault(f"{index}.{layer}", [])
            _wrap(block, rows)
    return found


def _calls(stages: list[nn.Module]) -> list[int]:
    """One entry per call of a block's dense sublayer (`mixer`) on this rank."""
    found: list[int] = []
    for stage in stages:
        for block in getattr(stage, "moe_blocks", ()):
            block.mixer.register_forward_hook(lambda *_: found.append(1))
    return found


def _wrap(block: MoEBlock, rows: list[int]) -> None:
    plain = block.experts_forward

    def counted(tokens: torch.Tensor, counts: Any) -> torch.Tensor:
        rows.append(int(tokens.shape[0]))
        return plain(tokens, counts)

    setattr(block, "experts_forward", counted)  # noqa: B010  (an instance attribute)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _worst(got: dict[Any, torch.Tensor], want: dict[Any, torch.Tensor]) -> float:
    """max |got - want| / max |want| over each parameter, worst of all (by name: the
    experts a rank holds are compared with the whole model's experts of that name)."""
    worst = 0.0
    for key, value in got.items():
        ref = want[key].float()
        scale = float(ref.abs().max()) or 1.0
        worst = max(worst, float((value.float() - ref).abs().max()) / scale)
    return worst
