"""A MoE program's measured phases and all-to-alls, as the cost keys the simulator reads.

The profiler (runtime/profiling/profiler.py) records every phase of a MoE stage's F, B and I
(`PhaseTime`) and every expert-parallel all-to-all (`A2ATime`); the op a stage's phases make
up is recorded as that op's compute duration too (their sum), so a MoE stage has its F, B,
I like any stage. From them, per stage and over all stages:

- `moe_experts`: the experts phases' part of the stage's phased ops, Σ experts / Σ every
  phase over its F, B and I of a step, the median over the timed steps. The simulator gives
  each experts phase d·share/K of its op's duration d (pipecc/semantics/costs/model.py
  `phase`), one share for every op kind, so the ratio of the sums is the share under which
  the experts phases add up to what they took.
- `a2a`: one all-to-all's duration, the median over the timed steps of each step's mean. A
  blocking all-to-all is timed from its post to its completion on the compute thread (the
  count exchange and the tokens' transfer). A member that posts before its EP peers also
  waits for them, and the simulator's replay already holds a collective until its last
  member posts: so each all-to-all is the least of its members' times (the last to post
  waits for the transfer alone), its members the ranks that recorded the stage in that step,
  matched by their order there (every holder of a stage posts its all-to-alls in the
  program's order). An asynchronous
  one completes while the other half of a fused op computes, so only its lower bound is
  seen directly: a program with blocking ones takes `a2a` from those alone. Where a stage
  has only asynchronous ones (every MoE op fused), `a2a` is the latency c the rendezvous
  rule fits to their waits (`fit_latency`: each wait released at max(its start, the
  post + c), the smallest c whose releases add up to the measured ones), which is the
  simulator's own rule for an asynchronous collective, so the profile reproduces the time
  its waits blocked.
- `moe_layers`: the layers a stage's phases split at (1 + the last experts phase's layer);
  written only where the program measured does not say it (render_cost_file).

The run's report and the file's `[profile.stage.N]` show the phases themselves
(`moe_profile`): the mean of each (op kind, part) in ms, as `F_pre`, `F_experts`, `B_post`,
and per all-to-all the time the compute thread waited for it (`a2a_exposed`: blocking and
asynchronous ones together, as `exposed` is in the simulator's report).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, TypeVar

from pipecc.semantics.costs.keys import key as cost_key

from .figures import fit_latency

EXPERTS = "experts"  # the part of a phase that is the experts' (pipecc.ir.ops.PhasePart)
A2A, SHARE, LAYERS = cost_key("a2a"), cost_key("moe_experts"), cost_key("moe_layers")


class PhaseTime(NamedTuple):
    """One MoE phase as measured on a rank: the step, its op's kind (F, B, I) and stage, its
    part (pre, experts, post) and layer, its seconds."""

    step: int
    kind: str
    stage: int
    part: str
    layer: int
    seconds: float


class A2ATime(NamedTuple):
    """One all-to-all as measured on a rank (host clock, s): when it was posted, when the
    compute thread began to wait for it (a blocking one: posted) and when it completed."""

    step: int
    stage: int
    blocking: bool
    posted: float
    waited: float
    done: float


T = TypeVar("T", PhaseTime, A2ATime)


class Recorder(Protocol):
    """What these figures read of a rank's `recorder.Recorder` (one step's): its phases
    and all-to-alls (a protocol, so that the recorder, which renders them, is not imported
    back)."""

    @property
    def phases(self) -> list[PhaseTime]: ...

    @property
    def a2as(self) -> list[A2ATime]: ...


def moe_costs(records: Sequence[Recorder]) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """`moe_experts` and `a2a` (ms) over every stage and per stage (module docstring); empty
    for a program without MoE phases."""
    phases = [p for record in records for p in record.phases]
    a2as = [a for record in records for a in record.a2as]
    top: dict[str, float] = {}
    per_stage: dict[int, dict[str, float]] = defaultdict(dict)
    for stage, found in _by_stage(phases).items():
        share = experts_share(found)
        if share is not None:
            per_stage[stage][SHARE] = share
    members = _members(records)
    for stage, timed in members.items():
        per_stage[stage][A2A] = a2a_ms(timed)
    share = experts_share(phases)
    if share is not None:
        top[SHARE] = share
    if a2as:
        top[A2A] = round(statistics.fmean(per_stage[s][A2A] for s in members), 4)
    return top, dict(sorted(per_stage.items()))


def experts_share(phases: Sequence[PhaseTime]) -> float | None:
    """Σ experts phases / Σ phases per step, the median over the steps (None: no time)."""
    shares = []
    for found in _by_step(phases).values():
        total = sum(p.seconds for p in found)
        if total > 0:
            shares.append(sum(p.seconds for p in found if p.part == EXPERTS) / total)
    return round(statistics.median(shares), 4) if shares else None


def a2a_ms(members: Sequence[Sequence[A2ATime]]) -> float:
    """One all-to-all's duration (ms), from each member's all-to-alls of one stage and step
    in program order (`_members`): the blocking ones where there are any, each the least of
    its members' times, else the rendezvous fit to the asynchronous ones' waits (module
    docstring)."""
    blocking = [[a for a in seq if a.blocking] for seq in members]
    per_step = []
    if any(blocking):
        steps: dict[int, list[list[A2ATime]]] = defaultdict(list)
        for seq in blocking:
            if seq:
                steps[seq[0].step].append(seq)
        for found in steps.values():
            count = min(len(seq) for seq in found)
            least = [min(seq[i].done - seq[i].posted for seq in found) for i in range(count)]
            per_step.append(statistics.fmean(least))
    else:
        flat = [a for seq in members for a in seq]
        for each in _by_step(flat).values():
            per_step.append(fit_latency([(a.waited, a.posted, a.done) for a in each]))
    return round(statistics.median(per_step) * 1e3, 4)


def _members(records: Sequence[Recorder]) -> dict[int, list[list[A2ATime]]]:
    """Per stage, each record's all-to-alls of it (one rank's in one step), in order."""
    found: dict[int, list[list[A2ATime]]] = defaultdict(list)
    for record in records:
        for stage, timed in _by_stage(record.a2as).items():
            found[stage].append(timed)
    return dict(sorted(found.items()))


def measured_layers(records: Iterable[Recorder]) -> dict[int, int]:
    """Per stage, the MoE layers its phases split at (1 + its last experts phase's layer)."""
    found: dict[int, int] = {}
    for record in records:
        for p in record.phases:
            if p.part == EXPERTS:
                found[p.stage] = max(found.get(p.stage, 0), p.layer + 1)
    return dict(sorted(found.items()))


def moe_profile(records: Sequence[Recorder]) -> dict[int, dict[str, float]]:
    """Per MoE stage, for the run's report and `[profile.stage.N]`: each (op kind, part)'s
    mean phase (`F_pre`, `F_experts`, ... in ms: the median over steps of each step's mean),
    its `a2a` and `moe_experts`, and `a2a_exposed`, the mean time (ms) the compute thread
    waited per all-to-all (blocking: post to completion; asynchronous: its wait)."""
    phases = [p for record in records for p in record.phases]
    a2as = [a for record in records for a in record.a2as]
    costs = moe_costs(records)[1]
    found: dict[int, dict[str, float]] = {}
    for stage, timed in _by_stage(phases).items():
        kinds: dict[str, list[PhaseTime]] = defaultdict(list)
        for p in timed:
            kinds[f"{p.kind}_{p.part}"].append(p)
        found[stage] = {name: _median_mean(kinds[name], _seconds) for name in _ordered(kinds)}
    for stage, posted in _by_stage(a2as).items():
        found.setdefault(stage, {})["a2a_exposed"] = _median_mean(posted, _exposed)
    for stage, values in found.items():
        values.update(costs.get(stage, {}))
    return dict(sorted(found.items()))


def _ordered(names: Iterable[str]) -> list[str]:
    """`F_pre`, `F_experts`, `F_post`, then B's, then I's: the order an op runs in forward."""
    order = [f"{kind}_{part}" for kind in "FBI" for part in ("pre", EXPERTS, "post")]
    return sorted(names, key=lambda name: order.index(name) if name in order else len(order))


def _seconds(p: PhaseTime) -> float:
    return p.seconds


def _exposed(a: A2ATime) -> float:
    return a.done - a.waited


def _median_mean(samples: Sequence[T], value: Callable[[T], float]) -> float:
    """The median over steps of each step's mean of `value` (ms)."""
    means = [statistics.fmean(value(s) for s in found) for found in _by_step(samples).values()]
    return round(statistics.median(means) * 1e3, 4)


def _by_stage(samples: Sequence[T]) -> dict[int, list[T]]:
    grouped: dict[int, list[T]] = defaultdict(list)
    for sample in samples:
        grouped[sample.stage].append(sample)
    return dict(sorted(grouped.items()))


def _by_step(samples: Sequence[T]) -> dict[int, list[T]]:
    grouped: dict[int, list[T]] = defaultdict(list)
    for sample in samples:
        grouped[sample.step].append(sample)
    return dict(sorted(grouped.items()))
