"""What crosses a stage boundary: structure, shapes and dtypes, known before each receive.

The runtime allocates every receive buffer from a `TensorSpec` before it posts the receive,
so the boundaries of a step's shapes must be known before the step runs. They are found by
running the stages for real, on real data: the runtime does it along the pipeline when a step
brings an input signature it has not seen (runtime/boundaries/discovery.py), each rank
running only its own stages; `infer_boundaries` does it for a whole model on one process.

Boundaries are keyed by stage index in pipe 0's numbering (the `stage` of the program): entry
s is the input of stage s. Two pipes over the same stages (DualPipe) share the keys, since
stage s of either pipe is the same model stage. All microbatches of a step have the same
shapes (the batch splits evenly into M microbatches).

A stage runs for real (`run_stage`), never on the `meta` device: a model may take another
branch there (a mask helper that returns None on real data and a mask on meta, autocast,
which the meta device does not apply, routing that depends on the values), and the
boundary must be what the real forward returns. The run has no side effects: copies of the
buffers, the RNG state restored, the graph dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import torch
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from pipecc.diagnostics import InputError

from ..compat import pytree
from .context import current_sample, on_device, sample_context
from .placed import rebuilt
from .trees import Boundary, TensorSpec, flatten

__all__ = ["Boundaries", "Boundary", "Specs", "StageRun", "TensorSpec", "infer_boundaries"]

Specs: TypeAlias = tuple[TensorSpec, ...]  # the tensors of one message, in leaf order
Boundaries: TypeAlias = Mapping[int, Boundary]


def normalise_boundaries(boundaries: Mapping[int, object]) -> dict[int, Boundary]:
    """Accept a Boundary, a TensorSpec, or a tuple of TensorSpecs or (shape, dtype) pairs
    for each stage."""
    result: dict[int, Boundary] = {}
    for stage, value in boundaries.items():
        if isinstance(value, Boundary):
            result[int(stage)] = value
            continue
        items = (value,) if isinstance(value, TensorSpec) else value
        if not isinstance(items, (tuple, list)):
            raise InputError(f"boundary of stage {stage}: expected TensorSpec(s), got {value!r}")
        specs = []
        for item in items:
            if isinstance(item, TensorSpec):
                specs.append(item)
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                specs.append(TensorSpec(tuple(int(s) for s in item[0]), item[1]))
            else:
                raise InputError(f"boundary of stage {stage}: cannot read {item!r} as a spec")
        leaves = tuple(specs)
        tree = pytree.tree_flatten(0 if isinstance(value, TensorSpec) else _slots(leaves))[1]
        result[int(stage)] = Boundary(tree, leaves)
    return result


def _slots(leaves: tuple[TensorSpec, ...]) -> tuple[int, ...]:
    return tuple(range(len(leaves)))  # a tuple with one leaf per spec


class OutputNotTree(InputError):
    """A stage returned something that is not a pytree of tensors and constants: valid only
    for the last stage, whose output only `loss_fn` reads."""


class StageRun(NamedTuple):
    """A stage run once for its boundary: its output's tensors (detached) and boundary."""

    tensors: tuple[torch.Tensor, ...]
    boundary: Boundary


def run_stage(
    module: torch.nn.Module,
    value: object,
    device: torch.device,
    *,
    autocast: torch.dtype | None = None,
    seed: int | None = None,
) -> StageRun:
    """Run `module` for real on `value` (its input, as the runtime passes it) and return
    its output's tensors and boundary, with no side effect: the module's buffers are copies
    (`functional_call`), the random generators of the CPU and `device` are restored (seeded
    with `seed` for the call when given, as the real forward is), and the autograd graph is
    dropped; which outputs require a gradient is observed before that (under autocast when
    given). An output that is no pytree of tensors and constants is an `OutputNotTree`."""
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    with _fork_rng(device):
        if seed is not None:
            _seed(device, seed)
        with autocast_context(device, autocast), torch.enable_grad():
            kwargs = on_device(current_sample(), device)  # the step's context, if any
            outputs = functional_call(module, buffers, _args(value), kwargs, strict=False)
    try:
        tensors, boundary = flatten(outputs, "a stage's output")
    except InputError as err:
        raise OutputNotTree(err.message) from err
    return StageRun(tuple(t.detach() for t in tensors), boundary)


def as_received(boundary: Boundary, tensors: tuple[torch.Tensor, ...], mesh: Any = None) -> object:
    """The value the next stage takes: `tensors` as detached leaves, those that carry a
    gradient requiring one (as the runtime's forward rebuilds a received message); a
    received local shard of a DTensor leaf rebuilt over `mesh` (runtime/boundaries/placed.py;
    a DTensor kept on the same process stays as it is)."""
    leaves = []
    for t, spec in zip(tensors, boundary.tensors, strict=True):
        leaf = t.detach().requires_grad_(spec.carries_grad)
        if spec.placed is not None and not isinstance(leaf, DTensor):
            leaf = rebuilt(leaf, spec.placed, mesh)
        leaves.append(leaf)
    return boundary.rebuild(tuple(leaves))


def infer_boundaries(
    stages: Sequence[torch.nn.Module],
    sample: object,
    *,
    autocast: torch.dtype | None = None,
    device: torch.device | None = None,
    context: Mapping[str, Any] | None = None,
) -> dict[int, Boundary]:
    """Every stage's input boundary, from the whole model in stage order and one microbatch.

    `sample` is the input of stage 0 for one microbatch, any pytree: each stage runs for
    real on what the previous one returned (`run_stage`: no side effects), so the
    boundaries are those of real data, whatever branch the model takes on it. Entry 0 is
    the sample itself; entry len(stages) is the model's output, absent when it is not a
    pytree of tensors and constants (a dataclass: only `loss_fn` reads it, nothing sends
    it). `autocast`: the dtype the forwards run under, if any. `context`: the microbatch's
    context (every stage's keyword inputs, runtime/boundaries/context.py); by default the
    one the runtime installs while it discovers a new signature.
    """
    if context is not None:
        with sample_context(context):
            return infer_boundaries(stages, sample, autocast=autocast, device=device)
    value = sample
    boundaries = {0: flatten(sample, "the sample input")[1]}
    for index, stage in enumerate(stages):
        where = device or _device_of(stage)
        try:
            run = run_stage(stage, _moved(value, where), where, autocast=autocast)
        except OutputNotTree:
            if index == len(stages) - 1:  # the model's output, which no stage receives
                break
            raise
        except Exception as err:
            raise InputError(
                f"stage {index} fails on the sample ({type(err).__name__}: {err})"
            ) from err
        boundaries[index + 1] = run.boundary
        value = as_received(run.boundary, run.tensors)
    return boundaries


def synthetic(specs: Specs, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Tensors of `specs` with fixed values (floats from a seeded normal, integers and
    booleans zero), so every rank computes the same shapes from them."""
    generator = torch.Generator(device=device).manual_seed(0)
    found = []
    for spec in specs:
        if spec.is_floating:
            tensor = torch.randn(spec.shape, generator=generator, device=device).to(spec.dtype)
            found.append(tensor.requires_grad_(_wants_grad(spec)))
        else:
            found.append(torch.zeros(spec.shape, dtype=spec.dtype, device=device))
    return tuple(found)


def _wants_grad(spec: TensorSpec) -> bool:
    return spec.is_floating and bool(spec.grad)


def _args(value: object) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _moved(value: object, device: torch.device) -> object:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def _seed(device: torch.device, seed: int) -> None:
    """Seed the generators as the runtime's forward does (runtime/engine/rng.py)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


@contextlib.contextmanager
def _fork_rng(device: torch.device) -> Iterator[None]:
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def autocast_context(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    """`torch.autocast` on `device`'s type with `dtype`; nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
