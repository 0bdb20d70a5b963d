"""Weight gradients by contract: `W` computes them from what `I` saved, without a graph walk.

A module class *registers a contract* (`register_weight_grad`) when its parameters'
gradients are a function of its input and its output's gradient alone; `nn.Linear` is
registered here: `dW = gᵀ·x`, `db = Σ g` over the rows. Inside `capturing(module)` (the runtime
enters it around the forward of a chunk whose backward is split), each call of such a module
whose input needs a gradient runs with its trainable parameters *detached*, so the autograd
graph has no edge from that call to them, and a pre-hook on the node that made the call's
output (`_producer`) keeps the input `x` and, when the backward reaches the output,
receives its gradient `g`:

* inside `input_backward` (`I`) the hook defers `(x, g)` to a store that `W` later turns
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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

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
_RESOLVED: dict[type, WeightFn | None] = {}
# id() of every live parameter a captured call has detached (an id leaves the set when its
# parameter dies, since a dead parameter's id may be reused)
CONTRACTED: set[int] = set()


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


class _State:
    """Process-wide: where `I` defers to. Not thread-local on purpose: on CUDA the autograd
    engine runs hooks on its device threads, not on the thread that called it."""

    store: list[Deferred] | None = None


@contextmanager
def capturing(module: nn.Module) -> Iterator[None]:
    """Calls of `module`'s contracted submodules inside run as the module docstring says.

    For the extent of the block each of them gets an instance attribute `forward` (which
    `nn.Module.__call__` finds before the class's), removed on the way out; so hooks, the
    call path and every other module are as without a capture."""
    installed = [
        m for m in module.modules() if contract_of(m) is not None and "forward" not in m.__dict__
    ]
    for sub in installed:
        sub.__dict__["forward"] = partial(_captured_call, sub)
    try:
        yield
    finally:
        for sub in installed:
            sub.__dict__.pop("forward", None)


@contextmanager
def deferring(store: list[Deferred]) -> Iterator[None]:
    """Hooks fired inside (the `I` engine call) defer their work to `store`."""
    previous, _State.store = _State.store, store
    try:
        yield
    finally:
        _State.store = previous


def _captured_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A contracted module's forward: its trainable parameters detached for the call, and a
    pre-hook on its output's node for the output gradient (or the plain forward when there
    is nothing to capture: no gradient wanted, no trainable parameter, a hooked one)."""
    forward = type(module).forward
    fn = contract_of(module)
    x = args[0] if len(args) == 1 and not kwargs else None
    if fn is None or not isinstance(x, torch.Tensor) or not x.requires_grad:
        return forward(module, *args, **kwargs)
    params = {n: p for n, p in module._parameters.items() if p is not None and p.requires_grad}
    if not params or not torch.is_grad_enabled() or any(_hooked(p) for p in params.values()):
        return forward(module, x)
    for name, param in params.items():
        module._parameters[name] = param.detach()  # type: ignore[assignment]  # restored below
        if id(param) not in CONTRACTED:
            CONTRACTED.add(id(param))
            weakref.finalize(param, CONTRACTED.discard, id(param))
    try:
        output = forward(module, x)
    finally:
        module._parameters.update(params)
    return _keep(module, fn, params, x, output)


def _hooked(param: torch.Tensor) -> bool:
    """Whether hooks wait for the parameter's gradient from autograd (a `register_hook`, a
    post-accumulate hook, as DDP's): then its calls keep their ordinary edges."""
    return bool(param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None))


def _keep(
    module: nn.Module, fn: WeightFn, params: dict[str, nn.Parameter], x: torch.Tensor, output: Any
) -> Any:
    """Hook the node of a contracted call's output; returns the output (a copy if needed)."""
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
    node.register_prehook(
        partial(_arrived, module, fn, params, x, producer.output_nr, output.shape)
    )
    return output


def _producer(output: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose node made `output`: itself, or the base of which it is a reshape.

    The pre-hook goes on that node, not on the tensor: an in-place op may follow
    (`ReLU(inplace=True)`), and on a view that replaces the view's node in the graph, while
    the base's node stays (a 3-d `F.linear` returns a reshape of its 2-d `addmm`)."""
    tensor = output
    while tensor._base is not None:
        base = tensor._base
        same = tensor.numel() == base.numel() and tensor.storage_offset() == base.storage_offset()
        if not (same and tensor.is_contiguous() and base.is_contiguous()):
            return None
        tensor = base
    return tensor


def _arrived(
    module: nn.Module,
    fn: WeightFn,
    params: dict[str, nn.Parameter],
    x: torch.Tensor,
    slot: int,
    shape: torch.Size,
    grads: tuple[torch.Tensor | None, ...],
) -> None:
    """The output gradient of a contracted call: defer (inside `I`) or accumulate now."""
    g = grads[slot]
    if g is None:
        return
    work = Deferred(module, fn, params, x, g.reshape(shape))
    if _State.store is not None:
        _State.store.append(work)
    else:
        accumulate(work)


def accumulate(work: Deferred) -> None:
    """Add one call's weight gradients into `.grad`, as autograd's leaf accumulation does.

    A Linear weight whose `.grad` already holds a gradient of its own dtype gets `gᵀ·x`
    added by the matmul itself (`addmm_`), without a gradient block of its own: that block
    (MBs) is what autograd allocates, adds and frees per Linear and microbatch, and with
    glibc's default allocator each one is faulted in afresh. (The sum is rounded once
    instead of twice, so from the second microbatch on it is not bit-identical to B's.)"""
    names = set(work.params)
    weight = work.params.get("weight")
    if work.fn is linear_weight_grads and weight is not None and _fusable(weight, work.g):
        assert weight.grad is not None  # _fusable
        g2 = work.g.reshape(-1, work.g.shape[-1])
        with torch.no_grad():  # x needs a gradient: recorded, .grad would keep x and g alive
            weight.grad.addmm_(g2.t(), work.x.reshape(-1, work.x.shape[-1]).to(g2.dtype))
        names.discard("weight")
    if names:
        _add(work, names)


def _fusable(weight: torch.Tensor, g: torch.Tensor) -> bool:
    grad = weight.grad
    return grad is not None and grad.dtype == g.dtype == weight.dtype and grad.is_contiguous()


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
            fresh = grad._base is None and grad.stride() == param.stride()
            param.grad = grad if fresh else torch.empty_like(param).copy_(grad)
        else:
            param.grad.add_(grad)
