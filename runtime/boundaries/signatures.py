"""Each step's input signature, learned by every rank on its own: nothing exchanged per step.

A step's signature is the structure, shapes and dtypes of one microbatch of its inputs. Every
rank computes it from the inputs it is given, reading host metadata only (no split, no copy,
no device synchronisation; runtime/boundaries/trees.py `microbatch_boundary`), so a step whose
signature is the current one issues nothing outside the program: no collective, no `.item()`.
Ranks that do not hold stage 0 are given the inputs too (only their shapes are read; `pipecc
run` gives every rank the batch); under `RuntimeConfig(static_shapes=True)` a rank may be
given none and keeps the signature it learned on the first step.

A signature not seen before starts the discovery pass on every rank together
(runtime/boundaries/discovery.py), which also checks that the ranks saw the same signature.
Its boundaries, and everything bound to them, belong to the runtime's plan cache
(runtime/engine/plan_cache.py): a signature seen before is switched to locally.

A step with a context (every stage's keyword inputs, runtime/boundaries/context.py) has the
context's microbatch boundary in its signature too: a new mask length is a new signature.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import torch

from ..compat import pytree
from .context import MARK, rows_check
from .trees import CONSTANTS, Boundary, microbatch_boundary

BoundaryFn = Callable[[Any], Mapping[int, object]]


class Signature(NamedTuple):
    """A step's input signature: a 63-bit code and stage 0's input boundary (one
    microbatch); `context`: the text of one microbatch of the step's context ("" without)."""

    code: int
    boundary: Boundary
    context: str = ""

    def text(self) -> str:
        """What the ranks agree on (runtime/boundaries/discovery.py)."""
        return self.boundary.text() + self.context


def signature_of(
    inputs: object, microbatches: int, context: Mapping[str, Any] | None = None
) -> Signature:
    """The signature of a step's inputs (and context) split into `microbatches` (an
    InputError when they cannot be split, or the context's rows are not the inputs')."""
    boundary = microbatch_boundary(inputs, microbatches, "inputs")
    extra = ""
    if context:
        given = microbatch_boundary(dict(context), microbatches, "context")
        rows_check(boundary, given)
        extra = MARK + given.text()
    return Signature(code_of_text(boundary.text() + extra), boundary, extra)


def signature_from_text(text: str) -> Signature:
    """The signature whose `text()` is `text`."""
    inputs, mark, context = text.partition(MARK)
    return Signature(code_of_text(text), Boundary.from_text(inputs), mark + context)


def code_of(boundary: Boundary) -> int:
    """A 63-bit hash of a boundary's canonical text (never 0)."""
    return code_of_text(boundary.text())


def code_of_text(text: str) -> int:
    """A 63-bit hash of a signature's text (never 0)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


REMEMBERED = 64  # input layouts whose signature is remembered (a step's costs a lookup)


class Signatures:
    """Each step's signature, remembered by the layout of its inputs (`of`)."""

    def __init__(self, microbatches: int) -> None:
        self.microbatches = microbatches
        self.seen: dict[Hashable, Signature] = {}

    def of(self, inputs: object, context: Mapping[str, Any] | None = None) -> Signature:
        """`signature_of(inputs, context)`, remembered by the layout of their leaves (a
        tensor's shape, dtype and requires_grad; a constant's value), so that a step of a
        layout seen before costs a flatten and a dict lookup, not a text and a hash."""
        key = _layout(inputs) if not context else (_layout(inputs), _layout(dict(context)))
        found = self.seen.get(key)
        if found is None:
            found = signature_of(inputs, self.microbatches, context)  # an InputError: not kept
            if len(self.seen) < REMEMBERED:
                self.seen[key] = found
        return found


def _layout(value: object) -> Hashable:
    if type(value) is torch.Tensor:  # the common case, without a pytree flatten
        return (value.shape, value.dtype, value.requires_grad)
    leaves, tree = pytree.tree_flatten(value)
    return (tree, tuple(_leaf(leaf) for leaf in leaves))


def _leaf(leaf: object) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return (type(leaf), leaf.shape, leaf.dtype, leaf.requires_grad)
    if isinstance(leaf, CONSTANTS):
        return (type(leaf), leaf)
    return ("other", id(leaf))  # refused by signature_of: never remembered
