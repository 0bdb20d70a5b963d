"""Boundaries along the pipeline, found without any rank needing another rank's modules.

`pipeline_boundaries` finds every stage's input boundary without any rank needing another
rank's modules: stage by stage, in pipeline order, the lowest rank holding stage s computes
its output boundary from its own module (on the meta device, else for real on synthetic data,
as `infer_boundaries` does), and one small collective over the pipeline group tells every
rank the result (or the failure, so every rank stops alike). It runs only when a step brings
a signature not seen before (runtime/boundaries/signatures.py calls it on every rank alike), 2·S
all-gathers of a few hundred bytes for S stages.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError
from pipecc.ir.program import Program

from ..comm.agreement import gather_texts
from ..config import RuntimeConfig
from .specs import Boundary, stage_output
from .trees import flatten

__all__ = ["pipeline_boundaries"]


def pipeline_boundaries(
    program: Program,
    modules: Mapping[int, torch.nn.Module],
    config: RuntimeConfig | None = None,
) -> Callable[[Any], dict[int, Boundary]]:
    """A boundaries function for `PipelineRuntime` that needs only this rank's modules
    (`modules[chunk]`, as given to the runtime, with the same `config`): each stage's output
    is found by a rank holding it and shared with the others (module docs). Every rank of
    the pipeline must call the function alike, as the runtime does."""
    config = config or RuntimeConfig()
    group = config.group
    rank_map = tuple(config.rank_map or dist.get_process_group_ranks(group or dist.group.WORLD))
    me = rank_map.index(dist.get_rank()) if dist.get_rank() in rank_map else -1
    world = dist.get_world_size(group)
    placement = program.placement
    # not in the program (another world size, a wrong rank map): the runtime refuses that
    # on its first step, before it calls this
    held = placement.chunks(me) if 0 <= me < program.num_ranks else ()
    mine = {slot.stage: modules.get(slot.chunk) for slot in held}
    holders: dict[int, int] = {}  # the lowest rank holding each stage
    for rank in range(program.num_ranks):
        for slot in placement.chunks(rank):
            holders.setdefault(slot.stage, rank)
    num_stages = placement.num_stages(0)

    def boundaries(sample: object) -> dict[int, Boundary]:
        boundary = flatten(sample, "the sample input")[1]
        device = config.device or _device_of(mine)
        found = {0: boundary}
        for stage in range(num_stages):
            text = ""
            if holders[stage] == me:
                last = stage == num_stages - 1
                text = _output_of(mine.get(stage), boundary, device, config.autocast, last)
            texts = gather_texts(text, group, world, device)
            reply = json.loads(next(t for t in texts if t))
            if "error" in reply:
                raise InputError(
                    f"cannot infer the output shapes of stage {stage} (on rank "
                    f"{holders[stage]}: {reply['error']}); give the boundaries explicitly "
                    "(a model file's boundaries())"
                )
            if "end" in reply:  # the model's output is no pytree: only loss_fn reads it
                break
            boundary = Boundary.from_text(reply["boundary"])
            found[stage + 1] = boundary
        return found

    return boundaries


def _output_of(
    module: torch.nn.Module | None,
    given: Boundary,
    device: torch.device,
    autocast: torch.dtype | None,
    last: bool,
) -> str:
    """The holder's reply for one stage: its output boundary, the end (the last stage's
    output is no pytree of tensors, as `infer_boundaries` allows), or the failure."""
    if module is None:
        return json.dumps({"error": "this rank was given no module for it"})
    try:
        return json.dumps({"boundary": stage_output(module, given, device, autocast).text()})
    except InputError as err:
        return json.dumps({"end": True} if last else {"error": err.message})
    except Exception as err:
        return json.dumps({"error": f"{type(err).__name__}: {err}"})


def _device_of(modules: Mapping[int, torch.nn.Module | None]) -> torch.device:
    for module in modules.values():
        if module is not None:
            for tensor in (*module.parameters(), *module.buffers()):
                return tensor.device
    return torch.device("cpu")
