"""One `pipecc search --layers` request: the cut, the order and the recomputation from a
per-layer profile, lowered and checked like every search result, with the uniform cuts'
bundled schedules beside it.

The chosen cut's per-stage costs (sums of its layers', `pipecc.search.partition`) are the
`[cost.stage.N]` tables of an ordinary search request, so lowering, verification, the
makespan under --comm and the bundled baseline are those of `pipecc.search.run`; the
written `.costs.toml` holds them. For `--placement auto` each placement's best cut is
finished that way and the shorter step wins.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any, NamedTuple

from pipecc.search.baseline import compiled_orders
from pipecc.search.engine import placements
from pipecc.search.layers import Cut, Profile, format_size, uniform_cut
from pipecc.search.lower import as_run_on, compare_makespan, stage_costs
from pipecc.search.partition import (
    Found,
    Setting,
    any_cut_bound,
    cut_problem,
    memory_peaks,
    search_cuts,
)
from pipecc.search.problem import MemDeltas, Problem, evaluate, fits
from pipecc.search.run import NoScheduleError, Outcome, Request, finish
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel, HostCost


class LayerRequest(NamedTuple):
    """The parsed command line of a layer search."""

    profile: Profile
    ranks: int
    microbatches: int
    cap: float | None  # bytes per rank; None: no cap
    placement: str  # loop | vshape | auto
    comm: CommModel
    time_limit: float | None
    seed: int
    policy: str
    backend: str

    def setting(self, placement: str) -> Setting:
        return Setting(self.profile, self.ranks, self.microbatches, placement, self.cap)


class Uniform(NamedTuple):
    """A bundled schedule on the uniform cut: its step as `pipecc compare` simulates it
    (None: it does not fit the cap)."""

    placement: str
    counts: tuple[int, ...]
    schedule: str
    makespan: float | None


class LayerOutcome(NamedTuple):
    """The chosen cut, the finished search result on it, and what the report adds."""

    cut: Cut
    outcome: Outcome
    peaks: tuple[float, ...]  # per rank, bytes
    uniform: tuple[Uniform, ...]
    any_cut_bound: float
    seconds: float

    @property
    def best_uniform(self) -> Uniform | None:
        fitting = [u for u in self.uniform if u.makespan is not None]
        return min(fitting, key=lambda u: (u.makespan, u.schedule)) if fitting else None

    def stages(self, profile: Profile) -> list[dict[str, Any]]:
        """The cut as `--json` and the cut file give it."""
        return [
            {
                "index": s,
                "layers": [profile.layers[n].name for n in self.cut.span(s)],
                "recompute": "full" if self.cut.recompute[s] else None,
            }
            for s in range(self.cut.stages)
        ]

    def to_json(self, profile: Profile) -> dict[str, Any]:
        """The per-share search's keys (peak in bytes here) and the cut's."""
        best = self.best_uniform
        return {
            **self.outcome.to_json(),
            "seconds": self.seconds,
            "peak": list(self.peaks),
            "cut": self.stages(profile),
            "any_cut_bound": self.any_cut_bound,
            "uniform": [u._asdict() | {"counts": list(u.counts)} for u in self.uniform],
            "uniform_best": None if best is None else {"name": best.schedule,
                                                       "makespan": best.makespan},
        }  # fmt: skip


def run_layer_search(req: LayerRequest) -> LayerOutcome:
    """Search the cut of every requested placement, finish the best of each, keep the
    shortest step."""
    began = time.perf_counter()
    found: list[tuple[Setting, Found]] = []
    shares = len(placements(req.placement))
    for placement in placements(req.placement):
        setting = req.setting(placement)
        if len(req.profile.layers) < setting.stages:
            continue
        limit = None if req.time_limit is None else req.time_limit / shares
        results = search_cuts(setting, time_limit=limit, seed=req.seed)
        found += [(setting, results[0])] if results else []
    seconds = time.perf_counter() - began
    if not found:
        raise NoScheduleError(_nothing_fits(req))
    finished = [(_finish(req, setting, best, seconds), setting, best) for setting, best in found]
    outcome, setting, best = min(finished, key=lambda item: item[0].makespan)
    outcome = _recomputing(outcome, best.cut)
    program = outcome.lowered.program
    return LayerOutcome(
        best.cut,
        outcome,
        memory_peaks(program, req.profile, best.cut),
        tuple(u for placement in placements(req.placement) for u in _uniform(req, placement)),
        any_cut_bound(setting),
        seconds,
    )


def _recomputing(outcome: Outcome, cut: Cut) -> Outcome:
    """The outcome whose program names the stages the cut recomputes (its `recompute`
    field: the written JSON says so, and `pipecc run` runs them recomputed)."""
    stages = tuple(s for s in range(cut.stages) if cut.recompute[s])
    program = replace(outcome.lowered.program, recompute=stages)
    return outcome._replace(lowered=outcome.lowered._replace(program=program))


def _nothing_fits(req: LayerRequest) -> str:
    stages = min(req.setting(p).stages for p in placements(req.placement))
    if len(req.profile.layers) < stages:
        return (
            f"{req.profile.origin}: {len(req.profile.layers)} layers cannot fill {stages} "
            "stages (each stage holds at least one layer)"
        )
    cap = format_size(req.cap or 0)
    return (
        f"no cut fits --memory {cap}: on some rank the parameters, gradients and optimizer "
        "state with one microbatch's activations at a time exceed it, recomputing every "
        "stage that can"
    )


def _finish(req: LayerRequest, setting: Setting, best: Found, seconds: float) -> Outcome:
    problem = best.result.problem
    request = Request(
        ranks=req.ranks,
        microbatches=req.microbatches,
        costs=_costs(problem, req.profile),
        cap=problem.cap,
        mem=MemDeltas(),
        placement=problem.placement,
        objective="makespan",
        comm=req.comm,
        time_limit=req.time_limit,
        seed=req.seed,
        policy=req.policy,
        backend=req.backend,
    )
    outcome = finish(request, [best.result], [problem], seconds)
    return outcome._replace(costs_text=_with_host(outcome.costs_text, req.profile))


def _costs(problem: Problem, profile: Profile) -> CostModel:
    """The cut's per-stage costs with the profile's host time per post and per wait (the
    step the search reports and the uniform cuts' are simulated with them)."""
    host = HostCost(post=profile.post or None, wait=profile.wait or None)
    return replace(stage_costs(problem, profile.unit), host=host)


def _with_host(text: str, profile: Profile) -> str:
    """The written cost file with the profile's `post` and `wait` after its `comm`, so
    `pipecc simulate --cost-file` reproduces the reported step."""
    host = "".join(
        f"\n{k} = {v!r}" for k, v in (("post", profile.post), ("wait", profile.wait)) if v
    )
    return re.sub(r"^(comm = .*)$", lambda m: m[1] + host, text, count=1, flags=re.M)


def _uniform(req: LayerRequest, placement: str) -> list[Uniform]:
    """Each bundled schedule of `placement` on the uniform cut, as compare simulates it."""
    setting = req.setting(placement)
    if len(req.profile.layers) < setting.stages:
        return []
    cut = uniform_cut(len(req.profile.layers), setting.stages)
    problem = cut_problem(setting, cut)
    costs = None if problem is None else _costs(problem, req.profile)
    found = []
    for name, order, program in compiled_orders(req.ranks, req.microbatches, placement):
        evaluation = None if problem is None else evaluate(problem, order)
        makespan = None
        if problem is not None and costs is not None and evaluation is not None:
            if fits(problem, evaluation):
                run = as_run_on(program, req.backend)
                makespan = compare_makespan(run, costs, model=req.comm)
        found.append(Uniform(placement, cut.counts(), name, makespan))
    return found
