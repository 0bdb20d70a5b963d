"""pipecc.runtime: executes compiled programs under torchrun (needs the `[runtime]` extra).

This package is the top-level `runtime/` folder of the repository, installed as
`pipecc.runtime`. It imports only `pipecc.ir`, `pipecc.diagnostics` and torch; nothing in
`pipecc` imports it at module level, so the compiler, verifier and simulator install
without torch. docs/runtime.md describes the API.

    program = pipecc.api.compile_schedule("schedules/zb_h1.sched", ranks=4, microbatches=8)
    runtime = PipelineRuntime(program, {0: my_stage})  # shapes found on the real data
    loss = runtime.step(inputs, targets)   # gradients accumulate in .grad
"""

from __future__ import annotations

from .boundaries.discovery import pipeline_boundaries
from .boundaries.specs import Boundary, TensorSpec, infer_boundaries
from .checkpoint import load_checkpoint, save_checkpoint
from .comm.failure import RuntimeFailed
from .comm.shared import shared_parameters
from .config import RuntimeConfig, mse_loss
from .data import broadcast_shapes
from .engine.aux_loss import LossBreakdown, add_loss
from .engine.interpreter import InstructionError
from .engine.moe_block import MoEBlock, MoEStage, Routed, keep_experts
from .engine.watch import NonFiniteError, StepStats
from .pipeline import PipelineRuntime
from .profiling.recorder import Recorder
from .tools.split_model import split_model
from .tools.whole_reference import WholeCheck, check_against

__all__ = [
    "Boundary",
    "InstructionError",
    "LossBreakdown",
    "MoEBlock",
    "MoEStage",
    "NonFiniteError",
    "PipelineRuntime",
    "Recorder",
    "Routed",
    "RuntimeConfig",
    "RuntimeFailed",
    "StepStats",
    "TensorSpec",
    "WholeCheck",
    "add_loss",
    "broadcast_shapes",
    "check_against",
    "infer_boundaries",
    "keep_experts",
    "load_checkpoint",
    "mse_loss",
    "pipeline_boundaries",
    "save_checkpoint",
    "shared_parameters",
    "split_model",
]
