"""torch's per-stage actions (UNSHARD, RESHARD, REDUCE_GRAD) in pipecc's runtime.

A program read from a torch CSV may hold them (docs/interop.md). They act only on a stage
module that is an FSDP module (`torch.distributed.fsdp.fully_shard`), as torch's
`_PipelineScheduleRuntime` does; on any other module they do nothing.

- UNSHARD: every FSDP module inside the stage gathers its parameters. torch starts the
  gathers asynchronously and waits for them at the stage's next compute; here each gather
  completes before the next instruction.
- RESHARD: every FSDP module inside the stage frees its gathered parameters.
- REDUCE_GRAD: the stage module's FSDP post-backward (reduce-scatter of the gradients), once
  after the stage's last backward. torch also divides the gradients by M here; pipecc's
  runtime has already scaled each microbatch's loss by 1/M, so it does not scale again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from pipecc.ir.ops import StageAction, StageOp

from ..compat import fsdp_post_backward


def run_stage_op(module: torch.nn.Module | None, op: StageOp) -> None:
    """Run `op` on the stage module of its chunk (module docstring)."""
    if not isinstance(module, FSDPModule):
        return
    if op.kind is StageAction.UNSHARD:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.unshard()
    elif op.kind is StageAction.RESHARD:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
    else:
        _post_backward(module)


def _post_backward(module: Any) -> None:
    """FSDP's post-backward for every parameter group of the stage module, as torch's
    `PipelineStage.perform_reduce_grad` runs it for an FSDP stage."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    fsdp_post_backward(module)


def is_fsdp(module: torch.nn.Module) -> bool:
    """Whether `module` is (or holds) an FSDP2 module."""
    return any(isinstance(sub, FSDPModule) for sub in module.modules())


def fsdp_problems(split: frozenset[int], modules: Mapping[int, torch.nn.Module]) -> list[str]:
    """FSDP2 stages whose backward the program splits into I and W: the weight gradients W
    computes bypass FSDP's post-backward, so its reduction would miss them (measured: the
    gradients come out wrong); such stages run B only (1F1B, GPipe, interleaved 1F1B)."""
    return [
        f"chunk {chunk}'s module is an FSDP2 module, and the program splits its backward "
        "into I and W, which this runtime cannot run on FSDP stages yet: use a schedule "
        "with full backwards (1F1B, GPipe, interleaved 1F1B) for FSDP stages"
        for chunk in sorted(split)
        if chunk in modules and is_fsdp(modules[chunk])
    ]
