"""Measured costs: per-(stage, op) durations, host overheads, message latency and sizes.

A `Recorder` collects, on one rank during real steps, the wall time of every compute
instruction and of every post, when each message was posted on each side, when each wait
started and was released, the duplicated-stage gradient sum, and when the step's first
instruction started and its last ended. `render_cost_file` merges
the records of all ranks into the simulator's TOML cost format (DESIGN §6):

    [cost]            unit = "ms"; placement, ranks, stages: the program's placement, its P
                      and its stages per pipe S (what the profile was measured on);
                      F, B, I, W, FB, FI (ms per share of the model, 1/P of it: the mean
                      over every stage, its part above `dispatch` times S/P); post, wait,
                      dispatch (ms per op);
                      comm (ms per message); bytes (per message); sync (ms per step);
                      a MoE program's a2a (ms per all-to-all) and moe_experts (a ratio)
    [cost.stage.N]    the durations measured on stage N alone (ms, as measured), a MoE
                      stage's a2a and moe_experts (runtime/profiling/moe_costs.py)

Stage N is the `stage` of the program (pipe 0's numbering); with two pipes (DualPipe) stage N
of both pipes is one model stage and their samples are merged. A fused op is recorded as FB
(F&B) or FI (F&I) under the stage of its forward, as the simulator looks it up; a MoE
stage's op, run as phases (a fused one's two halves interleaved), as its own F, B or I:
the sum of its phases.

Every compute duration is, per (stage, op), the **median over the timed steps of each step's
mean** of its samples. Within a step the mean: the simulator adds durations up along the
critical path, and the mean is the figure whose sum is the expected total; host noise only
ever adds time (a descheduled thread, a late wake-up), so a median over single ops would
leave that tail out of every op and predict a step shorter than any real one. Across steps
the median: one step disturbed as a whole (another process taking the cores for a while)
moves a mean over all samples, not the median of ten steps. The global `[cost]` durations
are the same over all stages of an op kind.

The **spread** of a stage is the relative interquartile range over the timed steps of the
stage's compute time in each step (every op of the stage added: what the prediction adds up):
(Q3 − Q1) / median, with the quartiles of `statistics.quantiles(method="inclusive")`; it
needs two timed steps. An op that is a small part of its stage moves it little however much
it varies itself. The profile's spread is its worst stage's. The `[profile]` table records the
number of timed steps, that spread and its stage (`spread_at`), and the bound `pipecc run`
refuses a profile above (`SPREAD_BOUND`); `[profile.stage.N]` holds the stage's `spread` and,
for information, the relative interquartile range of each of its ops' per-step means
(`F_spread`, ...). `post`, `wait`, `sync` and `comm` are the means (the fit) over all timed
steps, as below.

- `dispatch`: the median over every timed forward of its time outside the stage module's
  call (hooks on the module: the inputs taken from the mailbox, the RNG state, the output
  checked and handed on, the loss on a last stage): the host time of a compute instruction
  that does not grow with its stage's layers. The readers scale only the part of a duration
  above it to another cut (docs/simulate.md); `[cost]` F, B, ... per share are written with
  the same rule (the part above `dispatch` times S/P). Measured on forwards and used for
  every kind (a backward's fixed part, autograd's start, is not separable from its layers).

- `post`: host time of one send or receive instruction on the compute thread: preparing its
  buffer and, at the last op of a group, posting it (on gloo a send may write its data
  then), or handing it to the poster thread (`PIPECC_POST_THREAD=1`). The simulator
  charges it to every Send/Recv and posts a group at the end of its last op's post.
- `wait`: host time of a wait after its last op completed (the mailbox, the bookkeeping).
- `comm`: the latency under which the profiled program, replayed with the file's own
  durations and host times under the backend's comm model (`render_cost_file`'s `replay`),
  lasts the median span of the timed steps: per step, the last end of any rank's
  instructions minus the first start (`span_times`; `calibrated_comm` bisects, the
  makespan never falling as the latency grows). So the profile predicts its own run. Where
  no latency moves the replay (no messages), the waits' fit: for every wait that waits for
  a transfer, the run measured when it started, when the last of its transfers could start
  (its send and its receive both posted) and when it was released; under the rendezvous
  rule it is released at max(start, that moment + comm), and `fit_latency` finds the
  smallest comm that makes those releases add up to the measured ones.
- `sync`: per step, from the moment the last holder of a duplicated stage starts the
  gradient sum to the moment the last one has finished it.

Ranks of `pipecc run` share one host, so their monotonic clocks agree. Every command that
reads the file converts it for the program it is applied to (docs/simulate.md): a V-shape
profile (2P stages) applied to a loop program adds stage 2s and 2s+1 into stage s.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipecc.ir.keys import Message
from pipecc.ir.program import Program
from pipecc.semantics.costs.keys import OP_KEYS
from pipecc.semantics.costs.keys import key as cost_key

from .figures import Figure, Samples, figure, fit_latency, relative_iqr
from .moe_costs import LAYERS, A2ATime, PhaseTime, measured_layers, moe_costs, moe_profile

WaitedOp = tuple[bool, Message]  # (a send?, its message)
KEYS = OP_KEYS  # the compute durations a profile measures
# the largest spread (relative interquartile range of the per-step means of one (stage, op))
# of a profile `pipecc run --profile` writes without --allow-noisy-profile
SPREAD_BOUND = 0.1
CALIBRATION_CAP = 1000.0  # ms: the longest message latency `calibrated_comm` tries
CALIBRATION_TOLERANCE = 1e-4  # ms: how close it finds it
MOE_HEADER = (  # the header's lines on a MoE program's keys (moe_costs.py)
    "a MoE stage's F, B, I = the sum of its phases; a2a = one expert-parallel all-to-all",
    "(post to completion of the blocking ones; with none, the rendezvous fit of the",
    "asynchronous ones' waits); moe_experts = the experts phases' part of the phased ops;",
    "[profile.stage.N] F_pre, F_experts, ... = the mean phase, a2a_exposed = the mean",
    "wait of the compute thread per all-to-all",
)


@dataclass
class Recorder:
    """What one rank measured; plain data so that it can be pickled to the launcher."""

    step: int = 0
    computes: list[tuple[str, int, float]] = field(default_factory=list)  # (kind, stage, s)
    posts: list[float] = field(default_factory=list)  # s of each Send/Recv instruction
    # (step, a send?, message, posted at, bytes): when each side's group went out
    messages: list[tuple[int, bool, Message, float, int]] = field(default_factory=list)
    # (step, the ops waited for, (start, release, end))
    waits: list[tuple[int, tuple[WaitedOp, ...], tuple[float, float, float]]] = field(
        default_factory=list
    )
    syncs: list[tuple[int, float, float]] = field(default_factory=list)  # (step, start, end)
    # (step, start, end): the program's instructions on this rank, first start to last end
    spans: list[tuple[int, float, float]] = field(default_factory=list)
    # of each forward, the seconds outside its stage's module call (the fixed part)
    outsides: list[float] = field(default_factory=list)
    phases: list[PhaseTime] = field(default_factory=list)  # a MoE stage's (moe_costs.py)
    a2as: list[A2ATime] = field(default_factory=list)  # the expert-parallel all-to-alls

    def compute(self, kind: str, stage: int, seconds: float) -> None:
        self.computes.append((kind, stage, seconds))

    def outside(self, seconds: float) -> None:
        self.outsides.append(seconds)

    def post(self, seconds: float) -> None:
        self.posts.append(seconds)

    def posted(self, send: bool, key: Message, at: float, nbytes: int) -> None:
        self.messages.append((self.step, send, key, at, nbytes))

    def wait(self, ops: tuple[WaitedOp, ...], times: tuple[float, float, float]) -> None:
        self.waits.append((self.step, ops, times))

    def sync(self, start: float, end: float) -> None:
        self.syncs.append((self.step, start, end))

    def span(self, start: float, end: float) -> None:
        self.spans.append((self.step, start, end))

    def phase(self, kind: str, stage: int, part: str, layer: int, seconds: float) -> None:
        self.phases.append(PhaseTime(self.step, kind, stage, part, layer, seconds))

    def a2a(self, stage: int, blocking: bool, times: tuple[float, float, float]) -> None:
        """An all-to-all of `stage`: (posted, waited for from, completed), host clock."""
        self.a2as.append(A2ATime(self.step, stage, blocking, *times))


def _mean_ms(samples: Iterable[float]) -> float:
    return round(statistics.fmean(samples) * 1e3, 4)


class Spread(NamedTuple):
    """The worst stage of a profile: which, its spread, and the (stage, op) of it whose own
    spread is largest (for the message)."""

    stage: int
    kind: str
    spread: float

    def where(self) -> str:
        """`stage 1`: what `spread_at` and the refusal name."""
        return f"stage {self.stage}"

    def describe(self) -> str:
        return f"{self.where()}: spread {self.spread:.3f}"


def _samples(records: list[Recorder]) -> tuple[dict[str, Samples], dict[int, dict[str, Samples]]]:
    """The compute samples by op kind and by (stage, op kind), each by step."""
    overall: dict[str, Samples] = defaultdict(lambda: defaultdict(list))
    staged: dict[int, dict[str, Samples]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for record in records:
        for kind, stage, seconds in record.computes:
            overall[kind][record.step].append(seconds)
            staged[stage][kind][record.step].append(seconds)
    return overall, staged


def compute_figures(
    records: list[Recorder],
) -> tuple[dict[str, Figure], dict[int, dict[str, Figure]]]:
    """Every op kind's figure, overall and per stage."""
    overall, staged = _samples(records)
    top = {k: figure(overall[k]) for k in KEYS if k in overall}
    per_stage = {
        stage: {k: figure(kinds[k]) for k in KEYS if k in kinds}
        for stage, kinds in sorted(staged.items())
    }
    return top, per_stage


def compute_costs(records: list[Recorder]) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """Durations (ms) per op kind, overall and per stage: the median over steps of each
    step's mean (with one step, the mean)."""
    top, per_stage = compute_figures(records)
    return (
        {k: f.ms for k, f in top.items()},
        {stage: {k: f.ms for k, f in kinds.items()} for stage, kinds in per_stage.items()},
    )


def measured_costs(
    records: list[Recorder],
) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """`compute_costs` with a MoE program's `a2a` (ms) and `moe_experts` (moe_costs.py),
    overall and per stage: every cost value a profile measures on a stage, as measured
    (not per share; a MoE stage's F, B, I are the sums of their phases)."""
    top, per_stage = compute_costs(records)
    moe_top, moe_stages = moe_costs(records)
    for stage, values in moe_stages.items():
        per_stage.setdefault(stage, {}).update(values)
    return {**top, **moe_top}, dict(sorted(per_stage.items()))


def stage_totals(records: list[Recorder]) -> dict[int, list[float]]:
    """Per stage, its compute seconds in each timed step (every op of it added), by step."""
    totals: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for record in records:
        for _, stage, seconds in record.computes:
            totals[stage][record.step] += seconds
    return {stage: [t for _, t in sorted(steps.items())] for stage, steps in totals.items()}


def stage_spreads(records: list[Recorder]) -> dict[int, float]:
    """Each stage's spread: the relative interquartile range over the timed steps of the
    stage's compute time in the step (module docstring); none with fewer than two steps."""
    found = {}
    for stage, totals in sorted(stage_totals(records).items()):
        spread = relative_iqr(totals)
        if spread is not None:
            found[stage] = round(spread, 4)
    return found


def worst_spread(records: list[Recorder]) -> Spread | None:
    """The stage whose per-step compute time spreads most, with its noisiest op; None with
    fewer than two steps."""
    spreads = stage_spreads(records)
    if not spreads:
        return None
    stage = max(spreads, key=lambda s: (spreads[s], -s))
    figures = compute_figures(records)[1][stage]
    kind = max(figures, key=lambda k: figures[k].spread or 0.0)
    return Spread(stage, kind, spreads[stage])


def dispatch_ms(records: list[Recorder]) -> float | None:
    """The profile's `dispatch`: the median over all forwards of their time outside the
    stage's module (ms); None where none was measured."""
    outsides = [seconds for record in records for seconds in record.outsides]
    return round(statistics.median(outsides) * 1e3, 4) if outsides else None


def per_share(value: float, factor: float, fixed: float) -> float:
    """A duration measured on a stage of 1/`factor` shares, per share: its first `fixed`
    as it is, the rest times `factor` (the inverse of the readers' conversion,
    pipecc.semantics.costs.scale_duration)."""
    kept = min(value, fixed)
    return kept + (value - kept) * factor


def host_costs(records: list[Recorder]) -> dict[str, float]:
    """Mean host time (ms) per post and per wait after its release; the duplicated-stage
    gradient sum per step."""
    result: dict[str, float] = {}
    posts = [seconds for record in records for seconds in record.posts]
    waits = [end - release for r in records for _, _, (_, release, end) in r.waits]
    syncs = sync_times(records)
    for name, samples in (
        (cost_key("post"), posts),
        (cost_key("wait"), waits),
        (cost_key("sync"), syncs),
    ):
        if samples:
            result[name] = _mean_ms(samples)
    return result


def sync_times(records: list[Recorder]) -> list[float]:
    """Per step: the last end of the gradient sum minus its last start, over the ranks."""
    return _per_step([record.syncs for record in records], start_of=max)


def span_times(records: list[Recorder]) -> list[float]:
    """Per timed step: the program's span over every rank (the last end of its instructions
    minus their first start; the ranks share one clock)."""
    return _per_step([record.spans for record in records], start_of=min)


def _per_step(
    intervals: list[list[tuple[int, float, float]]], start_of: Callable[[float, float], float]
) -> list[float]:
    """Per step, in step order: the last end over every rank's (step, start, end) minus the
    start `start_of` picks among theirs (`max`: the last start, `min`: the first)."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for rank in intervals:
        for step, start, end in rank:
            starts[step] = start_of(starts.get(step, start), start)
            ends[step] = max(ends.get(step, end), end)
    return [ends[step] - starts[step] for step in sorted(starts)]


def wait_times(records: list[Recorder]) -> list[tuple[float, float, float]]:
    """Per wait that waits for a transfer: (its start, the moment its last transfer could
    start: both sides posted, its release)."""
    posted: dict[tuple[int, Message], float] = {}  # the later of the two sides' posts
    for record in records:
        for step, _, key, at, _ in record.messages:
            posted[(step, key)] = max(posted.get((step, key), at), at)
    found = []
    for record in records:
        for step, ops, (start, release, _) in record.waits:
            ready = [posted[(step, key)] for _, key in ops if (step, key) in posted]
            if ready:
                found.append((start, max(ready), release))
    return found


def comm_costs(records: list[Recorder]) -> dict[str, float]:
    """Latency per message (ms) and bytes per message."""
    waits = wait_times(records)
    sizes = [nbytes for r in records for _, send, _, _, nbytes in r.messages if send]
    result: dict[str, float] = {}
    if waits:
        result[cost_key("comm")] = round(fit_latency(waits) * 1e3, 4)
    if sizes:
        result[cost_key("bytes")] = int(statistics.median(sizes))
    return result


def render_cost_file(
    records: list[Recorder],
    header: str,
    *,
    measured_on: Program,
    shared: Sequence[Sequence[int]] = (),
    sizes: Mapping[int, Mapping[str, int]] | None = None,
    replay: Callable[[str], float] | None = None,
) -> str:
    """The TOML text: a comment header, `[cost]` (what it was measured on, the durations per
    share, with `shared`, the groups of stages that hold one parameter, where there are any),
    the `[cost.stage.N]` tables, then `[profile]` (what the figures are over, their spread).
    With `replay` (a cost file's text -> the profiled program's makespan under it, in ms: the
    simulator under the comm model of the backend the run used; the caller's, as the
    runtime does not import the simulator), `comm` is calibrated on the run
    (`calibrated_comm`); without, it is the waits' fit. A MoE program's `a2a` and
    `moe_experts` (moe_costs.py) are in `[cost]` and its stages' tables, as measured (a
    message's time and a ratio: not per share), `moe_layers` where `measured_on` does not
    say a stage's, and its phases in `[profile.stage.N]`."""
    top, per_stage = compute_costs(records)
    ranks, stages = measured_on.num_ranks, measured_on.placement.num_stages(0)
    fixed = dispatch_ms(records)
    factor = stages / ranks  # per share: the part above `dispatch` times S/P
    top = {key: round(per_share(value, factor, fixed or 0.0), 4) for key, value in top.items()}
    moe_top, moe_stages = moe_costs(records)
    top.update(moe_top)
    for stage, layers in measured_layers(records).items():
        if measured_on.moe is None or measured_on.moe[stage] != layers:
            moe_stages.setdefault(stage, {})[LAYERS] = layers
    top.update(comm_costs(records))
    top.update(host_costs(records))
    if fixed is not None:
        top[cost_key("dispatch")] = fixed

    def text(comm: float | None) -> str:
        given = {**top} if comm is None else {**top, cost_key("comm"): round(comm, 4)}
        notes = header.splitlines() + (list(MOE_HEADER) if moe_top else [])
        lines = [f"# {line}".rstrip() for line in notes]
        lines += [
            "",
            "[cost]",
            f'{cost_key("unit")} = "ms"',
            *_measured_on(measured_on),
            *_table(given),
        ]
        if shared:
            lines.append(f"{cost_key('shared')} = {[list(group) for group in shared]}")
        for stage, costs in per_stage.items():  # with `sizes`, its byte keys (memory.py)
            table = {**costs, **moe_stages.get(stage, {}), **(sizes or {}).get(stage, {})}
            lines += ["", f"[cost.stage.{stage}]", *_table(table)]
        return "\n".join([*lines, *_profile_table(records)]) + "\n"

    spans = span_times(records)
    if replay is None or not spans:
        return text(None)
    # where no latency moves the replay (no messages): the waits' fit
    return text(calibrated_comm(lambda comm: replay(text(comm)), statistics.median(spans) * 1e3))


def calibrated_comm(predicted: Callable[[float], float], span: float) -> float | None:
    """The profile's `comm` (ms): the smallest latency under which the replay of the profiled
    program with the profile's own durations (`predicted(comm)`: its makespan, ms) is as long
    as the median span the run measured, `span` (module docstring); 0 when the replay is that
    long without any latency; None when no latency up to `CALIBRATION_CAP` makes it so (a
    program without messages: its makespan does not move)."""
    low, high = 0.0, 0.5
    if predicted(low) >= span:
        return 0.0
    while predicted(high) < span:
        if high >= CALIBRATION_CAP:
            return None
        low, high = high, min(high * 2, CALIBRATION_CAP)
    while high - low > CALIBRATION_TOLERANCE:  # the makespan never falls as latency grows
        middle = (low + high) / 2
        if predicted(middle) < span:
            low = middle
        else:
            high = middle
    return high


def _measured_on(program: Program) -> list[str]:
    """The `[cost]` keys naming the cut the profile was measured on (docs/simulate.md)."""
    placement = program.placement
    return [
        f'{cost_key("placement")} = "{placement.name}"',
        f"{cost_key('ranks')} = {program.num_ranks}",
        f"{cost_key('stages')} = {placement.num_stages(0)}",
    ]


def _profile_table(records: list[Recorder]) -> list[str]:
    """`[profile]`: the timed steps, the worst spread, the bound; the spread of every
    (stage, op) as `F_spread`, ... under `[profile.stage.N]` (none with one step), with a MoE
    stage's phases (`moe_profile`: `F_pre`, ..., `a2a_exposed`; its costs are in its
    `[cost.stage.N]`)."""
    lines = ["", "[profile]", f"steps = {len({record.step for record in records})}"]
    worst = worst_spread(records)
    if worst is not None:
        lines += [
            f"spread = {worst.spread}",
            f'spread_at = "{worst.where()}"',
            f"spread_bound = {SPREAD_BOUND}",
        ]
    totals = stage_spreads(records)
    phases = moe_profile(records)
    tables: dict[int, dict[str, float]] = defaultdict(dict)
    for stage, figures in compute_figures(records)[1].items():
        spreads = {f"{k}_spread": f.spread for k, f in figures.items() if f.spread is not None}
        if stage in totals:
            spreads["spread"] = totals[stage]
        tables[stage].update(spreads)
    for stage, measured in phases.items():
        costs = (cost_key("a2a"), cost_key("moe_experts"))
        tables[stage].update({k: v for k, v in measured.items() if k not in costs})
    for stage, table in sorted(tables.items()):
        if table:
            lines += ["", f"[profile.stage.{stage}]", *_table(table)]
    return lines


def _table(values: Mapping[str, float]) -> list[str]:
    return [f"{key} = {value}" for key, value in values.items()]
