"""The step's context: per-microbatch keyword inputs every stage receives, never sent.

`runtime.step(inputs, targets, context={...})` takes a dict (at top level) of any pytrees of
tensors and constants, split into M microbatches along dim 0 like the inputs. Each stage is
called `module(*boundary_values, **context_of_its_microbatch)`: position ids, attention
masks, rotary tables, segment ids that every layer needs. Nothing of it travels between
ranks: every rank holding a stage is given the whole context and splits it itself (so every
rank of the pipeline passes the same context, or None on all of them).

The context's shapes are part of the step's signature (runtime/boundaries/signatures.py:
every rank hashes its inputs and its context together), and the discovery of a new
signature runs every stage with this rank's first context microbatch (`sample_context`):
a stage whose output depends on a context entry gets the right boundary.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch

from pipecc.diagnostics import InputError

from ..compat import pytree
from .trees import Boundary, split_tree

Context = dict[str, Any]
MARK = "\n"  # between the inputs' and the context's text in a signature (json has none)


def split_context(
    value: object, microbatches: int, device: torch.device, found: list[str]
) -> list[Context] | None:
    """The microbatches of a step's context; a problem is appended to `found` (gathered from
    every rank on a new signature)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        found.append(
            "context must be a dict of keyword arguments (str keys) for every stage, got "
            + type(value).__name__
        )
        return None
    if not value:
        return [{} for _ in range(microbatches)]
    try:
        parts = split_tree(dict(value), microbatches, "context", device)
    except InputError as err:
        found.append(err.message)
        return None
    return [dict(cast(Mapping[str, Any], part)) for part in parts]


def rows_check(inputs: Boundary, context: Boundary) -> None:
    """One microbatch of the context must have as many rows as one of the inputs (both are
    split along dim 0 alike): an InputError naming both otherwise."""
    rows = [_rows(b) for b in (inputs, context)]
    if None not in rows and rows[0] != rows[1]:
        raise InputError(
            f"the context has {rows[1]} rows per microbatch but the inputs have {rows[0]}: "
            "both are split along dim 0 into the same microbatches"
        )


def _rows(boundary: Boundary) -> int | None:
    for spec in boundary.tensors:
        if spec.shape:
            return int(spec.shape[0])
    return None


def describe_signature(signature: str) -> str:
    """A signature text for people: the inputs, and the context when there is one."""
    inputs, _, context = signature.partition(MARK)
    found = Boundary.from_text(inputs).describe()
    return found + (f" with context {Boundary.from_text(context).describe()}" if context else "")


class _Sample:
    """The context of the sample microbatch boundary inference runs on (None: none)."""

    value: Context | None = None


@contextmanager
def sample_context(value: Mapping[str, Any] | None) -> Iterator[None]:
    """Boundary inference inside the block calls every stage with `value` as keywords."""
    previous, _Sample.value = _Sample.value, None if value is None else dict(value)
    try:
        yield
    finally:
        _Sample.value = previous


def current_sample() -> Context:
    """The sample context boundary inference passes now (empty outside `sample_context`)."""
    return dict(_Sample.value or {})


def on_device(context: Context, device: torch.device) -> Context:
    """The context with every tensor on `device` (for a real forward)."""
    found: Context = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), context)
    return found
