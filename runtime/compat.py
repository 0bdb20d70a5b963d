"""Every private torch API the runtime uses, in one place.

torch keeps no promise about these; each one here has a test in tests/runtime/test_compat.py
that fails, naming it, when a torch release changes it, so an upgrade breaks one named test
instead of a step deep inside the interpreter. Nothing else in the runtime reaches into torch's
private names: it imports them from here.

- `pytree`: `torch.utils._pytree` (flatten and rebuild any stage value; registered types).
- `run_backward`: the autograd engine called directly (`Variable._execution_engine`), as
  `torch.autograd.backward`/`grad` call it after checking their arguments.
- `ACCUMULATE_GRAD` and `leaf_of`: the class of a leaf's gradient node
  (`torch._C._functions.AccumulateGrad`) and the leaf it accumulates into (`.variable`).
- `grad_hooked`: whether hooks wait for a parameter's gradient (`_backward_hooks`,
  `_post_accumulate_grad_hooks`).
- `base_of`: the tensor a view was made from (`Tensor._base`).
- `group_coalesces`, `post_p2p`: whether a process group's backend coalesces a group of
  point-to-point ops (`ProcessGroup._get_backend`), and one op posted on its process group
  with the peer's rank in that group (`P2POp.group_peer`).
- `storage_shared`: whether anything besides the tensor references its storage
  (`torch._C._storage_Use_Count`: the storage's reference count, which counts every tensor
  viewing it and the storage object asked for).
- `fsdp_post_backward`: FSDP2's post-backward for every parameter group of a module (its
  state's `_state_ctx.all_states` and `_fsdp_param_groups`), then its root's end-of-backward
  callback (`_root_post_backward_final_callback`: the compute stream waits for the
  reduce-scatters, the groups' state is reset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.autograd.graph import GradientEdge, Node
from torch.autograd.variable import Variable
from torch.distributed.fsdp import fully_shard

__all__ = [
    "ACCUMULATE_GRAD",
    "base_of",
    "fsdp_post_backward",
    "grad_hooked",
    "group_coalesces",
    "storage_shared",
    "leaf_of",
    "post_p2p",
    "pytree",
    "run_backward",
]

Grads = tuple[torch.Tensor | None, ...]

ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]  # a leaf's node
_ENGINE = Variable._execution_engine


def run_backward(
    roots: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    keep_graph: bool,
    accumulate: bool,
) -> Grads:
    """One call of the autograd engine from `roots` seeded with `grads`: the gradients of
    `inputs` (returned when not `accumulate`; else added into their `.grad`), every input
    when `inputs` is empty. No argument checks: the caller's are always well formed."""
    return cast(
        Grads,
        _ENGINE.run_backward(
            tuple(roots), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate
        ),
    )


def leaf_of(node: Node) -> torch.Tensor:
    """The leaf tensor an `AccumulateGrad` node accumulates into."""
    return cast(torch.Tensor, cast(Any, node).variable)


def grad_hooked(param: torch.Tensor) -> bool:
    """Whether hooks wait for the parameter's gradient from autograd (`register_hook`, or a
    post-accumulate hook, as DDP's)."""
    return bool(param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None))


def base_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of (None: it is no view)."""
    return tensor._base


def storage_shared(tensor: torch.Tensor) -> bool:
    """Whether another tensor (a view, its base, a tensor autograd handed over) holds the
    storage of `tensor`: more references than the tensor itself and the storage object
    asked for here."""
    storage = tensor.untyped_storage()
    count: int = torch._C._storage_Use_Count(storage._cdata)
    return count > 2


def group_coalesces(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether `group`'s backend for `device` coalesces a group of point-to-point ops (False
    where it has none for that device)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return False
    try:
        backend = pg._get_backend(device)
    except RuntimeError:
        return False
    return bool(backend.supports_coalescing)


def post_p2p(op: dist.P2POp, tensor: torch.Tensor) -> dist.Work | None:
    """Post one op's `tensor` on its process group directly (what `isend`/`irecv` do after
    their checks), to the peer's rank in that group."""
    post = op.group.send if op.op is dist.isend else op.group.recv
    return post([tensor], op.group_peer, op.tag)


def fsdp_post_backward(module: torch.nn.Module) -> None:
    """FSDP2's post-backward (the gradients' reduce-scatter) for every parameter group of
    `module`, then the callback FSDP queues at the end of a backward, as torch's
    `PipelineStage` runs them for an FSDP stage: on a GPU the reduce-scatters run on FSDP's
    own stream, and the callback (with `set_is_last_backward(True)`) makes the compute
    stream wait for them before anything reads the reduced gradients."""
    state = cast(Any, fully_shard).state(module)  # `state` is added by torch's decorator
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
