"""Weight gradients by contract: `W` computes them from what `I` saved, without a graph walk.

A module class *registers a contract* (`register_weight_grad`) when its parameters'
gradients are a function of its input and its output's gradient alone; `nn.Linear` is
registered here: `dW = gᵀ·x`, `db = Σ g` over the rows. Inside `capturing(module, capture)` (the
runtime enters it around the forward of a chunk whose backward is split), each call of such a module
whose input needs a gradient runs with its trainable parameters *detached*, so the autograd
graph has no edge from that call to them, and a pre-hook on the node that made the call's
output (`_producer`) keeps the input `x` and, when the backward reaches the output,
receives its gradient `g`:

* inside `input_backward` (`I`), given the same `Capture`, the hook defers `(x, g)` to the
  capture's store, which `W` later turns
  into the parameters' gradients, one matmul per Linear and no autograd engine at all
  (added into `.grad` by the matmul itself when it already holds one: `accumulate`);
* in any other backward (`B`, or a user's own) it computes them at once, where the graph
  would have, so a captured forward is correct under every backward.

Everything else in the graph is untouched: a parameter used outside a contracted call (a
tied embedding, a LayerNorm, a raw `F.linear` on someone's weight) keeps its ordinary edge
and gets its gradient from the engine, in `I`. That is DualPipe's weight-gradient store,
here on stock modules: their forwards are not replaced, only their parameters are swapped
for detached aliases for the duration of the call (`capturing(module)` gives each
contracted submodule an instance-level `forward` for its extent only), so outside it the
modules behave exactly as before. A call
whose input needs no gradient (the first Linear of a first stage) is left alone, its
weight gradient computed in `I`; so is a parameter with gradient hooks (`_hooked`).

A subclass inherits a contract only if it keeps the registered class's `forward` (a
subclass that computes something else must not get `gᵀ·x`).

What is process-wide is only what holds for a class: the registered contracts and which
class gets which (`contract_of`, cached). Where a hook defers to is a `Capture`, an object
of the caller's (the runtime has one per chunk whose backward it splits, chosen when the
plan is bound: runtime/engine/bound.py), so two runtimes in one process, or two chunks,
never see each other's choice or store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from ..compat import base_of, detached_parameters, grad_hooked, parameter_table

# (module, its input, its output's gradient, the names wanted) -> gradient by parameter name
WeightFn = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, AbstractSet[str]], Mapping[str, torch.Tensor]
]


def linear_weight_grads(
    module: nn.Module, x: torch.Tensor, g: torch.Tensor, names: AbstractSet[str]
) -> dict[str, torch.Tensor]:
    """`nn.Linear`'s contract: the kernels autograd's `addmm`/`mm` backward runs, on the
    rows flattened (`x` is cast to the gradient's dtype, as autocast cast it forward)."""
    g2 = g.reshape(-1, g.shape[-1])
    grads = {}
    if "weight" in names:
        grads["weight"] = g2.t().mm(x.reshape(-1, x.shape[-1]).to(g.dtype))
    if "bias" in names:
        grads["bias"] = g2.sum(0)
    return grads


_CONTRACTS: dict[type, WeightFn] = {nn.Linear: linear_weight_grads}
_RESOLVED: dict[type, WeightFn | None] = {}  # a cache of class facts (`contract_of`)


def register_weight_grad(cls: type[nn.Module], fn: WeightFn) -> None:
    """Declare `cls`'s contract: `fn(module, x, g, names)` returns the gradient of each
    parameter named in `names` (direct parameters of the module, in their own shapes) from
    the module's single tensor input `x` and the gradient `g` of its single tensor output."""
    _CONTRACTS[cls] = fn
    _RESOLVED.clear()


def contract_of(module: nn.Module) -> WeightFn | None:
    """The contract that applies to `module`'s class, if any (cached per class)."""
    cls = type(module)
    if cls not in _RESOLVED:
        found = None
        for base in cls.__mro__:
            if base in _CONTRACTS:
                same = getattr(cls, "forward", None) is getattr(base, "forward", None)
                found = _CONTRACTS[base] if same else None
                break
        _RESOLVED[cls] = found
    return _RESOLVED[cls]


class Deferred(NamedTuple):
    """One contracted call's weight work, waiting for `W`."""

    module: nn.Module
    fn: WeightFn
    params: dict[str, nn.Parameter]
    x: torch.Tensor
    g: torch.Tensor


class Capture:
    """Where the hooks of the calls captured with it defer their work: `store` while an `I`
    runs (`deferring`), None otherwise (the work is done at once). Not thread-local on
    purpose: on CUDA the autograd engine runs hooks on its device threads."""

    __slots__ = ("modules", "store")

    def __init__(self, module: nn.Module | None = None) -> None:
        self.store: list[Deferred] | None = None
        # the contracted submodules of the module it is made for, found once
        self.modules = None if module is None else _contracted_modules(module)


def _contracted_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if contract_of(m) is not None]


def contracted(module: nn.Module) -> bool:
    """Whether any submodule of `module` has a contract (the class facts only): a chunk
    whose backward is split uses the contract method then, the graph walk otherwise."""
    return bool(_contracted_modules(module))


@contextmanager
def capturing(module: nn.Module, capture: Capture | None = None) -> Iterator[Capture]:
    """Calls of `module`'s contracted submodules inside run as the module docstring says,
    their hooks deferring to `capture` (a new one if not given), which the block gets.

    For the extent of the block each of them gets an instance attribute `forward` (which
    `nn.Module.__call__` finds before the class's), removed on the way out; so hooks, the
    call path and every other module are as without a capture."""
    capture = capture if capture is not None else Capture()
    found = capture.modules if capture.modules is not None else _contracted_modules(module)
    installed = [m for m in found if "forward" not in m.__dict__]
    for sub in installed:
        sub.__dict__["forward"] = partial(_captured_call, capture, sub)
    try:
        yield capture
    finally:
        for sub in installed:
            sub.__dict__.pop("forward", None)


@contextmanager
def deferring(capture: Capture, store: list[Deferred]) -> Iterator[None]:
    """Hooks of calls captured with `capture` that fire inside (the `I` engine call) defer
    their work to `store`."""
    previous, capture.store = capture.store, store
    try:
        yield
    finally:
        capture.store = previous


def _captured_call(capture: Capture, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A contracted module's forward: its trainable parameters detached for the call, and a
    pre-hook on its output's node for the output gradient (or the plain forward when there
    is nothing to capture: no gradient wanted, no trainable parameter, a hooked one)."""
    forward = type(module).forward
    fn = contract_of(module)
    x = args[0] if len(args) == 1 and not kwargs else None
    if fn is None or not isinstance(x, torch.Tensor) or not x.requires_grad:
        return forward(module, *args, **kwargs)
    params = {n: p for n, p in parameter_table(module).items() if p is not None and p.requires_grad}
    if not params or not torch.is_grad_enabled() or any(grad_hooked(p) for p in params.values()):
        return forward(module, x)  # a hooked parameter keeps its ordinary edges
    with detached_parameters(module, params):
        output = forward(module, x)
    keep = _Keeper.keep
    return _keep(capture, (module, fn, params, x if keep is None else keep(x)), output)


# module, fn, params, x (or what gives x back: `keeping`)
Call = tuple[nn.Module, WeightFn, dict[str, nn.Parameter], Any]


class _Keeper:
    """How a captured call keeps its input `x` until its output's gradient arrives: itself
    (None), or through a function whose result is a tensor or has `get()` giving it back
    (selective recomputation packs it like a saved tensor: runtime/engine/selective.py)."""

    keep: Callable[[torch.Tensor], Any] | None = None


@contextmanager
def keeping(keep: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """Captured calls inside keep their input `x` through `keep` (`_Keeper`)."""
    previous, _Keeper.keep = _Keeper.keep, keep
    try:
        yield
    finally:
        _Keeper.keep = previous


def _keep(capture: Capture, call: Call, output: Any) -> Any:
    """Hook the node of a contracted call's output; returns the output (a copy if needed)."""
    module = call[0]
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        got = "a tensor without a graph" if isinstance(output, torch.Tensor) else type(output)
        raise RuntimeError(
            f"{type(module).__name__} has a weight-gradient contract, but its forward returned "
            f"{got} for an input that needs a gradient: the contract needs one tensor output "
            "that depends on the input"
        )
    producer = _producer(output)
    if producer is None:  # a view that is not a reshape: give the output a node of its own
        producer = output = output.clone()
    node = producer.grad_fn
    assert node is not None
    node.register_prehook(partial(_arrived, capture, call, producer.output_nr, output.shape))
    return output


def _producer(output: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose node made `output`: itself, or the base of which it is a reshape.

    The pre-hook goes on that node, not on the tensor: an in-place op may follow
    (`ReLU(inplace=True)`), and on a view that replaces the view's node in the graph, while
    the base's node stays (a 3-d `F.linear` returns a reshape of its 2-d `addmm`)."""
    tensor = output
    while (base := base_of(tensor)) is not None:
        same = tensor.numel() == base.numel() and tensor.storage_offset() == base.storage_offset()
        if not (same and tensor.is_contiguous() and base.is_contiguous()):
            return None
        tensor = base
    return tensor


def _arrived(
    capture: Capture,
    call: Call,
    slot: int,
    shape: torch.Size,
    grads: tuple[torch.Tensor | None, ...],
) -> None:
    """The output gradient of a contracted call: defer (inside `I`) or accumulate now."""
    g = grads[slot]
    if g is None:
        return
    module, fn, params, x = call
    if not isinstance(x, torch.Tensor):
        x = x.get()  # kept through `keeping`
    work = Deferred(module, fn, params, x, g if g.shape == shape else g.reshape(shape))
    store = capture.store
    if store is not None:
        store.append(work)
    else:
        accumulate(work)


def accumulate(work: Deferred) -> None:
    """Add one call's weight gradients into `.grad`, as autograd's leaf accumulation does.

    A Linear whose `.grad`s already hold gradients of their own dtype gets `gᵀ·x` added by
    the matmul itself (`addmm_`) and `Σ g` by one `add_`, without a gradient block of their
    own: that block (MBs) is what autograd allocates, adds and frees per Linear and
    microbatch, and with glibc's default allocator each one is faulted in afresh. (The sum
    is rounded once instead of twice, so from the second microbatch on it is not
    bit-identical to B's.) That is the common case from the second microbatch of a step on,
    and it runs no more torch calls than the arithmetic needs: this is most of `W`'s host
    time on small microbatches."""
    if work.fn is linear_weight_grads:
        weight_grad = _fusable(work.params.get("weight"), work.g)
        if weight_grad is not None:
            g2 = _rows(work.g)
            x2 = _rows(work.x)
            if x2.requires_grad:  # autograd would record the add, and .grad keep x and g
                x2 = x2.detach()
            if x2.dtype != g2.dtype:
                x2 = x2.to(g2.dtype)
            weight_grad.addmm_(g2.t(), x2)
            if "bias" not in work.params:
                return
            bias_grad = _fusable(work.params["bias"], work.g)
            if bias_grad is not None:
                bias_grad.add_(g2.sum(0))
                return
            _add(work, {"bias"})
            return
    _add(work, set(work.params))


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a matrix of rows (its last dimension the columns)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def _fusable(param: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor | None:
    """`param.grad` where `W` can add into it in place: one of the gradient's dtype (and
    the parameter's), contiguous; None otherwise."""
    if param is None:
        return None
    grad = param.grad
    if grad is None or not grad.dtype == g.dtype == param.dtype or not grad.is_contiguous():
        return None
    return grad


def _add(work: Deferred, names: set[str]) -> None:
    grads = work.fn(work.module, work.x, work.g, names)
    for name in names:
        param = work.params[name]
        grad = grads.get(name)
        if grad is None or grad.shape != param.shape:
            got = "nothing" if grad is None else f"shape {tuple(grad.shape)}"
            raise RuntimeError(
                f"the weight-gradient contract of {type(work.module).__name__} returned {got} "
                f"for parameter {name!r} of shape {tuple(param.shape)}"
            )
        grad = grad.detach().to(param.dtype)
        if param.grad is None:
            fresh = base_of(grad) is None and grad.stride() == param.stride()
            param.grad = grad if fresh else torch.empty_like(param).copy_(grad)
        else:
            param.grad.add_(grad)
