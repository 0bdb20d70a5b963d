"""A found order → a verified, aligned pipecc Program, and the per-stage costs of its cut.

The compute order becomes a compute-only Program with the loop or V placement; the
alignment pass (`--align`, docs/align.md) places its sends, receives and waits for the cut's
costs under the chosen comm model; the result is then verified under every comm model, its
compute order is checked to be the searched one, its memory is checked against the cap, and
it is simulated. This module is the search's only door into the compiler, the verifier and
the simulator.
"""

from __future__ import annotations

from typing import NamedTuple

from pipecc.diagnostics import PipeccError
from pipecc.ir.ops import Compute, Kind
from pipecc.ir.placement import loop_placement, vshape_placement
from pipecc.ir.program import Program
from pipecc.passes.align_comms import align_comms
from pipecc.search.problem import (
    OpKind,
    Order,
    Placement,
    Problem,
    SearchOp,
    evaluate,
    fits,
)
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel, StageCost
from pipecc.simulate.timeline import simulate
from pipecc.verify import ALL_MODELS, Options, verify

SOURCE = "pipecc search"
_KINDS = {OpKind.F: Kind.F, OpKind.I: Kind.I, OpKind.W: Kind.W}
_OP_KINDS = {kind: op for op, kind in _KINDS.items()}


class LoweringError(PipeccError):
    """The lowered program failed a check it must pass (a bug in the search, exit 1)."""

    exit_code = 1


class Lowered(NamedTuple):
    """The aligned program, the cut's costs, and its makespans under the two models."""

    program: Program
    costs: CostModel
    makespan: float  # under the comm model it was aligned for
    eager_makespan: float  # the latency model: what the search optimised


def chunk_of(problem: Problem, stage: int) -> int:
    """The chunk index of `stage` on its rank."""
    return 0 if problem.placement is Placement.LOOP or stage < problem.ranks else 1


def to_program(problem: Problem, order: Order, name: str = "search") -> Program:
    """The compute-only Program of `order`."""
    placement = (
        loop_placement(problem.ranks, 1)
        if problem.placement is Placement.LOOP
        else vshape_placement(problem.ranks)
    )
    ranks = tuple(
        tuple(
            Compute(_KINDS[op.kind], chunk_of(problem, op.stage), 0, op.stage, op.mb) for op in ops
        )
        for ops in order
    )
    return Program(
        schedule=name,
        source=SOURCE,
        num_ranks=problem.ranks,
        num_microbatches=problem.microbatches,
        params=(),
        comm="none",
        placement=placement,
        ranks=ranks,
    )


def compute_order(program: Program) -> Order:
    """The compute order of a (lowered) program, as search ops."""
    return tuple(
        tuple(
            SearchOp(_OP_KINDS[instr.kind], instr.stage, instr.mb)
            for instr in instrs
            if type(instr) is Compute
        )
        for instrs in program.ranks
    )


def stage_costs(problem: Problem, unit: str = "") -> CostModel:
    """The cut's per-stage costs: every stage's F, I, W (B = I + W) and the latency."""
    stages = tuple(
        (s, StageCost(F=problem.f[s], I=problem.i[s], W=problem.w[s]))
        for s in range(problem.num_stages)
    )
    return CostModel(base=StageCost(comm=problem.comm), stages=stages, unit=unit)


def costs_toml(problem: Problem, unit: str = "") -> str:
    """`stage_costs` as a cost file (`pipecc simulate --cost-file`)."""
    lines = [
        f"# per-stage costs of the {problem.placement.value} cut chosen by pipecc search",
        f"# (P={problem.ranks}, M={problem.microbatches}, {problem.num_stages} stages)",
        "",
        "[cost]",
    ]
    if unit:
        lines.append(f'unit = "{unit}"')
    # the cut the tables name (docs/simulate.md): another program converts them
    lines.append(f'placement = "{problem.placement.value}"')
    lines += [f"ranks = {problem.ranks}", f"stages = {problem.num_stages}"]
    lines.append(f"comm = {problem.comm!r}")
    for s in range(problem.num_stages):
        lines += ["", f"[cost.stage.{s}]", f"F = {problem.f[s]!r}", f"I = {problem.i[s]!r}"]
        lines.append(f"W = {problem.w[s]!r}")
    return "\n".join(lines) + "\n"


def compare_makespan(program: Program, costs: CostModel, *, model: CommModel) -> float:
    """The makespan `pipecc compare` prints for `program` with `costs` (as given: per share,
    converted for the program, host time included) under `model`."""
    return simulate(program, costs.for_program(program), model=model).makespan


def adopt(problem: Problem, program: Program, *, model: CommModel, unit: str = "") -> Lowered:
    """A bundled schedule's own program (verified where it is shipped) as the result, with
    the cut's costs."""
    costs = stage_costs(problem, unit)
    makespan = simulate(program, costs, model=model).makespan
    return Lowered(
        program, costs, makespan, simulate(program, costs, model=CommModel.EAGER).makespan
    )


def lower(
    problem: Problem, order: Order, *, model: CommModel, name: str = "search", unit: str = ""
) -> Lowered:
    """Align `order` for `model`, verify it under every comm model and check it (module
    docstring); raises LoweringError if any check fails."""
    costs = stage_costs(problem, unit)
    program = align_comms(to_program(problem, order, name), costs=costs, model=model)
    report = verify(program, Options(models=ALL_MODELS))
    if not report.ok:
        raise LoweringError(f"the searched program fails verification: {report.violations[0]}")
    if compute_order(program) != order:
        raise LoweringError("alignment changed the searched compute order")
    evaluation = evaluate(problem, order)
    if evaluation is None or not fits(problem, evaluation):
        raise LoweringError("the searched order does not run within the memory cap")
    makespan = simulate(program, costs, model=model).makespan
    eager = simulate(program, costs, model=CommModel.EAGER).makespan
    if abs(eager - evaluation.makespan) > 1e-6 * max(1.0, eager):
        raise LoweringError(
            f"the simulator's latency-model makespan {eager:g} differs from the search's"
            f" {evaluation.makespan:g}"
        )
    return Lowered(program, costs, makespan, eager)
