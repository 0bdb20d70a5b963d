"""The cost model of the simulator (DESIGN §6): op durations, message latency, sizes.

The keys are keys.py's table, each described in docs/simulate.md "The cost model": the
durations of a stage's ops and actions, its message's latency and size, its sizes for peak
memory in bytes, host times, the bandwidth that turns bytes into time, the groups of stages
that share a parameter (`shared`), and the cut a file was measured on.

Defaults: F=1, B=2, I=1, W=1. Given only B, I = W = B/2; given I and W, B = I + W; given B
and I, W = B - I (measured on this runtime, docs/simulate.md; `dispatch` enters only the
conversion to another cut). A stage override `[cost.stage.N]` applies to stage N of
every pipe (the two pipes of DualPipe hold the same layers at the same stage index).

The convention (docs/simulate.md, DESIGN §6): global costs are per share of the model (1/P).
`CostModel.for_program` turns a model as given into the one stage of a program runs: the
work of a stage (the keys keys.py scales: Scale.OP, WORK and BYTES) is scaled to the
stage's part of the model (P/S shares), each op duration's first `dispatch` excepted; a
message's latency and sizes (Scale.MESSAGE) and host times (Scale.HOST) are not.
A `[cost.stage.N]` table is stage N of that program, used as given; a file that says what
it was measured on (`ranks`, `stages`) is converted to the program's cut where the two
differ. Every command calls it; the simulator and the replay engine take the converted model
(per stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipecc.diagnostics import CostModelError
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Kind,
    Phase,
    PhasePart,
    StageOp,
)
from pipecc.ir.program import Program

from .convert import (
    Cut,
    format_shared,
    ratio,
    recut_rule,
    recut_shared,
    recut_tables,
    scaled,
)
from .keys import BYTE_KEYS, HOST_KEYS, STAGE_KEYS, STAGE_OP_KEYS
from .stage import FilledCost, HostCost, StageCost


def ring_traffic(kind: CollectiveKind, n: int) -> float:
    """Bytes each of n ranks sends per byte of the tensor, in the ring algorithm."""
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind is CollectiveKind.BROADCAST:
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter


@dataclass(frozen=True, slots=True)
class CostModel:
    """Global costs, per-stage overrides, the bandwidth that turns bytes into time, and the
    host overheads."""

    base: StageCost = StageCost()
    stages: tuple[tuple[int, StageCost], ...] = ()
    bandwidth: float | None = None
    unit: str = ""
    host: HostCost = HostCost()
    shared: tuple[tuple[int, ...], ...] = ()
    measured: Cut | None = None  # the cut a file says it was measured on
    applied: Cut | None = None  # the program's cut, once `for_program` has converted it
    origin: str = ""  # the file the costs came from, for messages
    default_scale: float = 1.0  # the defaults F=1, B=2 per share, times this per stage
    given: CostModel | None = field(default=None, compare=False, repr=False)  # before
    _resolved: dict[int, FilledCost] = field(default_factory=dict, compare=False, repr=False)

    def stage(self, stage: int) -> FilledCost:
        """The resolved costs of `stage` (cached)."""
        cached = self._resolved.get(stage)
        if cached is None:
            raw = dict(self.stages).get(stage, StageCost()).over(self.base)
            cached = raw.resolved(self.bandwidth, self.default_scale)
            self._resolved[stage] = cached
        return cached

    def compute(self, op: Compute) -> float:
        cost = self._resolved.get(op.stage) or self.stage(op.stage)
        kind = op.kind
        if kind is Kind.F:
            return cost.F
        if kind is Kind.B:
            return cost.B
        return cost.I if kind is Kind.I else cost.W

    def phase(self, phase: Phase, layers: int) -> float:
        """A MoE phase of an op on a stage of `layers` MoE layers: its part of the op's
        duration by `moe_experts` (docs/simulate.md): each experts phase d·share/K, each of
        the K + 1 others d·(1 − share)/(K + 1)."""
        share = self.stage(phase.op.stage).moe_experts
        if not 0 <= share <= 1:
            raise CostModelError(f"moe_experts={share:g} must be a part of the op, 0..1")
        whole = self.compute(phase.op)
        if phase.part is PhasePart.EXPERTS:
            return whole * share / max(layers, 1)
        return whole * (1 - share) / (max(layers, 1) + 1)

    def stage_op(self, op: StageOp) -> float:
        """UNSHARD, RESHARD, REDUCE_GRAD: their given duration on the stage, else 0."""
        value: float = getattr(self.stage(op.stage), op.kind.value)
        return value

    def names_stage_ops(self) -> bool:
        """Whether a duration is given to UNSHARD, RESHARD or REDUCE_GRAD anywhere."""
        return any(
            getattr(cost, key) is not None
            for cost in (self.base, *(c for _, c in self.stages))
            for key in STAGE_OP_KEYS
        )

    def has_bytes(self) -> bool:
        """Whether any size of a stage is given (for peak memory in bytes, BYTE_KEYS)."""
        return any(
            getattr(cost, key) is not None
            for cost in (self.base, *(c for _, c in self.stages))
            for key in BYTE_KEYS
        )

    def fused(self, op: Fused) -> float:
        """F&B (or F&I): the given FB/FI of the forward's stage, else the two durations added."""
        given = self.stage(op.forward.stage)
        value = given.FB if op.backward.kind is Kind.B else given.FI
        if value is not None:
            return value
        return self.compute(op.forward) + self.compute(op.backward)

    def latency(self, stage: int) -> float:
        """Time for one message named by receiving stage `stage` to arrive."""
        cost = self.stage(stage)
        return cost.comm

    def overhead(self) -> tuple[float, float]:
        """Host time per post and per Wait, (post, wait) (0 where not given)."""
        return (self.host.post or 0.0, self.host.wait or 0.0)

    def collective(self, op: Collective) -> float:
        """A collective's duration: `collective` (its latency), plus its traffic per rank
        (`ring_traffic` of the bytes: its stages' `param_bytes` over its `shards`) over
        `bandwidth` when those sizes are known."""
        latency = self.host.collective or 0.0
        if op.kind is CollectiveKind.ALL_TO_ALL:  # a MoE layer's dispatch or combine
            given = self.stage(op.stages[0]).a2a if op.stages else None
            return latency if given is None else given
        sizes = [self.stage(s).param_bytes for s in op.stages]
        n = len(op.ranks)
        if not self.bandwidth or not sizes or None in sizes or n < 2:
            return latency
        size = sum(x for x in sizes if x is not None) / op.shards
        return latency + ring_traffic(op.kind, n) * size / self.bandwidth

    @property
    def sync(self) -> float:
        """The duplicated-stage gradient sum's time per step (0 where not given)."""
        return self.host.sync or 0.0

    def for_program(self, program: Program) -> CostModel:
        """The costs as `program`'s stages run them: the one conversion every command
        applies (module docstring). A model already converted for this cut is returned as
        it is."""
        return self.for_cut(Cut.of(program))

    def for_cut(self, cut: Cut) -> CostModel:
        """`for_program` for a cut without a program (the search's loop and V cuts).

        Global work is per share of the measured P (the program's where none is given):
        times P/S of the cut. Stage tables are the cut's stages as given; measured on
        another number of stages, they are added or divided over the same part of the
        model. Raises CostModelError for a table naming a stage the cut does not have."""
        if self.applied is not None:
            if (self.applied.ranks, self.applied.stages) != (cut.ranks, cut.stages):
                raise ValueError(f"costs for {self.applied.describe()} applied to {cut}")
            return self
        measured = self.measured
        ranks = measured.ranks if measured is not None else cut.ranks
        factor = ranks / cut.stages
        base = scaled(self.base, factor, self.host.dispatch or 0.0)
        if measured is None or measured.stages == cut.stages:
            self._check_stages(cut)
            stages, shared = self.stages, self.shared
        else:
            tables, fixed = dict(self.stages), self.host.dispatch or 0.0
            stages = recut_tables(tables, self.base, self.bandwidth, fixed, (measured, cut))
            shared = recut_shared(self.shared, measured.stages, cut.stages)
        return replace(
            self,
            base=base,
            stages=stages,
            shared=shared,
            default_scale=factor,
            applied=cut,
            given=self,
            _resolved={},
        )

    def as_stage_costs(self, cut: Cut) -> CostModel:
        """The global costs as one stage's of `cut`, unscaled (compare --per-stage); stage
        tables as given. A file measured on another cut is refused: its figures are for
        that cut's stages."""
        if self.measured is not None and self.measured.stages != cut.stages:
            raise CostModelError(
                f"{self.origin or 'the costs'}: measured on {self.measured.describe()}, so "
                f"per stage they are not {cut.describe()}'s; without --per-stage they are "
                "converted"
            )
        self._check_stages(cut)
        return replace(self, applied=cut, given=self, _resolved={})

    def conversion(self) -> str:
        """What `for_program` did to a measured file, in one line ('' if nothing)."""
        measured, cut = self.measured, self.applied
        if measured is None or cut is None:
            return ""
        if (measured.ranks, measured.stages) == (cut.ranks, cut.stages):
            return ""
        tables = self.given is not None and bool(self.given.stages)
        how = f"; {recut_rule(measured.stages, cut.stages)}" if tables else ""
        if tables and measured.stages == cut.stages:
            how = "; its stage tables name the same stages"
        fixed = self.host.dispatch
        kept = f" (each op's first dispatch={_fmt(fixed)} not scaled)" if fixed else ""
        return (
            f"{self.origin or 'the costs'}: measured on {measured.describe()}, converted for "
            f"{cut.describe()}: [cost] per share of P={measured.ranks}, "
            f"×{ratio(measured.ranks, cut.stages)} per stage{kept}{how}"
        )

    def _check_stages(self, cut: Cut) -> None:
        for stage, _ in self.stages:
            if stage >= cut.stages:
                raise CostModelError(
                    f"{self.origin or '--cost'}: [cost.stage.{stage}] names a stage that "
                    f"{cut.describe()} does not have (stages 0..{cut.stages - 1}); a "
                    "[cost.stage.N] table is stage N of the program it is applied to (a file "
                    "with `ranks` and `stages`, as a profile writes, is converted instead)"
                )

    def overridden_by(self, other: CostModel) -> CostModel:
        """This model with `other`'s global values where `other` gives them."""
        return CostModel(
            base=other.base.over(self.base),
            stages=self.stages,
            bandwidth=other.bandwidth if other.bandwidth is not None else self.bandwidth,
            unit=other.unit or self.unit,
            host=other.host.over(self.host),
            shared=other.shared or self.shared,
            measured=self.measured,
            origin=self.origin,
        )

    def describe(self) -> str:
        """One line: the global costs as given, and what stage 0 runs (for report headers);
        'per share' with the stage's figures where the conversion changed them."""
        resolved = self.stage(0)
        figures = (
            f"F={_fmt(resolved.F)}, B={_fmt(resolved.B)}, I={_fmt(resolved.I)}, "
            f"W={_fmt(resolved.W)}, comm={_fmt(resolved.comm)}"
        )
        source, cut = self.given, self.applied
        if source is None or cut is None:
            return f"{self._given()} ({figures})"
        unchanged = source.measured is None and cut.ranks == cut.stages
        if unchanged:
            return f"{source._given()} ({figures})"
        return f"{source._given()} per share (a stage of {cut.stages}: {figures})"

    def _given(self) -> str:
        given = [
            f"{k}={_fmt(getattr(self.base, k))}"
            for k in STAGE_KEYS
            if getattr(self.base, k) is not None and (k not in BYTE_KEYS or k == "act_bytes")
        ]
        if self.bandwidth is not None:
            given.append(f"bandwidth={_fmt(self.bandwidth)}")
        given += [
            f"{key}={_fmt(value)}"
            for key in HOST_KEYS
            if (value := getattr(self.host, key)) is not None
        ]
        if self.shared:
            given.append(f"shared={format_shared(self.shared)}")
        return ", ".join(given) if given else "defaults"


def _fmt(value: float) -> str:
    return f"{value:g}"
