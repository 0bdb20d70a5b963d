"""`pipecc run --memory`: each rank's real peak over one step, measured apart from the
prediction.

`measuring(device, modules)` wraps one plain step (the runtime's own interpreter, no hooks)
and yields a list that holds the rank's peak in bytes once the block ends:

- on CUDA, `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, less what was
  allocated before the step, plus the parameters and module buffers (so the figure is the
  step's peak over the same things the prediction counts), less the batch the step copies to
  the device (`batch_bytes`, reported apart); the caching allocator rounds each block up (to
  512 bytes), which the prediction does not;
- on CPU, an exact count of live tensor storages (`LiveStorages`, runtime/profiling/memory.py):
  the parameters and buffers from the start, then every storage an aten op creates, until it
  is freed. The batch is made before the step and split into views: never counted. What the
  count cannot see: scratch space inside one aten op.

Neither counts optimizer state: `pipecc run` takes no optimizer step (the launcher reports
the optimizer's bytes apart).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..compat import pytree
from ..engine.interpreter import Interpreter
from ..pipeline import PipelineRuntime
from ..profiling.memory import (
    ByteProfile,
    ByteProfilingInterpreter,
    LiveStorages,
    module_tensors,
    pool_tensors,
    storages,
)


@contextlib.contextmanager
def measuring(
    device: torch.device,
    modules: Iterable[torch.nn.Module],
    *,
    batch_on_device: int = 0,
    pool: Iterable[torch.Tensor] = (),
) -> Iterator[list[int]]:
    """The peak bytes of what runs inside (module docstring): the one item of the yielded
    list once the block ends. `batch_on_device`: the batch bytes the step copies to a CUDA
    device, taken out; `pool`: the runtime's receive buffers, allocated before the step and
    held through it (counted, as the parameters are)."""
    held = [t for module in modules for t in module_tensors(module)] + list(pool)
    result: list[int] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        own = sum(nbytes for nbytes, _ in storages(held).values())
        result.append(peak - base + own - batch_on_device)
        return
    live = LiveStorages()
    live.seed(held)
    with live:
        yield result
    result.append(live.peak)


def tree_bytes(value: object) -> int:
    """Bytes of the distinct storages of every tensor in a pytree (a batch)."""
    leaves = pytree.tree_leaves(value)
    return sum(n for n, _ in storages(t for t in leaves if isinstance(t, torch.Tensor)).values())


def memory_steps(
    runtime: PipelineRuntime,
    modules: dict[int, torch.nn.Module],
    batches: tuple[tuple[Any, ...], tuple[Any, ...]],
    *,
    optimizer: object,
    measure: bool,
) -> dict[str, Any]:
    """After the timed steps: one byte-profiled step (runtime/profiling/memory.py), then,
    with `measure`, one plain step measured (`measuring`). Returns the rank's byte profile,
    its measured peak (or None) and its batch bytes (the inputs and targets of a step)."""
    device = runtime.device
    profile = ByteProfile()
    live = LiveStorages()
    for module in modules.values():
        live.seed(module_tensors(module))
    made: list[ByteProfilingInterpreter] = []

    def profiling(base: Interpreter) -> Interpreter:
        made.append(ByteProfilingInterpreter(base, profile, live))
        return made[-1]

    _zeroed(modules)
    dist.barrier()
    with live:
        _step(runtime, batches[0], through=profiling)
    made[0].finish(optimizer)
    batch = batches[1]
    found: dict[str, Any] = {"bytes": profile, "measured": None, "batch_bytes": tree_bytes(batch)}
    if measure:
        _zeroed(modules)
        dist.barrier()
        on_device = 0 if device.type != "cuda" else _device_batch(runtime, batch)
        pool = pool_tensors(runtime.plans.bound(training=True))
        with measuring(device, modules.values(), batch_on_device=on_device, pool=pool) as peak:
            _step(runtime, batch)
        found["measured"] = peak[0]
    dist.barrier()
    return found


def _zeroed(modules: dict[int, torch.nn.Module]) -> None:
    for module in modules.values():
        module.zero_grad(set_to_none=True)


def _step(
    runtime: PipelineRuntime,
    batch: tuple[Any, ...],
    through: Callable[[Interpreter], Interpreter] | None = None,
) -> None:
    """One step on (inputs, targets) or (inputs, targets, context), as the model file made it."""
    context = batch[2] if len(batch) > 2 else None
    runtime.step(batch[0], batch[1], context=context, through=through)


def _device_batch(runtime: PipelineRuntime, batch: tuple[Any, ...]) -> int:
    """The bytes of the batch a step copies to the device: the inputs on a rank holding a
    first stage, the targets on one holding a last stage."""
    chunks = runtime.chunks.values()
    inputs = tree_bytes(batch[0]) if any(c.first for c in chunks) else 0
    return inputs + (tree_bytes(batch[1]) if any(c.last for c in chunks) else 0)
