"""Any pytree between stages: what a stage takes and returns, flattened with torch's pytree.

A stage's inputs and outputs may be tensors, tuples, lists, dicts, `None` and Python constants,
nested (and any type registered with `torch.utils._pytree`). What crosses a boundary is
described by a `Boundary`: the tree's structure and, per leaf, a `TensorSpec` or the constant
itself. Only the tensor leaves travel (the program's message is the list of them, in leaf
order); the receiver rebuilds the value from its own copy of the structure and constants, which
every rank learns alike (runtime/boundaries/signatures.py). Floating tensors that require a
gradient carry one back; other tensors (masks, position ids, detached floats) do not.

A value is passed to a stage as positional arguments when it is a tuple or a list, as one
argument otherwise (a tensor, a dict, a dataclass).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from pipecc.diagnostics import InputError

from ..compat import pytree
from .placed import Placed, local_shape, placed_of

CONSTANTS = (type(None), bool, int, float, str)


class TensorSpec(NamedTuple):
    """The shape and dtype of one tensor of one microbatch at a stage boundary, and whether
    it carries a gradient back (None: floating tensors do). For a DTensor leaf, `shape` is
    its local shape (what travels) and `placed` its layout (runtime/boundaries/placed.py)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool | None = None
    placed: Placed | None = None

    @property
    def is_floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient comes back for it: floating and, when known, requiring one."""
        return self.is_floating and (self.grad is None or self.grad)

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        text = f"{dtype}[{', '.join(str(s) for s in self.shape)}]"
        return text if self.placed is None else f"{text} of a {self.placed.describe()}"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        floating = tensor.dtype.is_floating_point or tensor.dtype.is_complex
        grad = floating and tensor.requires_grad
        return cls(local_shape(tensor), tensor.dtype, grad, placed_of(tensor))


class Boundary(NamedTuple):
    """The structure of one microbatch's value at a stage boundary, and each leaf's spec
    (a `TensorSpec`) or constant value."""

    tree: pytree.TreeSpec
    leaves: tuple[object, ...]

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The specs of what travels: the tensor leaves in order."""
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, TensorSpec))

    @property
    def grads(self) -> tuple[TensorSpec, ...]:
        """The specs of the gradient coming back: the tensor leaves that carry one."""
        return tuple(spec for spec in self.tensors if spec.carries_grad)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> object:
        """The value, with `tensors` (in leaf order) in place of the tensor leaves."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(leaf, TensorSpec) else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.tree)

    def describe(self) -> str:
        """Tensor leaves as dtype[shape] in the tree's shape; constants as they are."""
        shown = [
            leaf.describe() if isinstance(leaf, TensorSpec) else repr(leaf) for leaf in self.leaves
        ]
        value = pytree.tree_unflatten([_Shown(s) for s in shown], self.tree)
        return _show(value)

    def same_as(self, other: Boundary, *, grads: bool) -> bool:
        """Equal leaves (shapes, dtypes, constants; gradient flags when `grads`)."""
        if len(self.leaves) != len(other.leaves):
            return False
        return all(_same_leaf(a, b, grads) for a, b in zip(self.leaves, other.leaves, strict=True))

    def text(self) -> str:
        """A canonical text of the boundary (for signatures): structure and leaves."""
        leaves = [_leaf_text(leaf) if isinstance(leaf, TensorSpec) else ["c", leaf]
                  for leaf in self.leaves]  # fmt: skip
        return json.dumps([pytree.treespec_dumps(self.tree), leaves])

    @classmethod
    def from_text(cls, text: str) -> Boundary:
        tree, leaves = json.loads(text)
        return cls(
            pytree.treespec_loads(tree),
            tuple(_leaf_of_text(leaf) if leaf[0] == "t" else leaf[1] for leaf in leaves),
        )


def _leaf_text(spec: TensorSpec) -> list[object]:
    """A tensor leaf's text: ["t", shape, dtype, carries a gradient(, its DTensor layout)]."""
    found: list[object] = ["t", list(spec.shape), str(spec.dtype), spec.carries_grad]
    return found if spec.placed is None else [*found, spec.placed.text()]


def _leaf_of_text(leaf: list[Any]) -> TensorSpec:
    placed = Placed.from_text(leaf[4]) if len(leaf) > 4 else None
    return TensorSpec(tuple(leaf[1]), _dtype(leaf[2]), leaf[3], placed)


def flatten(value: object, what: str) -> tuple[list[torch.Tensor], Boundary]:
    """The tensor leaves of `value` and its boundary; a leaf that is neither a tensor nor a
    Python constant is an InputError naming `what`."""
    leaves, tree = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *CONSTANTS)):
            raise InputError(
                f"{what} holds a {type(leaf).__name__}, which is neither a tensor nor a "
                "constant and which torch's pytree cannot flatten: return tensors in "
                "tuples, lists or dicts, or register the type with "
                "torch.utils._pytree.register_pytree_node"
            )
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    specs = tuple(
        _spec(leaf, what, at) if isinstance(leaf, torch.Tensor) else leaf
        for at, leaf in enumerate(leaves)
    )
    return tensors, Boundary(tree, specs)


def _spec(tensor: torch.Tensor, what: str, at: int) -> TensorSpec:
    try:
        return TensorSpec.of(tensor)
    except InputError as err:  # a DTensor layout that cannot travel (placed.py)
        raise InputError(f"{what}, leaf {at}: {err.message}") from err


def boundary_of(value: object, what: str) -> Boundary:
    return flatten(value, what)[1]


def call(module: torch.nn.Module, value: object, context: Mapping[str, Any] | None = None) -> Any:
    """Run a stage on a value: a tuple or list as positional arguments, else one argument;
    `context` (the microbatch's context, a dict) as keyword arguments."""
    kwargs = dict(context) if context else {}
    if isinstance(value, (tuple, list)):
        return module(*value, **kwargs)
    return module(value, **kwargs)


def split_tree(value: object, microbatches: int, what: str, device: torch.device) -> list[object]:
    """Split every tensor leaf of `value` into M equal microbatches along dim 0 (constants
    are repeated)."""
    leaves, tree = pytree.tree_flatten(value)
    size = _rows(leaves, microbatches, what, value) // microbatches
    parts = [
        torch.split(leaf.to(device, non_blocking=True), size)
        if isinstance(leaf, torch.Tensor)
        else None
        for leaf in leaves
    ]
    return [
        pytree.tree_unflatten(
            [leaf if part is None else part[mb] for leaf, part in zip(leaves, parts, strict=True)],
            tree,
        )
        for mb in range(microbatches)
    ]


def microbatch_boundary(value: object, microbatches: int, what: str) -> Boundary:
    """The boundary of one microbatch of `value` as `split_tree` would cut it, read from the
    host metadata of its leaves only (structure, shapes, dtypes): nothing is split, copied
    or synchronised. The same errors as `split_tree`."""
    leaves, tree = pytree.tree_flatten(value)
    size = _rows(leaves, microbatches, what, value) // microbatches
    specs = tuple(
        TensorSpec.of(leaf)._replace(shape=(size, *leaf.shape[1:]), placed=None)
        if isinstance(leaf, torch.Tensor)
        else leaf
        for leaf in leaves
    )
    boundary = Boundary(tree, specs)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *CONSTANTS)):
            flatten(value, what)  # the error naming the leaf's type
    return boundary


def _rows(leaves: list[Any], microbatches: int, what: str, value: object) -> int:
    """The rows of the tensor leaves (all alike, divisible into `microbatches`)."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise InputError(f"{what}: expected tensors (in any tuple, list or dict), got {value!r}")
    rows = {t.shape[0] if t.dim() else 0 for t in tensors}
    if len(rows) != 1:
        raise InputError(f"{what}: the tensors have different numbers of rows {sorted(rows)}")
    (count,) = rows
    if count == 0 or count % microbatches:
        raise InputError(
            f"{what}: {count} rows cannot be split into {microbatches} equal microbatches"
        )
    return int(count)


def unwrap(value: object) -> object:
    """What a loss function receives: a 1-tuple as its element, anything else as it is."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        return value[0]
    return value


def _same_leaf(a: object, b: object, grads: bool) -> bool:
    if isinstance(a, TensorSpec) and isinstance(b, TensorSpec):
        same = a.shape == b.shape and a.dtype == b.dtype and a.placed == b.placed
        return same and (not grads or a.carries_grad == b.carries_grad)
    if isinstance(a, TensorSpec) or isinstance(b, TensorSpec):
        return False
    return type(a) is type(b) and a == b


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"unknown dtype {name}")
    return dtype


class _Shown:
    def __init__(self, text: str) -> None:
        self.text = text


def _show(value: object) -> str:
    if isinstance(value, _Shown):
        return value.text
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_show(v)}" for k, v in value.items()) + "}"
    return type(value).__name__
