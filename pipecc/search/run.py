"""One `pipecc search` request from parsed input to a lowered, checked result.

`seconds` (the search time of the report) runs from the parsed request to the chosen
compute order: building the problems, the search of every placement, and the bundled
schedules' orders where the search uses them (when its climb ends above the lower bound);
lowering, alignment, verification, the baselines and writing are outside it.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import replace
from typing import Any, NamedTuple

from pipecc.diagnostics import InputError, PipeccError
from pipecc.ir.placement import Placement, bidirectional_placement
from pipecc.ir.program import Program
from pipecc.search.baseline import Bundled, bundled_orders
from pipecc.search.bounds import lower_bound
from pipecc.search.engine import (
    SearchResult,
    default_time_limit,
    placements,
    search,
    smallest_cap,
)
from pipecc.search.lower import (
    ALIGNED,
    Lowered,
    Placing,
    adopt,
    as_run_on,
    compare_makespan,
    costs_toml,
    lower,
)
from pipecc.search.problem import (
    Evaluation,
    MemDeltas,
    Objective,
    Order,
    Problem,
    evaluate,
)
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel


class Request(NamedTuple):
    """The parsed command line."""

    ranks: int
    microbatches: int
    costs: CostModel
    cap: float
    mem: MemDeltas
    placement: str  # loop | vshape | auto
    objective: str
    comm: CommModel  # the model the result is placed for (aligned) and reported under
    time_limit: float | None
    seed: int = 0
    policy: str = ALIGNED  # how its comm ops are placed (lower.Placing)
    backend: str = "nccl"  # the backend it is placed for: gloo or nccl
    split: bool = True  # False: full backwards only (`--no-split`)
    layout: Placement | None = None  # `--placement-from`: a .sched file's placement

    @property
    def placing(self) -> Placing:
        return Placing(self.policy, self.comm)


class Baseline(NamedTuple):
    """The best bundled schedule that fits the cap, simulated like the result: as `pipecc
    compare` simulates it (its compiled program, the given costs converted for it)."""

    name: str
    makespan: float
    order: Order
    problem: Problem
    program: Program


class NoScheduleError(PipeccError):
    """No order fits the memory cap (exit 1); the message gives the smallest cap that has one."""

    exit_code = 1


class Outcome(NamedTuple):
    """What the command reports and writes."""

    result: SearchResult
    problem: Problem
    order: Order
    lowered: Lowered
    makespan: float  # the written program's, as `pipecc compare` simulates it
    comm: CommModel
    placing: Placing
    backend: str
    lower_bound: float
    seconds: float
    baseline: Baseline | None
    chosen_by: str
    costs_text: str

    @property
    def gap(self) -> float:
        """makespan / lower_bound − 1; 0 where the two agree to rounding (the bound's sums
        and the replay's add the same durations in other orders)."""
        if self.lower_bound <= 0:
            return 0.0
        gap = self.makespan / self.lower_bound - 1
        return 0.0 if abs(gap) < 1e-12 else gap

    @property
    def evaluation(self) -> Evaluation:
        """The order's replay in the latency model."""
        evaluation = evaluate(self.problem, self.order)
        assert evaluation is not None
        return evaluation

    @property
    def peak(self) -> tuple[float, ...]:
        return self.evaluation.peak

    @property
    def span(self) -> float:
        return self.evaluation.span

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: exactly the keys of the command-line contract."""
        base = self.baseline
        return {
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "peak": list(self.peak),
            "placement": self.problem.placement,
            "seconds": self.seconds,
            "baseline": None if base is None else {"name": base.name, "makespan": base.makespan},
            "backend": self.backend,
            "comm": self.lowered.program.comm,
        }

    def header(self) -> str:
        """A comment header for the written files."""
        p = self.problem
        return (
            f"pipecc search  P={p.ranks} M={p.total_microbatches}  placement {p.placement}  "
            f"objective {p.objective.value}  comm {self.comm.value}  cap {p.cap:g}\n"
            f"per-stage costs: the .costs.toml written beside the program"
        )


def parse_mem(text: str) -> MemDeltas:
    """`--mem F=1,B=-1,I=0,W=-1` → the memory change of F, I and W (B = I + W)."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("F", "B", "I", "W"):
            raise InputError(f"--mem: expected F=, B=, I= or W= with a number, got {item!r}")
        try:
            values[key] = float(value)
        except ValueError:
            raise InputError(f"--mem: {key} must be a number, got {value.strip()!r}") from None
        if not math.isfinite(values[key]):
            raise InputError(f"--mem: {key} must be finite, got {value.strip()}")
    f = values.get("F", 1.0)
    if "B" in values and "I" in values and "W" in values:
        if abs(values["B"] - values["I"] - values["W"]) > 1e-12:
            raise InputError(
                f"--mem: B={values['B']:g} is not I + W = {values['I'] + values['W']:g}"
            )
    if "B" in values:
        i = values.get("I", values["B"] - values["W"] if "W" in values else 0.0)
        return MemDeltas(f, i, values.get("W", values["B"] - i))
    return MemDeltas(f, values.get("I", 0.0), values.get("W", -1.0))


def run_search(req: Request) -> Outcome:
    """Search every requested placement, keep the best, lower and check it."""
    began = time.perf_counter()
    problems = [_problem(req, placement) for placement in placements(req.placement)]
    limit = req.time_limit or default_time_limit(req.ranks, req.microbatches)
    limit /= len(problems)  # the time limit is the whole search's
    results, smallest, searched = [], [], []
    for problem in problems:
        need = smallest_cap(problem)
        smallest.append((need, problem.placement))
        if problem.cap < need - 1e-9:
            continue
        searched.append(problem)
        found = search(
            problem,
            time_limit=limit,
            seed=req.seed,
            bound=lower_bound,
            candidates=functools.partial(_bundled_candidates, problem),
        )
        if found is not None:
            results.append(found)
    seconds = time.perf_counter() - began
    bundled = {problem.placement: bundled_orders(problem) for problem in searched}
    if not results:
        need, placement = min(smallest)
        raise NoScheduleError(
            f"no schedule fits --memory {req.cap:g}: the smallest cap that has one is {need:g}"
            f" ({placement} placement, one microbatch in flight at a time)"
        )
    return _finish(req, results, bundled, searched, seconds)


def finish(
    req: Request, results: list[SearchResult], searched: list[Problem], seconds: float
) -> Outcome:
    """Lower, check and report search results found elsewhere (the layer search's), as
    `run_search` does with its own: the best of `results`, the bundled baseline of the
    `searched` problems."""
    bundled = {problem.placement: bundled_orders(problem) for problem in searched}
    return _finish(req, results, bundled, searched, seconds)


def _problem(req: Request, placement: str) -> Problem:
    layout = req.layout
    if placement == "bidirectional":
        layout = bidirectional_placement(req.ranks)
    if layout is not None and layout.num_pipes > 1 and req.objective == Objective.SPAN.value:
        raise InputError(
            "--objective span measures a rank from its first forward, which with several "
            "pipes need not be its first op: use --objective makespan"
        )
    try:
        return Problem.from_costs(
            req.costs,
            ranks=req.ranks,
            microbatches=req.microbatches,
            placement=placement,
            cap=req.cap,
            mem=req.mem,
            objective=Objective(req.objective),
            split=req.split,
            layout=layout,
        )
    except ValueError as err:
        raise InputError(str(err)) from None


def _bundled_candidates(problem: Problem) -> list[Order]:
    return [entry.order for entry in bundled_orders(problem)]


def _finish(
    req: Request,
    results: list[SearchResult],
    bundled: dict[str, tuple[Bundled, ...]],
    searched: list[Problem],
    seconds: float,
) -> Outcome:
    unit = req.costs.unit
    best, lowered, makespan = _best(req, results)
    baseline = _baseline(req, bundled, searched)
    problem, order, chosen = best.problem, best.order, "search"
    same = [b.name for b in bundled.get(problem.placement, []) if b.order == order]
    if same:
        chosen = f"search (the bundled {same[0]}'s order was the best found)"
    faster = baseline is not None and baseline.makespan < makespan - 1e-9
    if faster and baseline is not None and best.problem.objective is Objective.MAKESPAN:
        problem, order = baseline.problem, baseline.order
        lowered = lower(problem, order, placing=req.placing, unit=unit)
        makespan = compare_makespan(lowered.program, req.costs, model=req.comm)
        if makespan > baseline.makespan + 1e-9:  # its own placement beats ours
            lowered = adopt(problem, baseline.program, model=req.comm, unit=unit)
            makespan = baseline.makespan
        chosen = f"the bundled {baseline.name} (faster under {req.comm.value})"
    return Outcome(
        result=best,
        problem=problem,
        order=order,
        lowered=lowered,
        makespan=makespan,
        comm=req.comm,
        placing=req.placing,
        backend=req.backend,
        lower_bound=lower_bound(replace(problem, objective=Objective.MAKESPAN)),
        seconds=seconds,
        baseline=baseline,
        chosen_by=chosen,
        costs_text=costs_toml(problem, unit),
    )


def _best(req: Request, results: list[SearchResult]) -> tuple[SearchResult, Lowered, float]:
    """The result to keep: the best objective; for the makespan, the shortest as `pipecc
    compare` simulates it (with host time, under --comm), since the search's latency model
    can rank placements otherwise (--placement auto)."""
    ranked = sorted(results, key=lambda r: (r.score, r.problem.placement))
    if req.objective != Objective.MAKESPAN.value:
        ranked = ranked[:1]
    found = []
    for result in ranked:
        lowered = lower(result.problem, result.order, placing=req.placing, unit=req.costs.unit)
        found.append(
            (compare_makespan(lowered.program, req.costs, model=req.comm), result, lowered)
        )
    makespan, best, lowered = min(found, key=lambda item: item[0])
    return best, lowered, makespan


def _baseline(
    req: Request, bundled: dict[str, tuple[Bundled, ...]], problems: list[Problem]
) -> Baseline | None:
    """The bundled schedules in latency-model order; each is simulated as `pipecc compare
    --backend` does (its compiled program as `pipecc run` places it on the backend, the given
    costs, --comm) until the next one's latency-model step (a floor for every comm model and
    host time) cannot beat the best so far."""
    entries = sorted(
        ((entry, problem) for problem in problems for entry in bundled.get(problem.placement, ())),
        key=lambda pair: (pair[0].score, pair[0].name),
    )
    best = None
    for entry, problem in entries:
        if best is not None and entry.score >= best.makespan - 1e-9:
            break
        program = as_run_on(entry.program, req.backend)
        makespan = compare_makespan(program, req.costs, model=req.comm)
        if best is None or makespan < best.makespan:
            best = Baseline(entry.name, makespan, entry.order, problem, program)
    return best
