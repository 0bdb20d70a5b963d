"""An exact solver for small search problems (the optional `exact` extra: OR-Tools CP-SAT).

The model is the search's own space: every op is an interval on its rank's timeline, the
ranks run one op at a time (no overlap), each op starts after its inputs end (plus `comm`
between ranks), each op kind of a stage runs its microbatches in order (FIFO), and each
rank's running memory total, counted at op starts, stays within the cap (a reservoir).
CP-SAT works on integers: durations and the latency are scaled by the smallest power of ten
that makes them whole (rounded past 10⁴, and then no optimality is claimed), memory deltas
and the cap likewise. The order read off the solver's starts is replayed with
`problem.evaluate`, whose value is the one returned. Under the span objective the model may
start a rank late, which the replay does not, so an optimum is claimed there only when the
replay reaches the model's value.

pipecc works without OR-Tools: it is imported only inside `solve`.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, NamedTuple

from pipecc.ir.ops import Kind
from pipecc.search.bounds import earliest_starts, lower_bound, memory_precedences
from pipecc.search.problem import (
    SPLIT,
    Objective,
    Order,
    Problem,
    SearchOp,
    _inputs,
    evaluate,
    fits,
)

_MAX_DIGITS = 4
DEFAULT_WORK = 20.0  # CP-SAT's deterministic seconds (about a second of one core each)
DEFAULT_CLOCK = 300.0  # a wall-clock safety limit; the deterministic budget ends it first


class ExactResult(NamedTuple):
    """The solver's best order (None if it found none), its replayed value, whether that
    value is proven optimal, and the best lower bound the solver proved."""

    order: Order | None
    value: float
    optimal: bool
    bound: float


class ExactSolverMissing(RuntimeError):
    """OR-Tools is not installed (`pip install 'pipecc[exact]'`)."""


def available() -> bool:
    """Whether the exact solver can run here (OR-Tools is installed)."""
    return importlib.util.find_spec("ortools") is not None


def solve(
    problem: Problem,
    *,
    time_limit: float = DEFAULT_CLOCK,
    hint: Order | None = None,
    workers: int = 1,
    work: float | None = DEFAULT_WORK,
    seed: int = 0,
) -> ExactResult:
    """The best order CP-SAT finds within `work` deterministic seconds (CP-SAT's
    deterministic time, about a second of one core each; None: no such limit) and
    `time_limit` seconds of the clock, starting from `hint` (by default `one_at_a_time`).
    With one worker (the default) the result depends only on the problem, the hint, `seed`
    and `work`, wherever the clock does not end the solve first, so a loaded machine gets
    the same answer as a quiet one, only later."""
    try:
        from ortools.sat.python import cp_model  # type: ignore[import-not-found,unused-ignore]  # optional extra
    except ImportError as err:
        raise ExactSolverMissing(
            "the exact solver needs OR-Tools: pip install 'pipecc[exact]'"
        ) from err
    time_scale, exact_times = _scale((*problem.f, *problem.i, *problem.w, problem.comm))
    mem_scale, exact_mem = _scale((*problem.mem_f, *problem.mem_i, *problem.mem_w))
    model = cp_model.CpModel()
    built = _Model(problem, model, time_scale, mem_scale)
    if exact_times:
        built.add_implied()
    objective = built.objective()
    floor = lower_bound(problem) * time_scale
    if exact_times and math.isfinite(floor):
        model.add(objective >= math.ceil(floor - 1e-6))
    built.add_hint(hint if hint is not None else one_at_a_time(problem))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    if work is not None:
        solver.parameters.max_deterministic_time = work
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        proven_empty = status == cp_model.INFEASIBLE and exact_mem
        return ExactResult(None, math.inf, proven_empty, math.inf if proven_empty else 0.0)
    order = built.read_order(solver)
    evaluation = evaluate(problem, order)
    assert evaluation is not None and fits(problem, evaluation), "the model admits a bad order"
    value = evaluation.score(problem.objective)
    model_value = solver.objective_value / time_scale
    proven = status == cp_model.OPTIMAL and exact_times and exact_mem
    proven = proven and math.isclose(value, model_value, rel_tol=1e-9, abs_tol=1e-9)
    return ExactResult(order, value, proven, solver.best_objective_bound / time_scale)


def one_at_a_time(problem: Problem) -> Order:
    """Each rank runs one microbatch at a time (its forwards up, then each I with its W back
    down): a slow order that fits any cap that one microbatch fits, the solver's default hint."""
    order = []
    for rank in range(problem.ranks):
        stages = problem.stages_of(rank)
        ops: list[SearchOp] = []
        for mb in range(problem.microbatches):
            ops.extend(SearchOp(Kind.F, stage, mb) for stage in stages)
            for stage in reversed(stages):
                ops += [SearchOp(Kind.I, stage, mb), SearchOp(Kind.W, stage, mb)]
        order.append(tuple(ops))
    return tuple(order)


def _scale(values: tuple[float, ...]) -> tuple[int, bool]:
    """The smallest power of ten (up to 10⁴) that makes every value whole, and whether one
    does."""
    for digits in range(_MAX_DIGITS + 1):
        scale = 10**digits
        if all(abs(v * scale - round(v * scale)) <= 1e-6 * max(1.0, abs(v)) for v in values):
            return scale, True
    return 10**_MAX_DIGITS, False


class _Model:
    """The CP-SAT variables and constraints of one problem."""

    def __init__(self, problem: Problem, model: Any, time_scale: int, mem_scale: int) -> None:
        self.p, self.model, self.time_scale = problem, model, time_scale
        self.ops = [op for rank in range(problem.ranks) for op in problem.ops_of(rank)]
        self.size = {op: round(problem.duration(op) * time_scale) for op in self.ops}
        self.lag = round(problem.comm * time_scale)
        horizon = sum(self.size.values()) + self.lag * len(self.ops) + 1
        self.start = {op: model.new_int_var(0, horizon, f"s_{op}") for op in self.ops}
        self.end = {op: self.start[op] + self.size[op] for op in self.ops}
        self.horizon = horizon
        self._ranks(mem_scale)
        self._precedences()

    def _ranks(self, mem_scale: int) -> None:
        cap = math.floor(self.p.cap * mem_scale + 1e-6) if math.isfinite(self.p.cap) else None
        for rank in range(self.p.ranks):
            ops = self.p.ops_of(rank)
            intervals = [
                self.model.new_fixed_size_interval_var(self.start[op], self.size[op], f"x_{op}")
                for op in ops
            ]
            self.model.add_no_overlap(intervals)
            if cap is None:
                continue
            deltas = [round(self.p.mem_delta(op) * mem_scale) for op in ops]
            low = sum(d for d in deltas if d < 0)
            self.model.add_reservoir_constraint(
                [self.start[op] for op in ops], deltas, min(low, 0), cap
            )

    def _precedences(self) -> None:
        for op in self.ops:
            rank = self.p.rank_of(op.stage)
            for need in _inputs(self.p, op):
                lag = 0 if self.p.rank_of(need.stage) == rank else self.lag
                self.model.add(self.start[op] >= self.end[need] + lag)
            if op.mb > 0:
                self.model.add(self.start[op] >= self.end[SearchOp(op.kind, op.stage, op.mb - 1)])

    def add_implied(self) -> None:
        """Constraints every order that fits satisfies (from the lower bound's graph): the
        memory edges and each op's earliest start. They only speed the proof up."""
        for earlier, later in memory_precedences(self.p) or ():
            self.model.add(self.start[later] >= self.end[earlier])
        scale = self.time_scale
        for op, head in (earliest_starts(self.p) or {}).items():
            self.model.add(self.start[op] >= math.ceil(head * scale - 1e-6))

    def _lasts(self, rank: int) -> list[SearchOp]:
        last = self.p.microbatches - 1
        return [SearchOp(kind, stage, last) for stage in self.p.stages_of(rank) for kind in SPLIT]

    def objective(self) -> Any:
        """The objective variable, minimised."""
        value = self.model.new_int_var(0, self.horizon, "objective")
        for rank in range(self.p.ranks):
            first = self.start[SearchOp(Kind.F, self.p.stages_of(rank)[0], 0)]
            for op in self._lasts(rank):
                if self.p.objective is Objective.MAKESPAN:
                    self.model.add(value >= self.end[op])
                else:
                    self.model.add(value >= self.end[op] - first)
        self.model.minimize(value)
        return value

    def add_hint(self, order: Order) -> None:
        """Hint the solver with the ASAP times of a known order."""
        evaluation = evaluate(self.p, order)
        if evaluation is None:
            return
        scale = self.time_scale
        for rank, ops in enumerate(order):
            for op, start in zip(ops, evaluation.start[rank], strict=True):
                self.model.add_hint(self.start[op], round(start * scale))

    def read_order(self, solver: Any) -> Order:
        """Each rank's ops sorted by the solver's start times."""
        return tuple(
            tuple(sorted(self.p.ops_of(rank), key=lambda op: solver.value(self.start[op])))
            for rank in range(self.p.ranks)
        )
