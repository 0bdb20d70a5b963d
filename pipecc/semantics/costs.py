"""The cost model of the simulator (DESIGN §6): op durations, message latency, sizes.

Keys (the same on the command line, `--cost F=1,B=2,comm=0.1`, and in a TOML file under
`[cost]`, with per-stage overrides under `[cost.stage.N]`):

    F, B, I, W    durations of a forward, full backward, input-gradient and weight-gradient op
    FB, FI        duration of a fused F&B / F&I instruction (default F + B / F + I: no overlap
                  benefit unless the user says so)
    comm          latency of one message: from the moment a transfer can start to the data
                  being at the receiver (not busy time on either rank)
    bytes         size of one message (with `bandwidth`, adds bytes / bandwidth to `comm`)
    bandwidth     bytes per time unit (global only)
    act_bytes     bytes of one microbatch's activations of a stage: what its F keeps for the
                  backward (for peak memory in bytes; docs/simulate.md "Memory in bytes")
    param_bytes   bytes of a stage's parameters (its gradients are as large): what a
                  collective carrying the stage moves (FSDP's all_gather and reduce_scatter,
                  the data-parallel all_reduce, the shared-parameter sum), with `bandwidth`;
                  and the parameters' part of peak memory in bytes
    act_bytes_w, grad_bytes, grad_bytes_w, optim_bytes, sharded_param_bytes,
    unsharded_param_bytes, workspace_F, workspace_B, workspace_I, workspace_W, workspace_sum
                  the other sizes of a stage for peak memory in bytes
                  (`pipecc.analysis.memory` states the rule)
    out_bytes     of a forward's output, the bytes its stage does not keep for the backward
                  (a recomputed stage's): held as the outgoing message until its send
                  completes (a message's size, as `bytes`: not scaled by share)
    UNSHARD, RESHARD, REDUCE_GRAD
                  durations of torch's per-stage actions, where a program holds them (a torch
                  CSV's; docs/interop.md); 0 unless given
    post          host time a rank spends posting one send or receive (global only; 0)
    wait          host time a rank spends in a wait after it is released (global only; 0)
    dispatch      host time of every compute instruction that does not grow with the layers
                  of its stage (the runtime's bookkeeping around the user's module, autograd's
                  start): the part of a given F, B, I, W, FB or FI up to `dispatch` is not
                  scaled by the conversion below, the rest is (global only; 0: all scales)
    sync          time of the gradient sum of parameters held by several ranks at the end of
                  a step: duplicated stages (DualPipe) and shared weights whose stages lie on
                  different ranks (`shared`); added to the step, not to the program's
                  makespan (global only; 0)
    collective    latency of one collective instruction: from the moment its last member is
                  ready to its completion on every member (global only; 0). With
                  `param_bytes` and `bandwidth`, a collective over n ranks carrying B bytes
                  (the param_bytes of its stages, divided by its `shards`) adds the ring
                  algorithm's traffic per rank over the bandwidth: all_reduce 2(n-1)/n·B,
                  all_gather and reduce_scatter (n-1)/n·B, broadcast B. A program that holds
                  its gradient sums pays this, not `sync`
    shared        groups of stages that hold one parameter (tied embeddings: the first and
                  the last stage), `shared = [[0, 7]]` in a file, `shared=0+7` on the
                  command line (groups separated by `/`); a program sums such a group's
                  gradients, and so pays `sync`, when its placement puts the group's stages
                  on more than one rank (global only; `pipecc run --profile` writes it)
    a2a           time of one expert-parallel all_to_all (one dispatch or combine of one MoE
                  layer for one microbatch, forward or backward), from its last member's
                  readiness to its completion (default: `collective`); not scaled
    moe_experts   the part (0..1) of a MoE stage's F, B and I that its experts compute
                  (default 0.5): of an op's duration d on a stage of K MoE layers, each
                  experts phase takes d·moe_experts/K and each of the K + 1 others (pre0..,
                  post) d·(1 - moe_experts)/(K + 1); a fused op of MoE stages is its phases
    moe_layers    the MoE layers of a stage (a `[cost.stage.N]` value over --moe K)
    unit          the name of the time unit, for display ("ms" in files the runtime writes)
    placement, ranks, stages
                  the cut a file's costs were measured on (a file only; `pipecc run --profile`
                  writes them): its placement's name, its P and its stages per pipe S

Defaults: F=1, B=2, I=1, W=1. Given only B, I = W = B/2; given I and W, B = I + W; given B
and I, W = B - I (measured on this runtime, docs/simulate.md; `dispatch` enters only the
conversion to another cut). A stage override `[cost.stage.N]` applies to stage N of
every pipe (the two pipes of DualPipe hold the same layers at the same stage index).

The convention (docs/simulate.md, DESIGN §6): global costs are per share of the model (1/P).
`CostModel.for_program` turns a model as given into the one stage of a program runs: the
work of a stage (F, B, I, W, FB, FI, UNSHARD, RESHARD, REDUCE_GRAD, BYTE_KEYS) is scaled to
the stage's part of the model (P/S shares), each duration's first `dispatch` excepted; a
message's latency and size (comm, bytes) and host time (post, wait, sync, dispatch) are not.
A `[cost.stage.N]` table is stage N of that program, used as given; a file that says what
it was measured on (`ranks`, `stages`) is converted to the program's cut where the two
differ. Every command calls it; the simulator and the replay engine take the converted model
(per stage).
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from pipecc.diagnostics import CostModelError
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Kind,
    Phase,
    PhasePart,
    Send,
    Sequential,
    StageOp,
)
from pipecc.ir.program import Program


# the bytes each rank sends per byte of the tensor, in the ring algorithm over n ranks
def ring_traffic(kind: CollectiveKind, n: int) -> float:
    """Bytes each of n ranks sends per byte of the tensor, in the ring algorithm."""
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind is CollectiveKind.BROADCAST:
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter


# torch's per-stage actions (docs/interop.md): 0 unless given
STAGE_OP_KEYS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")

# the sizes of a stage for peak memory in bytes (pipecc.analysis.memory; `act_bytes` first)
BYTE_KEYS = (
    "act_bytes",
    "act_bytes_w",
    "param_bytes",
    "grad_bytes",
    "grad_bytes_w",
    "optim_bytes",
    "sharded_param_bytes",
    "unsharded_param_bytes",
    "workspace_F",
    "workspace_B",
    "workspace_I",
    "workspace_W",
    "workspace_sum",
)
# `out_bytes` is a message's size, as `bytes` (neither scales with a stage's part of the model)
# a MoE stage's (pipecc/passes/expand_moe.py): not scaled with a stage's part of the model
MOE_KEYS = ("a2a", "moe_experts", "moe_layers")
DURATION_KEYS = (
    "F", "B", "I", "W", "FB", "FI", "comm", "bytes", "out_bytes", *BYTE_KEYS, *STAGE_OP_KEYS,
    *MOE_KEYS,
)  # fmt: skip
# global only: host time, sync, collectives
HOST_KEYS = ("post", "wait", "sync", "collective", "dispatch")
CUT_KEYS = ("placement", "ranks", "stages")  # what a file was measured on (a file only)
GLOBAL_KEYS = (*DURATION_KEYS, "bandwidth", *HOST_KEYS, "shared", "unit", *CUT_KEYS)
# the work of one stage: scaled to the stage's part of the model (module docstring)
WORK_KEYS = ("F", "B", "I", "W", "FB", "FI", *STAGE_OP_KEYS, *BYTE_KEYS)
# the durations of compute instructions: of these, the part up to `dispatch` is not scaled
OP_KEYS = ("F", "B", "I", "W", "FB", "FI")


@dataclass(frozen=True, slots=True)
class Cut:
    """How a program cuts the model: P ranks, S stages per pipe (each stage P/S shares of
    the model, a share being 1/P of it), and the placement's name (for messages)."""

    ranks: int
    stages: int
    placement: str = ""

    @classmethod
    def of(cls, program: Program) -> Cut:
        """The cut of `program` (pipe 0's stages: DualPipe's two pipes hold the same ones)."""
        placement = program.placement
        return cls(program.pipeline_ranks, placement.num_stages(0), placement.name)

    @property
    def shares(self) -> float:
        """How many shares (1/P of the model) one stage holds: P/S."""
        return self.ranks / self.stages

    def describe(self) -> str:
        name = f"{self.placement} " if self.placement else ""
        return f"{name}P={self.ranks} ({self.stages} stages)"


@dataclass(frozen=True, slots=True)
class StageCost:
    """Durations and sizes for one stage (None: not given, derived or defaulted)."""

    F: float | None = None
    B: float | None = None
    I: float | None = None  # noqa: E741
    W: float | None = None
    FB: float | None = None
    FI: float | None = None
    comm: float | None = None
    bytes: float | None = None
    act_bytes: float | None = None
    UNSHARD: float | None = None
    RESHARD: float | None = None
    REDUCE_GRAD: float | None = None
    act_bytes_w: float | None = None
    param_bytes: float | None = None
    grad_bytes: float | None = None
    grad_bytes_w: float | None = None
    optim_bytes: float | None = None
    sharded_param_bytes: float | None = None
    unsharded_param_bytes: float | None = None
    workspace_F: float | None = None
    workspace_B: float | None = None
    workspace_I: float | None = None
    workspace_W: float | None = None
    workspace_sum: float | None = None
    out_bytes: float | None = None
    a2a: float | None = None
    moe_experts: float | None = None
    moe_layers: float | None = None

    def over(self, base: StageCost) -> StageCost:
        """This stage's values where given, `base`'s elsewhere."""
        merged = {key: getattr(self, key) for key in DURATION_KEYS}
        return replace(base, **{k: v for k, v in merged.items() if v is not None})


@dataclass(frozen=True, slots=True)
class ResolvedCost:
    """Every duration of one stage, defaults and derivations applied."""

    F: float
    B: float
    I: float  # noqa: E741
    W: float
    FB: float | None
    FI: float | None
    comm: float
    bytes: float | None
    act_bytes: float | None
    UNSHARD: float = 0.0
    RESHARD: float = 0.0
    REDUCE_GRAD: float = 0.0
    act_bytes_w: float | None = None
    param_bytes: float | None = None
    grad_bytes: float | None = None
    grad_bytes_w: float | None = None
    optim_bytes: float | None = None
    sharded_param_bytes: float | None = None
    unsharded_param_bytes: float | None = None
    workspace_F: float | None = None
    workspace_B: float | None = None
    workspace_I: float | None = None
    workspace_W: float | None = None
    workspace_sum: float | None = None
    out_bytes: float | None = None
    a2a: float | None = None
    moe_experts: float = 0.5
    moe_layers: float | None = None


@dataclass(frozen=True, slots=True)
class HostCost:
    """Time outside the transfers and compute ops (None: not given, 0).

    `post`: host time a rank spends posting each Send/Recv (the op, or its group, is posted
    at the end of it); `wait`: host time after each Wait's release; `sync`: the
    duplicated-stage gradient sum after the program, once per step; `dispatch`: the part of
    each compute instruction's duration that does not scale with its stage's share.
    """

    post: float | None = None
    wait: float | None = None
    sync: float | None = None
    collective: float | None = None  # one collective instruction's duration
    dispatch: float | None = None  # the fixed part of every compute instruction

    def over(self, base: HostCost) -> HostCost:
        """This one's values where given, `base`'s elsewhere."""
        return HostCost(
            self.post if self.post is not None else base.post,
            self.wait if self.wait is not None else base.wait,
            self.sync if self.sync is not None else base.sync,
            self.collective if self.collective is not None else base.collective,
            self.dispatch if self.dispatch is not None else base.dispatch,
        )


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
    _resolved: dict[int, ResolvedCost] = field(default_factory=dict, compare=False, repr=False)

    def stage(self, stage: int) -> ResolvedCost:
        """The resolved costs of `stage` (cached)."""
        cached = self._resolved.get(stage)
        if cached is None:
            raw = dict(self.stages).get(stage, StageCost()).over(self.base)
            cached = _resolve(raw, self.bandwidth, self.default_scale)
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
        duration by `moe_experts` (the module docstring)."""
        share = self.stage(phase.op.stage).moe_experts
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
        """A collective's duration: `collective` (its latency), plus its traffic per rank over
        `bandwidth` when its stages' `param_bytes` are known (the module docstring)."""
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
        base = _scaled(self.base, factor, self.host.dispatch or 0.0)
        if measured is None or measured.stages == cut.stages:
            self._check_stages(cut)
            stages, shared = self.stages, self.shared
        else:
            stages = self._recut(measured, cut)
            shared = _recut_shared(self.shared, measured.stages, cut.stages)
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
        how = f"; {_recut_rule(measured.stages, cut.stages)}" if tables else ""
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

    def _recut(self, measured: Cut, cut: Cut) -> tuple[tuple[int, StageCost], ...]:
        """The stage tables of a file measured on `measured`, for the stages of `cut`."""
        if not self.stages:
            return ()
        factor = measured.ranks / measured.stages
        fixed = self.host.dispatch or 0.0
        base = _scaled(self.base, factor, fixed)
        tables = dict(self.stages)
        raw = [tables.get(j, StageCost()).over(base) for j in range(measured.stages)]
        done = [_resolve(cost, self.bandwidth, factor) for cost in raw]
        return tuple(
            (s, _recut_stage(raw, done, s, (measured.stages, cut.stages), fixed))
            for s in range(cut.stages)
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
            for k in DURATION_KEYS
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


def ratio(numerator: int, denominator: int) -> str:
    """`2/4` → `1/2`, `4/4` → `1`: a scale factor as a fraction."""
    divisor = math.gcd(numerator, denominator)
    top, bottom = numerator // divisor, denominator // divisor
    return str(top) if bottom == 1 else f"{top}/{bottom}"


def scale_duration(value: float, factor: float, fixed: float) -> float:
    """A compute instruction's `value` on a stage `factor` times as large: its first `fixed`
    (`dispatch`, host time per instruction) stays, the rest scales. With `fixed` 0, exactly
    `value * factor`."""
    kept = min(value, fixed)
    return kept + (value - kept) * factor


def _scaled(cost: StageCost, factor: float, fixed: float = 0.0) -> StageCost:
    """The work of one stage multiplied by `factor` (latency and sizes of messages stay; of a
    compute duration, its first `fixed` stays too)."""
    if factor == 1:
        return cost
    values = {key: getattr(cost, key) for key in WORK_KEYS}
    return replace(
        cost,
        **{
            k: scale_duration(v, factor, fixed) if k in OP_KEYS else v * factor
            for k, v in values.items()
            if v is not None
        },
    )


def _recut_stage(
    raw: list[StageCost],
    done: list[ResolvedCost],
    stage: int,
    cuts: tuple[int, int],
    fixed: float,
) -> StageCost:
    """Stage `stage` of `cuts` = (measured, stages) from the measured stages: each measured
    stage's work weighted by the part of it that lies in this stage (of a compute duration,
    the part above `fixed`: the instruction pays its fixed host time once); the latency and
    message size of the measured stage where this one begins (its messages cross that
    boundary)."""
    measured, stages = cuts
    # in units of 1/(measured·stages) of the model: this stage is [stage·measured, +measured),
    # measured stage j is [j·stages, +stages)
    low, high = stage * measured, (stage + 1) * measured
    weights = []
    for j in range(measured):
        overlap = min(high, (j + 1) * stages) - max(low, j * stages)
        if overlap > 0:
            weights.append((j, overlap / stages))
    first = raw[weights[0][0]]
    work = {
        key: _weighted(done, weights, key, fixed if key in OP_KEYS else 0.0) for key in WORK_KEYS
    }
    for key in STAGE_OP_KEYS:  # 0 unless given: given where any measured stage gives it
        if all(getattr(raw[j], key) is None for j, _ in weights):
            work[key] = None
    moe = {key: getattr(first, key) for key in MOE_KEYS}
    return StageCost(**work, comm=first.comm, bytes=first.bytes, **moe)


def _recut_rule(measured: int, stages: int) -> str:
    """How stage s of `stages` is made of the `measured` stages, in words."""
    if measured % stages == 0:
        k = measured // stages
        return f"stage s = measured stages {k}s..{k}s+{k - 1} added"
    if stages % measured == 0:
        k = stages // measured
        return f"stage s = 1/{k} of measured stage s//{k}"
    return "each stage = the measured stages' work over the same part of the model"


def _weighted(
    done: list[ResolvedCost], weights: list[tuple[int, float]], key: str, fixed: float
) -> float | None:
    """Σ weight · `key` of the weighted stages, each value's first `fixed` counted once (the
    largest of them) instead; None where one of them has no value."""
    total, kept = 0.0, 0.0
    for j, weight in weights:
        value: float | None = getattr(done[j], key)
        if value is None:
            return None
        part = min(value, fixed)
        kept = max(kept, part)
        total += (value - part) * weight
    return kept + total


def _recut_shared(
    groups: tuple[tuple[int, ...], ...], measured: int, stages: int
) -> tuple[tuple[int, ...], ...]:
    """`shared` groups of measured stages as the stages of the new cut that hold them."""
    mapped = (tuple(sorted({s * stages // measured for s in group})) for group in groups)
    return tuple(sorted(group for group in mapped if len(group) > 1))


def format_shared(groups: tuple[tuple[int, ...], ...]) -> str:
    """`((0, 7), (1, 6))` → `0+7/1+6`, the command-line form of `shared`."""
    return "/".join("+".join(str(stage) for stage in group) for group in groups)


def _resolve(cost: StageCost, bandwidth: float | None, scale: float = 1.0) -> ResolvedCost:
    """Defaults and derivations applied; the defaults F=1 and B=2 are per share, times
    `scale` (a converted model's shares per stage). A derived duration is a plain sum or
    half: B = I + W, I = W = B / 2 (`dispatch` enters the conversion of a given duration to
    another cut, not these; docs/simulate.md says what was measured)."""
    F = cost.F if cost.F is not None else scale
    B, I, W = cost.B, cost.I, cost.W  # noqa: E741
    if B is None and I is not None and W is not None:
        B = I + W
    if B is None and I is None and W is None:
        B = 2.0 * scale
    elif B is None:  # one half given: the other the same
        B = 2 * (I or W or 1.0)
    if I is None and W is None:
        I = W = B / 2  # noqa: E741
    elif I is None:
        assert W is not None  # the first branch took both None
        I = B - W  # noqa: E741
    elif W is None:
        W = B - I
    assert I is not None and W is not None  # every branch above set both
    if I < 0 or W < 0:
        raise CostModelError(f"B={B:g} is less than its given half (I={I:g}, W={W:g})")
    comm = cost.comm or 0.0
    if cost.bytes is not None and bandwidth:
        comm += cost.bytes / bandwidth
    return ResolvedCost(
        F,
        B,
        I,
        W,
        cost.FB,
        cost.FI,
        comm,
        cost.bytes,
        cost.act_bytes,
        cost.UNSHARD or 0.0,
        cost.RESHARD or 0.0,
        cost.REDUCE_GRAD or 0.0,
        **{key: getattr(cost, key) for key in BYTE_KEYS[1:]},
        out_bytes=cost.out_bytes,
        **_moe(cost),
    )


def _moe(cost: StageCost) -> dict[str, Any]:
    """The MoE keys of a stage, checked: moe_experts a part of 1, moe_layers a count."""
    experts = 0.5 if cost.moe_experts is None else cost.moe_experts
    if experts > 1:
        raise CostModelError(f"moe_experts={experts:g} must be a part of the op, 0..1")
    layers = cost.moe_layers
    if layers is not None and layers != int(layers):
        raise CostModelError(f"moe_layers={layers:g} must be a whole number of layers")
    return {"a2a": cost.a2a, "moe_experts": experts, "moe_layers": layers}


@dataclass(frozen=True, slots=True)
class CostTiming:
    """A cost model as the replay engine's `Timing` (pipecc.semantics): how long each compute
    instruction runs, each message's latency, and the host time of posts and waits."""

    costs: CostModel
    moe: tuple[int, ...] | None = None  # the program's MoE layers per stage (its phases')
    # durations by (kind, stage) or (kind, stage, kind, stage): a program of 10⁶ instructions
    # has a few dozen distinct ones
    _known: dict[tuple[object, ...], float] = field(default_factory=dict, compare=False)

    def duration(
        self, rank: int, index: int, instr: Compute | Fused | Sequential | StageOp | Phase
    ) -> float:
        return self.op_duration(instr)

    def op_duration(self, instr: Compute | Fused | Sequential | StageOp | Phase) -> float:
        if isinstance(instr, StageOp):
            return self.costs.stage_op(instr)
        if isinstance(instr, Phase):
            moe, stage = self.moe or (), instr.op.stage
            return self.costs.phase(instr, moe[stage] if stage < len(moe) else 1)
        if isinstance(instr, Sequential):  # its parts one after another
            return sum(self._compute_duration(op) for op in instr.parts)
        return self._compute_duration(instr)

    def _compute_duration(self, instr: Compute | Fused) -> float:
        if type(instr) is Compute:
            key: tuple[object, ...] = (instr.kind, instr.stage)
            value = self._known.get(key)
            if value is None:
                value = self._known[key] = self.costs.compute(instr)
            return value
        fused = cast(Fused, instr)
        f, b = fused.forward, fused.backward
        key = (f.kind, f.stage, b.kind, b.stage)
        value = self._known.get(key)
        if value is None:
            value = self._known[key] = self.costs.fused(fused)
        return value

    def latency(self, rank: int, index: int, send: Send) -> float:
        return self.costs.latency(send.stage)

    def collective(self, rank: int, index: int, op: Collective) -> float:
        return self.costs.collective(op)

    def overhead(self, rank: int) -> tuple[float, float]:
        return self.costs.overhead()


# ---- parsing -------------------------------------------------------------------------------


def _number(key: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise CostModelError(f"{where}: {key} must be a number, got {value!r}") from None
    if not math.isfinite(value) or value < 0:
        raise CostModelError(f"{where}: {key} must be a finite number ≥ 0, got {value}")
    return float(value)


def _check_key(key: str, known: tuple[str, ...], where: str) -> None:
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise CostModelError(f"{where}: unknown cost key '{key}' (known: {', '.join(known)}){hint}")


def _stage_cost(values: dict[str, Any], where: str, *, known: tuple[str, ...]) -> StageCost:
    fields = {}
    for key, value in values.items():
        if key in GLOBAL_KEYS and key not in known:
            raise CostModelError(f"{where}: '{key}' is global only: give it under [cost]")
        _check_key(key, known, where)
        fields[key] = _number(key, value, where)
    return StageCost(**fields)


def parse_cost_flag(text: str) -> CostModel:
    """`F=1,B=2,I=1,W=1,FB=2.5,comm=0.1` → CostModel (global values only)."""
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise CostModelError(f"--cost: expected KEY=VALUE, got {item!r}")
        values[key.strip()] = value.strip()
    return _model(values, {}, "--cost")


def load_cost_file(path: str | Path) -> CostModel:
    """A TOML cost file: `[cost]` with global keys, `[cost.stage.N]` with overrides."""
    where = str(path)
    try:
        text = Path(path).read_text("utf-8")
    except FileNotFoundError:
        raise CostModelError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CostModelError(f"{where}: cannot read: {err}") from None
    return parse_cost_text(text, where)


def parse_cost_text(text: str, where: str) -> CostModel:
    """The text of a TOML cost file; `where` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CostModelError(f"{where}: malformed TOML: {err}") from None
    cost = data.get("cost")
    if not isinstance(cost, dict):
        raise CostModelError(f"{where}: expected a [cost] table")
    stages = cost.get("stage", {})
    values = {k: v for k, v in cost.items() if k != "stage"}
    return _model(values, stages, where)


def _model(values: dict[str, Any], stages: Any, where: str) -> CostModel:
    unit = str(values.pop("unit", ""))
    measured = _measured(values, where)
    shared = _shared(values.pop("shared"), where) if "shared" in values else ()
    bandwidth = values.pop("bandwidth", None)
    host = HostCost(
        **{key: _number(key, values.pop(key), where) for key in HOST_KEYS if key in values}
    )
    base = _stage_cost(values, where, known=GLOBAL_KEYS)
    if not isinstance(stages, dict):
        raise CostModelError(f"{where}: [cost.stage] must hold tables [cost.stage.N]")
    overrides = []
    for name, table in sorted(stages.items(), key=lambda item: str(item[0])):
        if not str(name).isdigit() or not isinstance(table, dict):
            raise CostModelError(f"{where}: [cost.stage.{name}]: N must be a stage number")
        table_where = f"{where} [cost.stage.{name}]"
        overrides.append((int(name), _stage_cost(table, table_where, known=DURATION_KEYS)))
    model = CostModel(
        base=base,
        stages=tuple(sorted(overrides)),
        bandwidth=_number("bandwidth", bandwidth, where) if bandwidth is not None else None,
        unit=unit,
        host=host,
        shared=shared,
        measured=measured,
        origin="" if where == "--cost" else where,
    )
    if measured is not None:
        model._check_stages(measured)
    model.stage(0)  # resolve once, so inconsistent values fail here with the file's name
    for stage, _ in overrides:
        model.stage(stage)
    return model


def _measured(values: dict[str, Any], where: str) -> Cut | None:
    """`placement`, `ranks`, `stages`: the cut a file was measured on (popped from
    `values`); `ranks` and `stages` come together, `placement` is its name."""
    given = {key: values.pop(key) for key in CUT_KEYS if key in values}
    if not given:
        return None
    if where == "--cost":
        raise CostModelError(
            f"--cost: {', '.join(given)}: what costs were measured on is given in a cost file only"
        )
    if "ranks" not in given or "stages" not in given:
        raise CostModelError(
            f"{where}: give ranks and stages together (the P and the stages per pipe the "
            "costs were measured on)"
        )
    sizes = []
    for key in ("ranks", "stages"):
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CostModelError(f"{where}: {key} must be a positive integer, got {value!r}")
        sizes.append(value)
    placement = given.get("placement", "")
    if not isinstance(placement, str):
        raise CostModelError(f"{where}: placement must be a name, got {placement!r}")
    return Cut(sizes[0], sizes[1], placement)


def _shared(value: Any, where: str) -> tuple[tuple[int, ...], ...]:
    """`shared`: a list of groups of two or more distinct stage numbers (a file's
    `[[0, 7]]`, or the command line's `0+7/1+6`)."""
    if isinstance(value, str):
        try:
            value = [[int(s) for s in group.split("+")] for group in value.split("/")]
        except ValueError:
            raise CostModelError(
                f"{where}: shared must be groups of stage numbers like 0+7 or 0+7/1+6, "
                f"got {value!r}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(group, list) for group in value):
        raise CostModelError(
            f"{where}: shared must be a list of groups of stage numbers, e.g. [[0, 7]]"
        )
    groups = []
    for group in value:
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in group):
            raise CostModelError(f"{where}: shared: {group!r} must hold stage numbers ≥ 0")
        if len(set(group)) < 2:
            raise CostModelError(
                f"{where}: shared: {group!r} must name two or more different stages"
            )
        groups.append(tuple(sorted(set(group))))
    return tuple(sorted(groups))
