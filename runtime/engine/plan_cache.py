"""The one owner of what each shape signature needs: its boundaries, receive specs and plans.

A signature (runtime/boundaries/signatures.py) is learned once, with every rank, on real data
(runtime/boundaries/discovery.py); from then on everything about it lives here: its
boundaries (`{stage: Boundary}` of one microbatch), the receive specs they give this rank
(runtime/plan/binding.py), and its training and forward-only plans bound into steps
(runtime/engine/bound.py), which hold the receive buffers. One eviction rule: the bound plans
of the `kept` most recently used signatures stay; the others are let go with their buffers
(variable-length batches would otherwise hold a set for every length ever seen), and a
signature that comes back is bound again, locally, from the boundaries and specs kept here
(they are small, and learning them again would need every rank).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipecc.ir.ops import Msg
from pipecc.ir.program import Program

from ..boundaries.specs import Specs
from ..boundaries.trees import Boundary
from ..plan.binding import recv_specs
from ..plan.plan import Plan
from .bound import Binder
from .steps import Bound

RecvSpecs = Mapping[tuple[Msg, int, int], Specs]


class SignaturePlans:
    """One signature's boundaries and receive specs, and its bound plans while kept."""

    __slots__ = ("boundaries", "forward", "specs", "train")

    def __init__(self, boundaries: dict[int, Boundary], specs: RecvSpecs) -> None:
        self.boundaries = boundaries
        self.specs = specs
        self.train: Bound | None = None
        self.forward: Bound | None = None


class PlanCache:
    """Every signature this runtime has learned, the one in use (`code`, 0 before the first
    step), and the bound plans of the most recently used ones (module docstring)."""

    def __init__(
        self, binder: Binder, plans: tuple[Plan, Plan], program: Program, rank: int, *, kept: int
    ) -> None:
        self.binder = binder
        self.plans = plans  # this rank's training and forward-only plans, unbound
        self.program = program
        self.rank = rank
        self.kept = max(kept, 1)
        self.code = 0
        self._entries: dict[int, SignaturePlans] = {}  # least recently used first

    def known(self, code: int) -> bool:
        """Whether the signature `code` was learned."""
        return code in self._entries

    def learn(self, code: int, boundaries: dict[int, Boundary]) -> None:
        """A new signature's boundaries, found with every rank; it becomes the one in use."""
        specs = recv_specs(self.program, self.rank, boundaries)
        self._entries[code] = SignaturePlans(boundaries, specs)
        self.use(code)

    def use(self, code: int) -> None:
        """Switch to a learned signature, binding its plans if they were let go."""
        entry = self._entries.pop(code)  # re-inserted last: the most recently used
        self._entries[code] = entry
        self.code = code
        if entry.train is None:
            entry.train, entry.forward = self.binder.bind(self.plans, entry.boundaries, entry.specs)
        bound = [e for e in self._entries.values() if e.train is not None]
        for old in bound[: max(len(bound) - self.kept, 0)]:
            old.train = old.forward = None

    @property
    def current(self) -> SignaturePlans:
        """The signature in use (the runtime settles one before any step runs)."""
        return self._entries[self.code]

    def boundaries(self) -> dict[int, Boundary]:
        """The boundaries of the signature in use (empty before the first step)."""
        entry = self._entries.get(self.code)
        return dict(entry.boundaries) if entry is not None else {}

    def bound(self, training: bool) -> Bound:
        """The plan in use for a training or a forward-only step."""
        entry = self.current
        found = entry.train if training else entry.forward
        assert found is not None  # `use` bound it
        return found
