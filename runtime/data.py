"""Data where it is needed: the step's shapes from the ranks that load the batch.

Only the ranks that hold a first stage consume the step's inputs
(`PipelineRuntime.needs_inputs`), only those that hold a last stage its targets
(`needs_targets`); every other rank needs only the inputs' shapes, from which `step` learns
the step's signature (runtime/boundaries/signatures.py). When they never change,
`RuntimeConfig(static_shapes=True)` lets those ranks pass `None`. When they may change,
`broadcast_shapes` sends them, each step, from the loading rank: one small message outside
the verified program (host metadata, a few hundred bytes), the price of not loading the
batch everywhere (docs/recipes.md, "Data where it is needed").
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from .compat import pytree
from .pipeline import PipelineRuntime


def broadcast_shapes(runtime: PipelineRuntime, inputs: object = None) -> object:
    """The step's inputs where this rank needs them, elsewhere a stand-in of their shapes.

    The lowest pipeline rank that needs the inputs sends their structure, shapes and dtypes
    to every rank of the pipeline (one `broadcast_object_list` over its group; a
    collective: every rank calls it each step, the loading ranks with the batch's inputs,
    the others with anything, `None`). Returns `inputs` on the ranks that need them, and
    on the others the same structure of tensors on the meta device (no memory, no data),
    which `runtime.step` reads the step's signature from."""
    placement = runtime.program.placement
    loader = min(placement.holder(pipe, 0).rank for pipe in range(placement.num_pipes))
    source = runtime.rank_map[loader]
    sent: list[object] = [None]
    if dist.get_rank() == source:
        leaves, tree = pytree.tree_flatten(inputs)
        sent[0] = (pytree.treespec_dumps(tree), [_spec(leaf) for leaf in leaves])
    dist.broadcast_object_list(sent, src=source, group=runtime.group)
    if runtime.needs_inputs:
        return inputs
    text, specs = cast(tuple[str, list[object]], sent[0])
    return pytree.tree_unflatten([_stand_in(spec) for spec in specs], pytree.treespec_loads(text))


class _Spec(tuple[tuple[int, ...], torch.dtype]):
    """A tensor leaf's shape and dtype (a constant leaf is sent as it is)."""


def _spec(leaf: object) -> object:
    if isinstance(leaf, torch.Tensor):
        return _Spec((tuple(leaf.shape), leaf.dtype))
    return leaf


def _stand_in(spec: object) -> object:
    if isinstance(spec, _Spec):
        return torch.empty(spec[0], dtype=spec[1], device="meta")
    return spec
