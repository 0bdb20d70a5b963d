"""Selective recomputation: chosen submodules keep only their inputs, and run again before
their stage's backward.

In the forward (`F`) of a stage that recomputes selectively, each outermost call of a
selected submodule (runtime/engine/recompute.py) is a *region*: while it runs, a
`saved_tensors_hooks` pair stands between autograd and what the call's ops save. The graph
is built as always, with every edge (to the stage's input and to the parameters), but a
saved tensor is replaced by an empty `_Slot`; only the call's arguments (and the parameters,
which live anyway) are kept as they are. The weight-gradient contract's input of a Linear
inside a region goes through the same slots (`weight_contract.keeping`). The region also
keeps the generators' states at its entry (only when the call drew random numbers: dropout)
and the autocast state.

Before the stage's `B` or `I` of that microbatch (`Selected.replay`), each region's call runs
again from its kept arguments, with its graph, under the same generator states and autocast
(and, for a split backward with the Linear contract, inside the chunk's capture), and every
tensor that run saves is put into the slot of the same position (the two runs save the same
tensors in the same order, checked: a count that differs is an error). The replay's own
graph is dropped. So `I` and `W` run on the forward's own, now complete, graph: the split
backward is unchanged, the recomputation happens once, before `I`, and nothing runs twice
after it. A slot lives as long as the node that saved it: autograd frees it when the node
has run (or, kept for `W`, after `W`), as it frees saved tensors without recomputation.

The replay runs on the CUDA stream its region's forward ran on (a fused op's forward may have
run on the side stream, runtime/engine/fused.py), so that the filled slots are written and
read on one stream: it waits for the current stream first, and the current stream waits for
it after (the kept arguments are let go only then).

A region's call must not modify its arguments in place (the replay would start from the
modified values): that is checked at the call's end (SetupError naming the module). Modules
must be called (`module(x)`), not through `module.forward(x)`, for their hooks to run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from pipecc.diagnostics import ProgramError, SetupError

from ..compat import pytree, version_of
from .aux_loss import collecting
from .weight_contract import Capture, capturing, keeping


class _Slot:
    """A saved tensor of a region, empty from the forward until the replay fills it."""

    __slots__ = ("__weakref__", "value")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        return _unpack(self)


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    slot: _Slot = packed
    if slot.value is None:
        raise ProgramError(
            "a saved tensor of a selectively recomputed module was used before its replay"
        )
    return slot.value


class Region:
    """One call of a selected module in a forward: what its replay needs."""

    __slots__ = (
        "args", "autocast", "count", "inputs", "kwargs", "module", "rng", "slots", "stream",
    )  # fmt: skip

    def __init__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self.module = module
        self.args = args
        self.kwargs = kwargs
        leaves = pytree.tree_leaves((args, kwargs))
        self.inputs = {id(t): version_of(t) for t in leaves if isinstance(t, torch.Tensor)}
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.autocast: tuple[bool, torch.dtype] | None = None
        self.count = 0  # tensors saved (and contract inputs kept) in the call
        self.slots: list[tuple[int, weakref.ref[_Slot]]] = []
        self.stream: Any = None  # the CUDA stream the call ran on (None off CUDA)

    def pack(self, tensor: torch.Tensor) -> Any:
        position = self.count
        self.count += 1
        if isinstance(tensor, torch.nn.Parameter) or id(tensor) in self.inputs:
            return tensor  # lives anyway
        slot = _Slot()
        self.slots.append((position, weakref.ref(slot)))
        return slot

    def fill(self, values: Sequence[torch.Tensor]) -> None:
        if len(values) != self.count:
            raise SetupError(
                f"the replay of {type(self.module).__name__} saved {len(values)} tensors, its "
                f"forward {self.count}: a selectively recomputed module must do the same work "
                "when called again with the same inputs"
            )
        for position, ref in self.slots:
            slot = ref()
            if slot is not None:
                slot.value = values[position]
        self.args = self.kwargs = None


class Recorder:
    """Opens a region at each outermost call of the selected modules during one forward."""

    def __init__(self, device: torch.device, cuda_index: int | None, regions: list[Region]) -> None:
        self.device_type = device.type
        self.cuda_index = cuda_index
        self.regions = regions
        self.open: Region | None = None
        self.stack: list[contextlib.ExitStack | None] = []

    def pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self.open is not None or not torch.is_grad_enabled():
            self.stack.append(None)
            return
        region = Region(module, args, kwargs)
        region.rng = rng_state(self.cuda_index)
        if self.cuda_index is not None:
            region.stream = torch.cuda.current_stream(self.cuda_index)
        dtype = torch.get_autocast_dtype(self.device_type)
        region.autocast = (torch.is_autocast_enabled(self.device_type), dtype)
        self.open = region
        hooks = contextlib.ExitStack()
        hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(region.pack, _unpack))
        self.stack.append(hooks)

    def post(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        hooks = self.stack.pop()
        if hooks is None:
            return
        hooks.close()
        region, self.open = self.open, None
        assert region is not None
        self.regions.append(region)
        changed = [i for i, t in _tensors(region) if version_of(t) != region.inputs[i]]
        if changed:
            raise SetupError(
                f"{type(module).__name__}, recomputed selectively, modified its input in "
                "place: its replay would start from the modified values (select a module "
                "that does not, or recompute the stage in full)"
            )
        if region.rng is not None and _same_state(region.rng, rng_state(self.cuda_index)):
            region.rng = None  # it drew nothing: its replay needs no state

    def keep(self, tensor: torch.Tensor) -> Any:
        """The weight contract's input of a Linear: packed when inside a region."""
        return tensor if self.open is None else self.open.pack(tensor)


def _tensors(region: Region) -> Iterator[tuple[int, torch.Tensor]]:
    for leaf in pytree.tree_leaves((region.args, region.kwargs)):
        if isinstance(leaf, torch.Tensor):
            yield id(leaf), leaf


@contextlib.contextmanager
def recording(
    modules: Sequence[nn.Module], device: torch.device, cuda_index: int | None, into: Selected
) -> Iterator[Recorder]:
    """For one forward: a region at each outermost call of `modules` (module docstring),
    added to `into`."""
    recorder = Recorder(device, cuda_index, into.regions)
    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(recorder.pre, with_kwargs=True))
            handles.append(
                module.register_forward_hook(recorder.post, with_kwargs=True, always_call=True)
            )
        with keeping(recorder.keep):
            yield recorder
    finally:
        for handle in handles:
            handle.remove()
        while recorder.stack:  # an exception inside a call: close what it left open
            hooks = recorder.stack.pop()
            if hooks is not None:
                hooks.close()


class Selected:
    """What a selectively recomputed forward leaves for its backward: its regions, in call
    order, and the capture the forward ran under (the replay runs under it too)."""

    __slots__ = ("capture", "regions", "root")

    def __init__(self, regions: list[Region], capture: Capture | None, root: nn.Module) -> None:
        self.regions = regions
        self.capture = capture
        self.root = root  # the chunk's module (the capture's)

    def replay(self, device_type: str, cuda_index: int | None) -> None:
        """Run each region's call again and fill its slots (module docstring)."""
        for region in self.regions:
            values: list[torch.Tensor] = []

            def record(tensor: torch.Tensor, values: list[torch.Tensor] = values) -> int:
                values.append(tensor.detach() if tensor.requires_grad else tensor)
                return len(values) - 1

            def keep(tensor: torch.Tensor, record: Any = record) -> torch.Tensor:
                record(tensor)  # the contract's input takes its place in the same order
                return tensor

            with (
                on_stream(region.stream, cuda_index),
                capturing(self.root, self.capture) if self.capture else contextlib.nullcontext(),
                restored(region.rng, cuda_index),
                _autocast(device_type, region.autocast),
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(record, _never),
                keeping(keep),
                collecting([]),  # as in the forward (which reported its added losses)
            ):
                region.module(*region.args, **region.kwargs)
            region.fill(values)
        self.regions = []


@contextlib.contextmanager
def on_stream(stream: Any, cuda_index: int | None) -> Iterator[None]:
    """The block on `stream` (a region's: module docstring), ordered after the current
    stream's work and before its later work; as it is when `stream` is the current one."""
    if stream is None or cuda_index is None:
        yield
        return
    current = torch.cuda.current_stream(cuda_index)
    if stream == current:
        yield
        return
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


def _never(_: Any) -> torch.Tensor:
    raise ProgramError("the graph of a selective replay is not for a backward")


def _autocast(
    device_type: str, state: tuple[bool, torch.dtype] | None
) -> contextlib.AbstractContextManager[Any]:
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=state[1], enabled=state[0])


def rng_state(cuda_index: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default generators' states: the CPU's, and the stage's CUDA device's."""
    cuda = torch.cuda.get_rng_state(cuda_index) if cuda_index is not None else None
    return torch.get_rng_state(), cuda


def _same_state(
    a: tuple[torch.Tensor, torch.Tensor | None], b: tuple[torch.Tensor, torch.Tensor | None]
) -> bool:
    same_cuda = a[1] is None or b[1] is None or torch.equal(a[1], b[1])
    return same_cuda and torch.equal(a[0], b[0])


@contextlib.contextmanager
def restored(
    state: tuple[torch.Tensor, torch.Tensor | None] | None, cuda_index: int | None
) -> Iterator[None]:
    """The generators at `state` for the block, as they were after it (nothing: None)."""
    if state is None:
        yield
        return
    devices = [cuda_index] if cuda_index is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None and cuda_index is not None:
            torch.cuda.set_rng_state(state[1], cuda_index)
        yield
