"""Every private torch API the runtime uses, in one place.

The runtime supports torch 2.11 to 2.13 (the `runtime` extra): where a name differs between
them, the function here takes either. torch keeps no promise about these; each one here has
a test in tests/runtime/test_compat.py that fails, naming it, when a torch release changes
it, so an upgrade breaks one named test instead of a step deep inside the interpreter.
Nothing else in the runtime reaches into torch's private names: it imports them from here.

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
- `version_of`: a tensor's version counter (`Tensor._version`: bumped by every in-place op).
- `dtensor_local_shape`: the shape of a DTensor's local shard without an autograd op
  (`DTensor._local_tensor`).
- `child_table`, `parameter_table`, `buffer_table`: a module's own registries of children,
  parameters and buffers (`_modules`, `_parameters`, `_buffers`), `None` entries and a module
  registered under two names included (what `named_children` and friends skip or merge).
- `detached_parameters`: a module's trainable parameters swapped for detached copies for the
  extent of a call (the `_parameters` registry written directly, then restored).
- `DispatchMode`, `storage_weak_ref`: torch's dispatch mode (`TorchDispatchMode`, to see
  every op's outputs) and a weak reference to a tensor storage (`StorageWeakRef`).
- `fsdp_post_backward`: FSDP2's post-backward for every parameter group of a module (its
  state's `_state_ctx.all_states` and `_fsdp_param_groups`, or torch 2.11's one
  `_fsdp_param_group`), then its root's end-of-backward
  callback (`_root_post_backward_final_callback`: the compute stream waits for the
  reduce-scatters, the groups' state is reset).
- `default_store`: the job's key-value store (`distributed_c10d._get_default_store`), where a
  failed runtime leaves its notice (runtime/comm/failure.py).
- `profiler_enabled`: whether a torch profiler records now (`torch._C._autograd.
  _profiler_enabled`), read once per step to label the instructions only then.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._C._distributed_c10d import Store
from torch.autograd.graph import GradientEdge, Node
from torch.autograd.variable import Variable
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing import reductions

__all__ = [
    "ACCUMULATE_GRAD",
    "DispatchMode",
    "base_of",
    "default_store",
    "buffer_table",
    "child_table",
    "detached_parameters",
    "dtensor_local_shape",
    "fsdp_post_backward",
    "grad_hooked",
    "group_coalesces",
    "leaf_of",
    "parameter_table",
    "post_p2p",
    "profiler_enabled",
    "pytree",
    "run_backward",
    "storage_shared",
    "storage_weak_ref",
    "version_of",
]

Grads = tuple[torch.Tensor | None, ...]

ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]  # a leaf's node
_ENGINE = Variable._execution_engine

if TYPE_CHECKING:  # torch's dispatch mode is untyped: typed here once

    class DispatchMode:
        """`TorchDispatchMode`: `__torch_dispatch__` sees every op while the mode is entered."""

        def __enter__(self) -> Any: ...
        def __exit__(self, *exc: object) -> None: ...

else:
    from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode


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
        for group in _param_groups(each):
            group.post_backward()
    state._root_post_backward_final_callback()


def default_store() -> Store | None:
    """The job's key-value store (the default process group's), None without one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def profiler_enabled() -> bool:
    """Whether a torch profiler (`torch.profiler.profile`, the autograd profiler) records."""
    return bool(torch._C._autograd._profiler_enabled())


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: `_fsdp_param_groups` (a list, since FSDP2's
    per-parameter meshes), else the one `_fsdp_param_group` or none (torch 2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter: it grows with every in-place op on its storage."""
    return int(tensor._version)


def dtensor_local_shape(tensor: Any) -> tuple[int, ...]:
    """The shape of a DTensor's local shard, read without `to_local()` (an autograd op)."""
    return tuple(tensor._local_tensor.shape)


def child_table(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """The module's own children by name, as registered (`None` entries, and a child
    registered under two names twice): writable, as `del table[name]` removes one."""
    return module._modules


def parameter_table(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """The module's own parameters by name, as registered (writable)."""
    return module._parameters


def buffer_table(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers by name, as registered (writable)."""
    return module._buffers


@contextmanager
def detached_parameters(
    module: torch.nn.Module, params: Mapping[str, torch.nn.Parameter]
) -> Iterator[None]:
    """Within the block the module's `params` (its own, by name) are detached copies, so a
    forward records no edge to them; the parameters themselves are back afterwards."""
    table = cast(dict[str, Any], module._parameters)
    for name, param in params.items():
        table[name] = param.detach()
    try:
        yield
    finally:
        table.update(params)


def storage_weak_ref(storage: torch.UntypedStorage) -> Any:
    """A weak reference to `storage` (`.expired()` once it is freed), which does not keep
    it alive."""
    return cast(Any, reductions).StorageWeakRef(storage)
