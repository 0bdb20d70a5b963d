"""torch's per-stage actions (UNSHARD, RESHARD, REDUCE_GRAD) in pipecc's runtime.

A program compiled with `--fsdp` (or `--mesh dp_shard=N`) holds them, and so may one read
from a torch CSV (docs/interop.md). They act only on a stage module that is an FSDP module
(`torch.distributed.fsdp.fully_shard`), as torch's `_PipelineScheduleRuntime` does; on any
other module they do nothing.

- UNSHARD: every FSDP module inside the stage gathers its parameters. torch starts the
  gathers asynchronously and waits for them at the stage's next compute; here each gather
  completes before the next instruction.
- RESHARD: every FSDP module inside the stage frees its gathered parameters.
- REDUCE_GRAD: the stage module's FSDP post-backward (reduce-scatter of the gradients), once
  after the stage's last backward or W. torch also divides the gradients by M here;
  pipecc's runtime has already scaled each microbatch's loss by 1/M, so it does not scale
  again.

Between two REDUCE_GRADs every FSDP stage only accumulates (`accumulate_only`, set when the
runtime binds its modules and again after each REDUCE_GRAD), as torch's pipeline stage sets
it before every backward: gradient sync off, no reshard after a backward, not the last
backward. So a B, I or W never reduce-scatters nor frees the gathered parameters by itself,
and the next forward needs no gather the program does not hold: the step's only all-gathers
and reduce-scatters are its UNSHARDs and REDUCE_GRADs. A split backward's W adds into the
unsharded parameters' `.grad` that FSDP's post-backward reads (the contract method's deferred
work holds the parameter objects the forward computed with; the graph walk takes every leaf
of the graph that is no stage input as a weight, as B accumulates into every leaf: those are
the unsharded parameters, runtime/plan/binding.py `weights`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from pipecc.ir.ops import Instr, StageAction, StageOp

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
        accumulate_only([module])


def _post_backward(module: Any) -> None:
    """FSDP's post-backward for every parameter group of the stage module, as torch's
    `PipelineStage.perform_reduce_grad` runs it for an FSDP stage."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    fsdp_post_backward(module)


def accumulate_only(modules: Iterable[torch.nn.Module]) -> None:
    """Every FSDP stage module among `modules` accumulates its gradients unreduced and keeps
    its parameters gathered through a backward, until the program's REDUCE_GRAD (module
    docstring)."""
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)


def is_fsdp(module: torch.nn.Module) -> bool:
    """Whether `module` is (or holds) an FSDP2 module."""
    return any(isinstance(sub, FSDPModule) for sub in module.modules())


def fsdp_problems(instrs: Sequence[Instr], modules: Mapping[int, torch.nn.Module]) -> list[str]:
    """FSDP2 stages the program cannot run: one whose root is no FSDP module (the stage
    actions act on the root), and one without a REDUCE_GRAD on this rank (its gradients,
    accumulated unreduced, would never reach the sharded parameters)."""
    reduced = {op.chunk for op in instrs if isinstance(op, StageOp)
               and op.kind is StageAction.REDUCE_GRAD}  # fmt: skip
    found = []
    for chunk, module in sorted(modules.items()):
        if not is_fsdp(module):
            continue
        if not isinstance(module, FSDPModule):
            found.append(
                f"chunk {chunk}'s module holds FSDP2 modules but is not one itself: apply "
                "fully_shard to the stage module too (its root), whose UNSHARD, RESHARD and "
                "REDUCE_GRAD act on every FSDP module inside"
            )
        elif chunk not in reduced:
            found.append(
                f"chunk {chunk}'s module is an FSDP2 module, but the program has no "
                f"REDUCE_GRAD for it: its gradients would never be reduce-scattered to the "
                "sharded parameters; compile the program with FSDP's stage actions "
                "(--fsdp, or --mesh dp_shard=N: docs/parallelism.md)"
            )
    return found
