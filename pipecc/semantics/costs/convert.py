"""Conversion of costs between cuts of the model (docs/simulate.md "The cost convention"):
`Cut`, the scaling of a stage's work to its part of the model, and the recut of a file's
stage tables measured on another number of stages. Which key scales how is keys.py's
`Scale`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipecc.ir.program import Program

from .keys import MESSAGE_KEYS, OP_KEYS, STAGE_OP_KEYS, WORK_KEYS
from .stage import FilledCost, StageCost


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
        return cls(
            ranks=program.pipeline_ranks, stages=placement.num_stages(0), placement=placement.name
        )

    @property
    def shares(self) -> float:
        """How many shares (1/P of the model) one stage holds: P/S."""
        return self.ranks / self.stages

    def describe(self) -> str:
        name = f"{self.placement} " if self.placement else ""
        return f"{name}P={self.ranks} ({self.stages} stages)"


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


def scaled(cost: StageCost, factor: float, fixed: float = 0.0) -> StageCost:
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


def recut_tables(
    tables: dict[int, StageCost],
    base: StageCost,
    bandwidth: float | None,
    fixed: float,
    cuts: tuple[Cut, Cut],
) -> tuple[tuple[int, StageCost], ...]:
    """The stage tables of a file measured on `cuts[0]` (`base` its [cost], `fixed` its
    `dispatch`), for the stages of `cuts[1]`."""
    measured, cut = cuts
    if not tables:
        return ()
    factor = measured.ranks / measured.stages
    base = scaled(base, factor, fixed)
    raw = [tables.get(j, StageCost()).over(base) for j in range(measured.stages)]
    done = [cost.resolved(bandwidth, factor) for cost in raw]
    return tuple(
        (s, _recut_stage(raw, done, s, (measured.stages, cut.stages), fixed))
        for s in range(cut.stages)
    )


def _recut_stage(
    raw: list[StageCost],
    done: list[FilledCost],
    stage: int,
    cuts: tuple[int, int],
    fixed: float,
) -> StageCost:
    """Stage `stage` of `cuts` = (measured, stages) from the measured stages: each measured
    stage's work weighted by the part of it that lies in this stage (of a compute duration,
    the part above `fixed`: the instruction pays its fixed host time once); the message keys
    (latency and sizes) of the measured stage where this one begins (its messages cross that
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
    messages = {key: getattr(first, key) for key in MESSAGE_KEYS}
    return replace(StageCost(), **messages, **work)


def recut_rule(measured: int, stages: int) -> str:
    """How stage s of `stages` is made of the `measured` stages, in words."""
    if measured % stages == 0:
        k = measured // stages
        return f"stage s = measured stages {k}s..{k}s+{k - 1} added"
    if stages % measured == 0:
        k = stages // measured
        return f"stage s = 1/{k} of measured stage s//{k}"
    return "each stage = the measured stages' work over the same part of the model"


def _weighted(
    done: list[FilledCost], weights: list[tuple[int, float]], key: str, fixed: float
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


def recut_shared(
    groups: tuple[tuple[int, ...], ...], measured: int, stages: int
) -> tuple[tuple[int, ...], ...]:
    """`shared` groups of measured stages as the stages of the new cut that hold them."""
    mapped = (tuple(sorted({s * stages // measured for s in group})) for group in groups)
    return tuple(sorted(group for group in mapped if len(group) > 1))


def format_shared(groups: tuple[tuple[int, ...], ...]) -> str:
    """`((0, 7), (1, 6))` → `0+7/1+6`, the command-line form of `shared`."""
    return "/".join("+".join(str(stage) for stage in group) for group in groups)
