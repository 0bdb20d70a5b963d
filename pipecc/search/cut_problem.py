"""A cut of the layers as a search problem: its stages' durations and bytes (`Setting`: the
profile, the cap and the search's sizes), the order search's `Problem` of a cut
(`cut_problem`) and the peaks a program of it reaches (`memory_peaks`). The search over cuts
(pipecc/search/partition.py) builds on these; its module docstring states the rules."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipecc.analysis.memory import activation_peak_bytes
from pipecc.ir.ops import Compute, Instr, Kind, computations, is_compute
from pipecc.ir.program import Program
from pipecc.search.layers import Cut, Profile
from pipecc.search.problem import Problem


def num_stages(ranks: int, placement: str) -> int:
    return ranks if placement == "loop" else 2 * ranks


def rank_of(ranks: int, placement: str, stage: int) -> int:
    """The rank of `stage` (loop: stage s on rank s; V: s < P on rank s, else 2P-1-s)."""
    if placement == "loop" or stage < ranks:
        return stage
    return 2 * ranks - 1 - stage


class StageBytes(NamedTuple):
    """What one stage's ops change in bytes, and what its rank holds all step for it."""

    kept_f: float  # an F keeps this until its W
    added_i: float  # a recomputed stage's I brings back the rest
    act: float  # a W frees this (kept_f + added_i)
    static: float


def stage_bytes(profile: Profile, cut: Cut, stage: int) -> StageBytes:
    layers = [profile.layers[n] for n in cut.span(stage)]
    act = sum(layer.act_bytes for layer in layers)
    static = sum(layer.static_bytes for layer in layers)
    if cut.recompute[stage]:
        kept = min(act, layers[0].input_bytes or 0.0)
        return StageBytes(kept, act - kept, act, static)
    return StageBytes(act, 0.0, act, static)


def can_recompute(profile: Profile, cut: Cut, stage: int) -> bool:
    """Recomputing keeps the first layer's input_bytes: only where the profile gives it."""
    return profile.layers[cut.starts[stage]].input_bytes is not None


@dataclass(frozen=True, slots=True)
class Setting:
    """What the search holds fixed: sizes, placement, the byte cap (None: no cap)."""

    profile: Profile
    ranks: int
    microbatches: int
    placement: str
    cap: float | None

    @property
    def stages(self) -> int:
        return num_stages(self.ranks, self.placement)

    def static(self, cut: Cut) -> list[float]:
        """Per rank: its stages' parameters, gradients and optimizer state."""
        held = [0.0] * self.ranks
        for stage in range(cut.stages):
            held[rank_of(self.ranks, self.placement, stage)] += stage_bytes(
                self.profile, cut, stage
            ).static
        return held


def stage_durations(profile: Profile, cut: Cut) -> tuple[tuple[float, float, float], ...]:
    """Per stage (F, I, W): sums of its layers' (F with the profile's `F_fixed`, the
    stage's own work per F); a recomputed stage's I runs its F first."""
    out = []
    for stage in range(cut.stages):
        layers = [profile.layers[n] for n in cut.span(stage)]
        f = sum(layer.F for layer in layers) + profile.F_fixed
        i = sum(layer.I for layer in layers) + (f if cut.recompute[stage] else 0.0)
        out.append((f, i, sum(layer.W for layer in layers)))
    return tuple(out)


def cut_problem(setting: Setting, cut: Cut) -> Problem | None:
    """The order-search problem of `cut` (module docstring); None when some rank's static
    bytes alone exceed the cap."""
    durations = stage_durations(setting.profile, cut)
    f, i, w = (tuple(d[k] for d in durations) for k in range(3))
    stages = cut.stages
    if setting.cap is None:
        units = (1.0,) * stages, (0.0,) * stages, (-1.0,) * stages
        cap = float(stages * setting.microbatches)
    else:
        room = [setting.cap - held for held in setting.static(cut)]
        if min(room) <= 0:
            return None
        sizes = [stage_bytes(setting.profile, cut, s) for s in range(stages)]
        scale = [room[rank_of(setting.ranks, setting.placement, s)] for s in range(stages)]
        units = (
            tuple(b.kept_f / r for b, r in zip(sizes, scale, strict=True)),
            tuple(b.added_i / r for b, r in zip(sizes, scale, strict=True)),
            tuple(-b.act / r for b, r in zip(sizes, scale, strict=True)),
        )
        cap = 1.0
    return Problem(
        setting.ranks, setting.microbatches, setting.placement, f, i, w,
        setting.profile.comm, *units, cap,
    )  # fmt: skip


def memory_peaks(program: Program, profile: Profile, cut: Cut) -> tuple[float, ...]:
    """Each rank's predicted peak in bytes: its stages' static bytes plus the peak of its
    activations by the one memory rule (`pipecc.analysis.memory.activation_peak_bytes`). A
    recomputed stage s keeps `kept_f` from its F; its I brings back the rest, counted as a second
    stage (index S + s) that the I allocates and the W frees."""
    sizes = [stage_bytes(profile, cut, s) for s in range(cut.stages)]
    by_stage = {s: b.kept_f for s, b in enumerate(sizes)}
    by_stage |= {cut.stages + s: b.added_i for s, b in enumerate(sizes)}
    static = [0.0] * program.num_ranks
    for slot in program.placement.slots:
        static[slot.rank] += sizes[slot.stage].static
    peaks = []
    for rank, instrs in enumerate(program.ranks):
        ops = list(_with_recomputation(instrs, cut))
        peaks.append(static[rank] + activation_peak_bytes(ops, by_stage.__getitem__))
    return tuple(peaks)


def _with_recomputation(instrs: Sequence[Instr], cut: Cut) -> Iterator[Compute]:
    """The computations of a rank, a recomputed stage's backward also allocating (as an F
    of stage S + s) what is freed with its weight gradient (as a W of stage S + s)."""
    for instr in instrs:
        if not is_compute(instr):
            continue
        for op in computations(instr):
            if not cut.recompute[op.stage] or op.kind is Kind.F:
                yield op
                continue
            twin = op._replace(stage=cut.stages + op.stage)
            if op.kind is Kind.I:
                yield from (op, twin._replace(kind=Kind.F))
            elif op.kind is Kind.W:
                yield from (op, twin)
            else:  # B: recompute, then free both parts
                yield from (twin._replace(kind=Kind.F), op, twin._replace(kind=Kind.W))
