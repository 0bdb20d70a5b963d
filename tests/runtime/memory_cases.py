"""Runs for tests/runtime/test_memory_measured.py, in one spawned process group: each case binds a
runtime for its program on the MLP example, takes one warm-up step, then the byte-profiled
step and the measured step of `pipecc run --memory` (runtime/tools/memory.py)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from pipecc.runtime.boundaries.specs import infer_boundaries
from pipecc.runtime.config import RuntimeConfig
from pipecc.runtime.pipeline import PipelineRuntime
from pipecc.runtime.tools.memory import memory_steps
from pipecc.runtime.tools.model_file import load_model

from pipecc.ir.program import Program

MLP = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mlp.py")
ROWS = 8  # per microbatch


def run_memory_cases(
    rank: int, world: int, programs: list[tuple[Program, Any]]
) -> list[dict[str, Any]]:
    """For each program and recompute spec: this rank's byte profile and measured peak."""
    os.environ["PIPECC_MLP_HIDDEN"] = "128"
    model = load_model(MLP)
    found = []
    for program, recompute in programs:
        stages = program.placement.num_stages(0)
        built = model.stages(range(stages), stages)
        modules = {s.chunk: built[s.stage] for s in program.placement.chunks(rank)}
        whole = list(built.values())
        runtime = PipelineRuntime(
            program,
            modules,
            lambda sample, whole=whole: infer_boundaries(whole, sample),
            loss_fn=model.loss_fn,
            config=RuntimeConfig(device=torch.device("cpu"), recompute=recompute),
        )
        rows = ROWS * program.num_microbatches
        for module in modules.values():
            module.zero_grad(set_to_none=True)
        runtime.step(*model.make_batch(rows, seed=0))
        dist.barrier()
        batches = (model.make_batch(rows, seed=1), model.make_batch(rows, seed=2))
        found.append(memory_steps(runtime, modules, batches, optimizer="adamw", measure=True))
    return found
