"""What the spawned ranks of tests/runtime/test_own_stages.py run, through the Python API.

Each rank builds only its own stages, with `split_model` from one meta model (the model of
own_stage_model.py), runs one step (the runtime finds the boundaries along the pipeline)
and sends back its gradients by name, what it materialized and the boundaries; the test
compares them with the whole model in the test's own process. The last case's stage raises
(a bug in the user's block): the rank reports the error it got.
"""

from __future__ import annotations

from typing import Any

import own_stage_model as model
import torch
from pipecc.runtime import InstructionError, PipelineRuntime, RuntimeConfig, split_model

from pipecc.api import compile_schedule
from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

SCHEDULES = ("1f1b", "zbv", "dualpipe")
MICROBATCHES = 4
ROWS = 2  # rows per microbatch


def run(rank: int, world: int, payload: object) -> dict[str, Any]:
    found: dict[str, Any] = {name: _train(rank, name) for name in SCHEDULES}
    found["raise"] = _raise(rank)  # the last: its peer gives up in the middle of a step
    return found


def _own_stages(
    program: Program, rank: int, materialized: list[str], raising: int | None = None
) -> dict[int, torch.nn.Module]:
    """This rank's stage modules, each distinct stage once; `materialized` collects the
    name of every parameter initialised in this process."""

    def init(module: torch.nn.Module) -> None:
        materialized.extend(name for name, _ in module.named_parameters())
        model.init(module)

    with torch.device("meta"):
        whole = model.Net(raising)
    num_stages = program.placement.num_stages(0)
    slots = program.placement.chunks(rank)
    built = {
        stage: split_model(whole, stage, num_stages, layers="blocks", init=init)
        for stage in sorted({slot.stage for slot in slots})
    }
    assert all(p.device.type == "meta" for p in whole.parameters()), "the whole stays on meta"
    return {slot.chunk: built[slot.stage] for slot in slots}


def _train(rank: int, schedule: str) -> dict[str, Any]:
    program = compile_schedule(schedule, ranks=2, microbatches=MICROBATCHES)
    materialized: list[str] = []
    modules = _own_stages(program, rank, materialized)
    runtime = PipelineRuntime(program, modules, config=RuntimeConfig(timeout=30.0))
    inputs, targets = model.make_batch(ROWS * MICROBATCHES, seed=1)
    runtime.step(inputs, targets)
    grads = {
        name: p.grad.detach().clone()
        for module in modules.values()
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    found = runtime.boundaries
    return {
        "grads": grads,
        "materialized": materialized,
        "boundaries": {stage: b.text() for stage, b in found.items()},
        "losses": {mb: float(v) for mb, v in runtime.losses.items()},
    }


def _raise(rank: int) -> dict[str, Any]:
    program = compile_schedule("1f1b", ranks=2, microbatches=2)
    modules = _own_stages(program, rank, [], raising=model.BLOCKS // 2)  # stage 1's first
    runtime = PipelineRuntime(program, modules, config=RuntimeConfig(timeout=10.0))
    inputs, targets = model.make_batch(ROWS * 2, seed=1)
    try:
        runtime.step(inputs, targets)
    except InstructionError as err:
        return {"error": type(err).__name__, "message": str(err), "details": err.details(),
                "cause": type(err.__cause__).__name__}  # fmt: skip
    except PipeccError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}
