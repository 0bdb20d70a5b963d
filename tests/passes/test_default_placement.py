"""The default placement against torch's lowering, and its stall-freedom (docs/compile.md).

Over the grid of issue 22: every bundled schedule torch's lowering can express (one pipe),
P in {2, 4, 8}, M in {P, 2P, 4P} where the schedule's `require` admits the sizes, unit costs
(F=1, B=2, I=1, W=1) with comm latency 0, 0.1, 0.5 and 1 under nccl, the durations taken per
stage and per share of the model (scaled by P/S for S stages per pipe, the latency not). The
default program must be at least as fast as `--lowering torch` in every case (within 1e-9),
and pass every comm model. Every bundled schedule (DualPipe included) must show no
placement-bound wait (`verify --stall-budget 0`) at comm 0 and 0.1, in both conventions.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import pytest

from pipecc.api import bundled_schedules, compile_schedule
from pipecc.diagnostics import InputError
from pipecc.ir.program import Program
from pipecc.passes.insert_comms import strip_comms
from pipecc.passes.torch_program import lower_as_torch
from pipecc.semantics import CommModel, replay
from pipecc.semantics.costs import CostModel, CostTiming, parse_cost_flag
from pipecc.semantics.wiring import Wiring, wire
from pipecc.verify import Options, verify
from pipecc.verify.stall_budget import StallBudget

COMMS = (0.0, 0.1, 0.5, 1.0)
RANKS = (2, 4, 8)
CONVENTIONS = ("stage", "share")
NOISE = 1e-9


@cache
def _default(name: str, ranks: int, microbatches: int) -> Program | None:
    try:
        return compile_schedule(name, ranks=ranks, microbatches=microbatches)
    except InputError:
        return None  # a `require` the sizes violate


def _sizes(name: str) -> Iterator[tuple[int, int, Program]]:
    for p in RANKS:
        for m in (p, 2 * p, 4 * p):
            program = _default(name, p, m)
            if program is not None:
                yield p, m, program


def _costs(program: Program, convention: str, comm: float) -> CostModel:
    costs = parse_cost_flag(f"F=1,B=2,I=1,W=1,comm={comm:g}")
    if convention == "share":
        return costs.for_program(program)  # every command's convention (docs/simulate.md)
    return costs


def _makespan(program: Program, costs: CostModel, wiring: Wiring) -> float:
    run = replay(program, model=CommModel.NCCL, timing=CostTiming(costs), wiring=wiring)
    assert run.finished
    return run.makespan()


def _pipes(name: str) -> int:
    program = _default(name, 4, 16)
    assert program is not None
    return program.placement.num_pipes


ONE_PIPE = [name for name in bundled_schedules() if _pipes(name) == 1]


def test_the_grid_covers_every_schedule_torch_can_run() -> None:
    # DualPipe's two pipes are the only placement torch cannot express
    assert sorted(set(bundled_schedules()) - set(ONE_PIPE)) == ["dualpipe"]


@pytest.mark.parametrize("name", ONE_PIPE)
def test_default_is_not_slower_than_torchs_lowering(name: str) -> None:
    losses = []
    for p, m, default in _sizes(name):
        torch = lower_as_torch(strip_comms(default), defer=False)
        ours, theirs = wire(default), wire(torch)
        for convention in CONVENTIONS:
            for comm in COMMS:
                costs = _costs(default, convention, comm)
                mine, torchs = _makespan(default, costs, ours), _makespan(torch, costs, theirs)
                if mine > torchs + NOISE:
                    losses.append(f"P={p} M={m} {convention} comm={comm:g}: {mine:g} > {torchs:g}")
    assert not losses, f"{name}: default slower than --lowering torch in " + "; ".join(losses)


@pytest.mark.parametrize("name", sorted(bundled_schedules()))
def test_default_programs_pass_every_comm_model(name: str) -> None:
    for p, m, default in _sizes(name):
        report = verify(default, Options(models=tuple(CommModel)))
        assert report.ok, f"{name} P={p} M={m}: {report.violations[:1]}"


@pytest.mark.parametrize("name", sorted(bundled_schedules()))
def test_default_programs_pass_a_zero_stall_budget(name: str) -> None:
    for p, m, default in _sizes(name):
        for convention in CONVENTIONS:
            for comm in (0.0, 0.1):
                costs = _costs(default, convention, comm)
                options = Options(costs=costs, stall_budget=StallBudget(0.0))
                report = verify(default, options)
                assert report.ok, (
                    f"{name} P={p} M={m} {convention} comm={comm:g}: {report.violations[:1]}"
                )
