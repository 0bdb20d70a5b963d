"""Shapes learned, not fixed: each step's input signature, agreed by one small collective.

Only the ranks holding stage 0 see a step's inputs, yet every rank must know the shapes of
what it will receive before it posts a receive, and nothing may travel point to point outside
the program. So at the start of every step each rank contributes one int64 to an
`all_gather` over the pipeline group: a hash of the structure, shapes and dtypes of its first
microbatch of inputs (ranks without inputs send 0, a rank that found its batch unusable -1).
When the hash is the current one, nothing else happens. When it changed, a second gather
carries the description itself (a few hundred bytes) once; every rank builds the boundaries
of the new signature locally (from the user's fixed specs, after checking that they fit, or
by calling the user's boundary function on a synthetic microbatch of that signature) and
caches them by hash, so a signature seen before costs only the first gather. Every rank
makes the same calls in the same order, whatever it holds.

The gather is posted at the start of the step (`start`) and completed (`finish`) at once
when this rank's inputs bring a signature other than the current one, else just before the
rank's first send or receive: a rank whose shapes are already known computes its first
forwards while the gather completes, and no rank posts a point-to-point op before it has.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pipecc.diagnostics import PipeccError, RankError, SetupError

from ..comm.agreement import gather_texts
from .context import context_text, describe_signature, inputs_text
from .specs import normalise_boundaries, synthetic
from .trees import Boundary, flatten

BoundaryFn = Callable[[Any], Mapping[int, object]]
UNUSABLE = -1  # this rank's batch cannot be split: every rank goes to the checks


class BoundaryFnError(SetupError):
    """The boundary function failed on a sample of a new signature (raised, or returned
    something that is not boundaries); the runtime reports it through every rank's checks,
    so the ranks where it worked do not wait for this one."""


class Gather(NamedTuple):
    """A posted signature gather: this rank's code and text, the work, the buffers."""

    code: int
    text: str
    work: Any
    codes: list[torch.Tensor]


class Seen(Enum):
    """What a step's signature is to the runtime."""

    CURRENT = "current"  # the previous step's
    CACHED = "cached"  # seen before: boundaries cached, checks done
    NEW = "new"  # never seen: boundaries just built, the caller checks them
    UNUSABLE = "unusable"  # some rank's batch is unusable: the caller reports it


def signature_of(sample: object, context: Mapping[str, Any] | None = None) -> tuple[int, str]:
    """A 63-bit hash of a microbatch's boundary text, and the text: its inputs and, when
    the step has one, its context (runtime/boundaries/context.py)."""
    text = flatten(sample, "the inputs")[1].text() + context_text(context)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1, text


class Signatures:
    """The boundaries of each signature of this pipeline's steps."""

    def __init__(
        self,
        source: Mapping[int, object] | BoundaryFn,
        group: dist.ProcessGroup | None,
        world: int,
        device: torch.device,
        timeout: float | None,
    ) -> None:
        self.fixed = None if callable(source) else normalise_boundaries(source)
        self.function = source if callable(source) else None
        self.group, self.world, self.device = group, world, device
        self.timeout = timeout  # seconds the first gather may block (gloo), None: no limit
        self.cache: dict[int, dict[int, Boundary]] = {}
        self.current = 0

    def learn(
        self, sample: object | None, unusable: bool, where: str
    ) -> tuple[Seen, dict[int, Boundary]]:
        """The step's boundaries and what its signature is (every rank calls it alike).
        `where` names the rank and the step in a timeout."""
        return self.finish(self.start(sample, unusable), where)

    def start(
        self, sample: object | None, unusable: bool, context: Mapping[str, Any] | None = None
    ) -> Gather:
        """Post this rank's code (the gather completes in `finish`); `context`: the
        sample microbatch's context, part of the signature."""
        code, text = (UNUSABLE, "") if unusable else (0, "")
        if sample is not None and not unusable:
            code, text = signature_of(sample, context)
        mine = torch.tensor([code], dtype=torch.int64, device=self.device)
        codes = [torch.zeros_like(mine) for _ in range(self.world)]
        work = dist.all_gather(codes, mine, group=self.group, async_op=True)
        return Gather(code, text, work, codes)

    def finish(self, gather: Gather, where: str) -> tuple[Seen, dict[int, Boundary]]:
        """Complete the gather; build and cache the boundaries of a new signature."""
        codes = self._complete(gather, where)
        if UNUSABLE in codes:
            return Seen.UNUSABLE, self.cache.get(self.current, {})
        found = {c for c in codes if c > 0}
        if len(found) != 1:
            raise SetupError(self._disagreement(gather.text, codes))
        (code,) = found
        if code in self.cache:
            seen = Seen.CURRENT if code == self.current else Seen.CACHED
            self.current = code
            return seen, self.cache[code]
        texts = gather_texts(gather.text, self.group, self.world, self.device)
        source = next(t for c, t in zip(codes, texts, strict=True) if c > 0)
        self.cache[code] = self._build(Boundary.from_text(inputs_text(source)))
        self.current = code
        return Seen.NEW, self.cache[code]

    def _complete(self, gather: Gather, where: str) -> list[int]:
        """Every rank's code; on gloo a rank that does not come within the timeout (it is
        not in this step) is an error naming this rank and step."""
        try:
            if self.timeout is None:
                gather.work.wait()
            else:
                gather.work.wait(timedelta(seconds=self.timeout))
        except Exception as err:
            raise RankError(
                f"{where}: the step's shape signature, gathered from every rank before the "
                f"program, did not complete within {self.timeout:g} s ({_first_line(err)})"
            ) from err
        return [int(c.item()) for c in gather.codes]

    def _build(self, given: Boundary) -> dict[int, Boundary]:
        if self.fixed is not None:
            expected = self.fixed.get(0)
            if expected is not None and not expected.same_as(given, grads=False):
                raise SetupError(
                    f"the step's inputs are {given.describe()} per microbatch, but the "
                    f"boundaries were given for {expected.describe()}: pass a function of "
                    "a sample microbatch as the boundaries to learn new shapes"
                )
            return {0: given, **self.fixed}  # stage 0's input: so its output is checked too
        assert self.function is not None
        cpu = torch.device("cpu")
        sample = given.rebuild(synthetic(given.tensors, cpu))
        try:
            return {0: given, **normalise_boundaries(self.function(sample))}
        except Exception as err:  # the user's function: reported on every rank, not raised
            text = err.message if isinstance(err, PipeccError) else _first_line(err)
            raise BoundaryFnError(
                f"the boundaries function failed on a sample microbatch {given.describe()}: "
                f"{type(err).__name__}: {text}"
            ) from err

    def _disagreement(self, text: str, codes: list[int]) -> str:
        texts = gather_texts(text, self.group, self.world, self.device)
        lines = [
            f"rank {rank}: {describe_signature(t)}"
            for rank, (c, t) in enumerate(zip(codes, texts, strict=True))
            if c > 0
        ]
        if not lines:
            return "no rank holding stage 0 was given the step's inputs"
        return "the ranks holding stage 0 were given inputs of different shapes:\n  " + (
            "\n  ".join(lines)
        )


def _first_line(err: Exception) -> str:
    return str(err).split("\n")[0][:200]
