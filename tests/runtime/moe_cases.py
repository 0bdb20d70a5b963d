"""Expert-parallel cases, run inside mesh_cases.py's process group of 4 (gloo): a pipeline of 2
times an EP group of 2, `init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))`, the
MoE model of examples/moe_ep.py (every stage two MoE blocks of 4 experts, top 2, the Switch
balancing loss added with `add_loss`; layer 1 of every stage routes nothing to experts 2
and 3, so EP rank 1 receives no token there).

Each case runs the pipeline's program split into MoE phases (runtime/tools/moe_program.py:
the fused F&B interleaved, or in sequence), each EP rank on its contiguous share of the
global batch, and compares the loss, the added loss and every gradient of this rank's
stages, each expert's by name, with one process training the whole batch on the whole model.
Functions here run in the spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from pipecc.runtime import PipelineRuntime, RuntimeConfig
from pipecc.runtime.engine.moe_block import MoEBlock
from pipecc.runtime.tools.reference import Options, gradients, reference_step
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = Options(seed=3)
ROWS = 2  # rows per microbatch


class MoECase(NamedTuple):
    """One case: its name, the program split into phases, and what else it runs."""

    name: str
    program: Program
    forward: bool = False  # also a forward-only step (evaluation)
    recompute: str | None = None  # "full", or the submodules recomputed selectively
    fsdp: bool = False  # on ("pp", "dp_shard"): every held stage under FSDP2, all experts
    short: bool = False  # every stage keeps only its first block: refused


def _model() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "examples" / "moe_ep.py"), run_name="pipecc_model")


def run_moe_case(mesh: Any, case: MoECase) -> dict[str, Any]:
    """One case on this rank of the ("pp", "ep") mesh: what the tests assert."""
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
    pp, ep = mesh.get_coordinate()
    chunks = case.program.placement.chunks(pp)
    modules = {slot.chunk: stages[slot.stage] for slot in chunks}
    received = _counting([stages[slot.stage] for slot in chunks])
    calls = _calls([stages[slot.stage] for slot in chunks])
    if case.fsdp:
        for stage in sorted({slot.stage for slot in chunks}):
            fully_shard(stages[stage], mesh=mesh["dp_shard"], reshard_after_forward=False)
            cast(Any, stages[stage]).set_requires_gradient_sync(False)
    config = RuntimeConfig(seed=OPTIONS.seed, mesh=mesh, recompute=case.recompute)
    runtime = PipelineRuntime(case.program, modules, loss_fn=model["loss_fn"], config=config)
    microbatches = case.program.num_microbatches * 2
    data = model["make_batch"](ROWS * microbatches, 0)
    share = tuple(part[ep * len(part) // 2 : (ep + 1) * len(part) // 2] for part in data)
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
    }  # fmt: skip
    if case.forward:
        runtime.forward(*share)
        found["eval_loss"] = (runtime.global_loss(breakdown=True).main, want_loss)
    return found


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
