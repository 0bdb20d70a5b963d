"""The search problem: ranks, stages, per-stage costs and memory, and the reference replay.

A `Problem` is what `pipecc search` optimises: P ranks, M microbatches, a placement of the
stages on the ranks, per-stage durations of the three split ops (F forward, I input
gradient, W weight gradient), the message latency `comm`, per-stage memory changes, a
per-rank memory cap and the objective. An `Order` is one sequence of `SearchOp`s per rank.
`evaluate` replays an order in the latency model and is the reference every faster
evaluator of the search is tested against:

- every rank starts at time 0 and runs its ops in its order, one at a time;
- an op starts when its rank is free and its inputs have arrived: F(s, m) needs F(s-1, m);
  I(s, m) needs F(s, m) and I(s+1, m) (the last stage's I needs only its F); W(s, m) needs
  I(s, m) on the same rank;
- a result produced on another rank arrives `comm` after its producer ends; between
  consecutive stages on one rank (the V shape's turn) it is passed locally, without latency;
- each op changes its rank's memory when it runs: F by `mem_f`, I by `mem_i`, W by `mem_w`
  of its stage; a rank's peak is the largest running total (from 0) along its order.

Costs follow the one convention of every command (docs/simulate.md): `[cost]` is per share
(1/P) of the model, and `CostModel.for_cut` turns it into the durations of each stage of the
placement's cut (S = P or 2P stages, each P/S shares); a `[cost.stage.N]` table is stage N of
that cut, and a profile measured on another cut is converted. Memory (`--mem`) is per share:
a stage holds P/S of it, so that loop and V placements are compared on the same model and
the same memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from pipecc.diagnostics import CostModelError
from pipecc.ir.ops import Kind
from pipecc.ir.placement import Placement, loop_placement, vshape_placement
from pipecc.semantics.costs import CostModel, Cut


class Objective(enum.Enum):
    """What the search minimises."""

    MAKESPAN = "makespan"  # the step: the last end over all ranks, every rank starting at 0
    SPAN = "span"  # the largest, over ranks, of a rank's last end minus its first start


class SearchOp(NamedTuple):
    """One op of the search: its kind, stage and microbatch."""

    kind: Kind
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.mb}"


SPLIT = (Kind.F, Kind.I, Kind.W)
"""The three ops of the zero-bubble split (the IR's kinds; a full backward B is not one)."""

SHAPES = ("loop", "vshape")
"""The placements the search takes by formula, by the IR's names (`pipecc.ir.placement`):
loop, S = P stages, stage s on rank s; vshape, S = 2P stages, stage s on rank s for s < P, on
rank 2P-1-s otherwise. Any other placement (`bidirectional`, a `.sched` file's table) comes
as its IR form, `Problem.layout`: its pipes' stages are numbered one after the other
(stage s of pipe p is search stage Σ_{q<p} S_q + s), each pipe carries M / pipes
microbatches (`Problem.microbatches` counts those of one pipe), and no data flows from one
pipe's last stage to the next pipe's first."""

Order = tuple[tuple[SearchOp, ...], ...]
"""One tuple of ops per rank, in the order the rank runs them."""


class MemDeltas(NamedTuple):
    """Memory change of each op kind for one rank's share of the model (`--mem`)."""

    F: float = 1.0
    I: float = 0.0  # noqa: E741
    W: float = -1.0


DEFAULT_MEM = MemDeltas()


@dataclass(frozen=True, slots=True)
class Problem:
    """One search problem; per-stage values are already scaled to the placement's cut."""

    ranks: int
    microbatches: int
    placement: str
    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    comm: float
    mem_f: tuple[float, ...]
    mem_i: tuple[float, ...]
    mem_w: tuple[float, ...]
    cap: float
    objective: Objective = Objective.MAKESPAN
    split: bool = True  # False (`--no-split`): each I is a full B (W lasts 0 and frees nothing)
    layout: Placement | None = None  # a placement other than loop and vshape (SHAPES)
    _holder: tuple[int, ...] = field(init=False, repr=False, compare=False)  # stage -> rank
    _held: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _pipe: tuple[int, ...] = field(init=False, repr=False, compare=False)  # stage -> pipe
    _offset: tuple[int, ...] = field(init=False, repr=False, compare=False)  # pipe -> stage 0

    def __post_init__(self) -> None:
        self._tables()
        if self.ranks < 1 or self.microbatches < 1:
            raise ValueError(f"need P ≥ 1 and M ≥ 1, got P={self.ranks} M={self.microbatches}")
        stages = self.num_stages
        for name in ("f", "i", "w", "mem_f", "mem_i", "mem_w"):
            if len(getattr(self, name)) != stages:
                raise ValueError(f"{name} has {len(getattr(self, name))} values, need {stages}")
        if self.comm < 0:
            raise ValueError(f"comm must be ≥ 0, got {self.comm}")
        if self.placement not in SHAPES and self.layout is None:
            raise ValueError(f"placement {self.placement!r}: the search takes {SHAPES}")

    def _tables(self) -> None:
        layout = self.ir_placement()
        offsets: list[int] = []
        holder: list[int] = []
        pipes: list[int] = []
        for pipe in range(layout.num_pipes):
            offsets.append(len(holder))
            for stage in range(layout.num_stages(pipe)):
                holder.append(layout.holder(pipe, stage).rank)
                pipes.append(pipe)
        held = tuple(
            tuple(s for s, rank in enumerate(holder) if rank == r) for r in range(self.ranks)
        )
        object.__setattr__(self, "_holder", tuple(holder))
        object.__setattr__(self, "_held", held)
        object.__setattr__(self, "_pipe", tuple(pipes))
        object.__setattr__(self, "_offset", tuple(offsets))

    def ir_placement(self) -> Placement:
        """The IR's placement for P ranks (what the lowered program carries)."""
        if self.layout is not None:
            return self.layout
        if self.placement == "loop":
            return loop_placement(self.ranks, 1)
        return vshape_placement(self.ranks)

    @property
    def num_stages(self) -> int:
        """S: P for the loop placement, 2P for the V shape, every pipe's for a layout."""
        return len(self._holder)

    @property
    def pipes(self) -> int:
        """How many pipes the placement has (each carries `microbatches` microbatches)."""
        return len(self._offset)

    @property
    def total_microbatches(self) -> int:
        """M: the microbatches of every pipe."""
        return self.microbatches * self.pipes

    def rank_of(self, stage: int) -> int:
        """The rank that runs `stage`."""
        return self._holder[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` runs, in increasing order."""
        return self._held[rank]

    def is_first(self, stage: int) -> bool:
        """`stage` is the first of its pipe (its F needs no input)."""
        return self._offset[self._pipe[stage]] == stage

    def is_last(self, stage: int) -> bool:
        """`stage` is the last of its pipe (its I needs only its own F)."""
        return stage + 1 == len(self._holder) or self._pipe[stage + 1] != self._pipe[stage]

    def ir_stage(self, stage: int) -> tuple[int, int]:
        """(pipe, stage within the pipe) of a search stage."""
        pipe = self._pipe[stage]
        return pipe, stage - self._offset[pipe]

    def search_stage(self, pipe: int, stage: int) -> int:
        """The search stage of `stage` of `pipe` (inverse of `ir_stage`)."""
        return self._offset[pipe] + stage

    def first_mb(self, stage: int) -> int:
        """The global number of the first microbatch of `stage`'s pipe."""
        return self._pipe[stage] * self.microbatches

    def duration(self, op: SearchOp) -> float:
        """How long `op` runs."""
        table = self.f if op.kind is Kind.F else self.i if op.kind is Kind.I else self.w
        return table[op.stage]

    def mem_delta(self, op: SearchOp) -> float:
        """How much `op` changes its rank's memory."""
        kind = op.kind
        table = self.mem_f if kind is Kind.F else self.mem_i if kind is Kind.I else self.mem_w
        return table[op.stage]

    def ops_of(self, rank: int) -> tuple[SearchOp, ...]:
        """Every op `rank` must run (in no particular order)."""
        return tuple(
            SearchOp(kind, stage, mb)
            for stage in self.stages_of(rank)
            for mb in range(self.microbatches)
            for kind in SPLIT
        )

    @classmethod
    def from_costs(
        cls,
        costs: CostModel,
        *,
        ranks: int,
        microbatches: int,
        placement: str,
        cap: float,
        mem: MemDeltas = DEFAULT_MEM,
        objective: Objective = Objective.MAKESPAN,
        split: bool = True,
        layout: Placement | None = None,
    ) -> Problem:
        """The problem for costs as given (per share, `CostModel.for_cut`). Without `split`,
        each I is a full backward B: B's duration (I + W) and memory change (I's plus W's),
        its W a placeholder of no time and no memory that `lower` drops. With a `layout`
        (`placement` its name), `microbatches` is M, split evenly over its pipes, and every
        pipe must have the same number of stages (each pipe's stage s costs the cut's s).

        Raises CostModelError for a stage table the cut does not have or message latencies
        that differ between stages (the search's latency model has one `comm`), ValueError
        for a layout whose pipes differ or do not divide M."""
        pipes = 1 if layout is None else layout.num_pipes
        per_pipe = ranks if placement == "loop" else 2 * ranks
        if layout is not None:
            per_pipe = _pipe_stages(layout, microbatches)
        cost = stage_costs(costs.for_cut(Cut(ranks, per_pipe, placement)), per_pipe)
        stages, scale = per_pipe * pipes, ranks / per_pipe
        i, w, mem_i, mem_w = cost.i, cost.w, mem.I, mem.W
        if not split:
            i = tuple(a + b for a, b in zip(cost.i, cost.w, strict=True))
            w, mem_i, mem_w = (0.0,) * per_pipe, mem.I + mem.W, 0.0
        return cls(
            ranks=ranks,
            microbatches=microbatches // pipes,
            placement=placement,
            f=cost.f * pipes,
            i=i * pipes,
            w=w * pipes,
            comm=cost.comm,
            mem_f=(mem.F * scale,) * stages,
            mem_i=(mem_i * scale,) * stages,
            mem_w=(mem_w * scale,) * stages,
            cap=cap,
            objective=objective,
            split=split,
            layout=layout,
        )


def _pipe_stages(layout: Placement, microbatches: int) -> int:
    """The stages of each of the layout's pipes (the same for all); M must split evenly."""
    counts = {layout.num_stages(pipe) for pipe in range(layout.num_pipes)}
    if len(counts) > 1:
        raise ValueError(
            f"placement {layout.name}: its pipes have {sorted(counts)} stages; the search "
            "takes pipes of one length"
        )
    if microbatches % layout.num_pipes:
        raise ValueError(
            f"placement {layout.name} splits M over {layout.num_pipes} pipes: M must be a "
            f"multiple of {layout.num_pipes}, got {microbatches}"
        )
    return counts.pop()


class StageCosts(NamedTuple):
    """Durations per stage of a cut (index = stage) and the latency."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    comm: float


def stage_costs(costs: CostModel, stages: int) -> StageCosts:
    """The per-stage durations of a cost model converted for a cut of `stages` stages."""
    resolved = [costs.stage(s) for s in range(stages)]
    latencies = {cost.comm for cost in resolved}
    if len(latencies) > 1:
        raise CostModelError(
            f"comm differs between stages ({', '.join(f'{c:g}' for c in sorted(latencies))}):"
            " the search's latency model has one message latency; give comm under [cost] only"
        )
    return StageCosts(
        tuple(c.F for c in resolved),
        tuple(c.I for c in resolved),
        tuple(c.W for c in resolved),
        resolved[0].comm,
    )


class Evaluation(NamedTuple):
    """The replay of one order: objective figures, peaks and every op's start and end."""

    makespan: float
    span: float
    peak: tuple[float, ...]  # per rank
    start: tuple[tuple[float, ...], ...]  # per rank, aligned with the order
    end: tuple[tuple[float, ...], ...]

    def score(self, objective: Objective) -> float:
        """The figure `objective` minimises."""
        return self.makespan if objective is Objective.MAKESPAN else self.span


class OrderError(ValueError):
    """An order that does not hold each of its ranks' ops exactly once."""


def check_order(problem: Problem, order: Order) -> None:
    """Raise OrderError unless each rank's sequence holds exactly that rank's ops once."""
    if len(order) != problem.ranks:
        raise OrderError(f"order has {len(order)} ranks, the problem {problem.ranks}")
    for rank, ops in enumerate(order):
        expected = set(problem.ops_of(rank))
        seen = set(ops)
        if len(seen) != len(ops) or seen != expected:
            missing = sorted(map(str, expected - seen))[:3]
            extra = sorted(map(str, seen - expected))[:3]
            raise OrderError(
                f"rank {rank}: {len(ops)} ops, {len(seen)} distinct, need {len(expected)}"
                f" (missing {missing}, not this rank's {extra})"
            )


def _inputs(problem: Problem, op: SearchOp) -> tuple[SearchOp, ...]:
    kind, stage, mb = op
    if kind is Kind.F:
        return () if problem.is_first(stage) else (SearchOp(Kind.F, stage - 1, mb),)
    if kind is Kind.W:
        return (SearchOp(Kind.I, stage, mb),)
    if problem.is_last(stage):
        return (SearchOp(Kind.F, stage, mb),)
    return (SearchOp(Kind.F, stage, mb), SearchOp(Kind.I, stage + 1, mb))


def _arrival(problem: Problem, producer: SearchOp, consumer: SearchOp, end: float) -> float:
    same = problem.rank_of(producer.stage) == problem.rank_of(consumer.stage)
    return end if same else end + problem.comm


def evaluate(problem: Problem, order: Order) -> Evaluation | None:
    """Replay `order`; None when it cannot run to the end (a rank waits forever).

    Raises OrderError for an order that does not hold each rank's ops exactly once."""
    check_order(problem, order)
    done: dict[SearchOp, float] = {}
    heads = [0] * problem.ranks
    free = [0.0] * problem.ranks
    starts: list[list[float]] = [[] for _ in order]
    ends: list[list[float]] = [[] for _ in order]
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(order):
            while heads[rank] < len(ops):
                op = ops[heads[rank]]
                needs = _inputs(problem, op)
                if any(need not in done for need in needs):
                    break
                ready = max((_arrival(problem, n, op, done[n]) for n in needs), default=0.0)
                start = max(free[rank], ready)
                free[rank] = done[op] = start + problem.duration(op)
                starts[rank].append(start)
                ends[rank].append(free[rank])
                heads[rank] += 1
                progress = True
    if any(heads[rank] < len(ops) for rank, ops in enumerate(order)):
        return None
    return Evaluation(
        makespan=max(free),
        span=max(e[-1] - s[0] for s, e in zip(starts, ends, strict=True)),
        peak=tuple(_peak(problem, ops) for ops in order),
        start=tuple(map(tuple, starts)),
        end=tuple(map(tuple, ends)),
    )


def _peak(problem: Problem, ops: tuple[SearchOp, ...]) -> float:
    total = peak = 0.0
    for op in ops:
        total += problem.mem_delta(op)
        peak = max(peak, total)
    return peak


def fits(problem: Problem, evaluation: Evaluation, *, tolerance: float = 1e-9) -> bool:
    """Whether every rank's peak is within the cap."""
    return all(peak <= problem.cap + tolerance for peak in evaluation.peak)
