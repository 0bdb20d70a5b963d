"""A found order → a verified, placed pipecc Program, and the per-stage costs of its cut.

The compute order becomes a compute-only Program with the loop or V placement; its sends,
receives and waits are placed as a `Placing` says: by the alignment pass (`--align`,
docs/align.md) for the cut's costs under a comm model (the search's placement for NCCL), or
by a named lowering policy (early-recv: the placement `pipecc run` gives a compute-only
program on gloo). The result is then verified under every comm model its placement is meant
to run under (`Placing.verified_under`), its compute order is checked to be the searched
one, its memory is checked against the cap, and it is simulated. This module is the
search's only door into the compiler, the verifier and the simulator.
"""

from __future__ import annotations

from typing import NamedTuple

from pipecc.diagnostics import PipeccError
from pipecc.ir.ops import Compute, Kind
from pipecc.ir.program import Backend, Program
from pipecc.passes.align_comms import POLICY, align_comms
from pipecc.passes.comm.placement import backend_of
from pipecc.passes.insert_comms import POLICIES, insert_comms, strip_comms
from pipecc.search.problem import (
    Order,
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
ALIGNED = POLICY  # the alignment's policy name, "aligned"


class LoweringError(PipeccError):
    """The lowered program failed a check it must pass (a bug in the search, exit 1)."""

    exit_code = 1


def models_for(backend: Backend) -> tuple[CommModel, ...]:
    """The comm models a program that needs `backend` must complete under: every one, or
    for a placement that needs independent progress (early-recv: gloo) the two that give
    it."""
    if backend is Backend.INDEPENDENT_PROGRESS:
        return (CommModel.RENDEZVOUS, CommModel.EAGER)
    return ALL_MODELS


class Placing(NamedTuple):
    """How the comm ops of a found order are placed, and the comm model it is reported
    under: `policy` is "aligned" (the alignment pass for the cut's costs under `model`) or a
    lowering policy of `POLICIES` ("default", "early-recv"), placed with unit costs."""

    policy: str
    model: CommModel

    @property
    def backend(self) -> Backend:
        """What the placed program needs of the backend (Program.backend)."""
        return backend_of(self.policy)

    @property
    def verified_under(self) -> tuple[CommModel, ...]:
        """The comm models the placed program must complete under (`models_for`)."""
        return models_for(self.backend)

    def describe(self) -> str:
        """`aligned for nccl` or `early-recv`."""
        return f"{ALIGNED} for {self.model.value}" if self.policy == ALIGNED else self.policy


NCCL_ALIGNED = Placing(ALIGNED, CommModel.NCCL_SINGLE)  # what the runtime posts on NCCL


class Lowered(NamedTuple):
    """The aligned program, the cut's costs, and its makespans under the two models."""

    program: Program
    costs: CostModel
    makespan: float  # under the placing's comm model
    eager_makespan: float  # the latency model: what the search optimised


def chunk_of(problem: Problem, stage: int) -> int:
    """The chunk index of `stage` on its rank."""
    return problem.ir_placement().holder(*problem.ir_stage(stage)).chunk


def _compute(problem: Problem, op: SearchOp) -> Compute:
    """The IR op of a search op: its pipe, its stage in the pipe, its global microbatch."""
    pipe, stage = problem.ir_stage(op.stage)
    mb = problem.first_mb(op.stage) + op.mb
    return Compute(op.kind, chunk_of(problem, op.stage), pipe, stage, mb)


def program_order(problem: Problem, order: Order) -> Order:
    """`order` as its program runs it: without the split (`--no-split`) each I is a full B
    and the W placeholders are gone."""
    if problem.split:
        return order
    return tuple(
        tuple(
            SearchOp(Kind.B, op.stage, op.mb) if op.kind is Kind.I else op
            for op in ops
            if op.kind is not Kind.W
        )
        for ops in order
    )


def to_program(problem: Problem, order: Order, name: str = "search") -> Program:
    """The compute-only Program of `order`."""
    placement = problem.ir_placement()
    ranks = tuple(
        tuple(_compute(problem, op) for op in ops) for ops in program_order(problem, order)
    )
    return Program(
        schedule=name,
        source=SOURCE,
        num_ranks=problem.ranks,
        num_microbatches=problem.total_microbatches,
        params=(),
        comm="none",
        placement=placement,
        ranks=ranks,
    )


def _computes(program: Program) -> list[list[tuple[Kind, int, int, int]]]:
    """Each rank's computations as (kind, pipe, stage, microbatch)."""
    return [
        [(i.kind, i.pipe, i.stage, i.mb) for i in instrs if isinstance(i, Compute)]
        for instrs in program.ranks
    ]


def compute_order(program: Program) -> Order:
    """The compute order of a (lowered) program, as search ops."""
    return tuple(
        tuple(
            SearchOp(instr.kind, instr.stage, instr.mb)
            for instr in instrs
            if type(instr) is Compute
        )
        for instrs in program.ranks
    )


def stage_costs(problem: Problem, unit: str = "") -> CostModel:
    """The cut's per-stage costs: every stage's F, I, W (B = I + W) and the latency (the
    stages of one pipe: every pipe holds the same ones)."""
    stages = tuple(
        (s, StageCost(F=problem.f[s], I=problem.i[s], W=problem.w[s]))
        for s in range(problem.num_stages // problem.pipes)
    )
    return CostModel(base=StageCost(comm=problem.comm), stages=stages, unit=unit)


def costs_toml(problem: Problem, unit: str = "") -> str:
    """`stage_costs` as a cost file (`pipecc simulate --cost-file`)."""
    per_pipe = problem.num_stages // problem.pipes
    lines = [
        f"# per-stage costs of the {problem.placement} cut chosen by pipecc search",
        f"# (P={problem.ranks}, M={problem.total_microbatches}, {per_pipe} stages)",
        "",
        "[cost]",
    ]
    if unit:
        lines.append(f'unit = "{unit}"')
    # the cut the tables name (docs/simulate.md): another program converts them
    lines.append(f'placement = "{problem.placement}"')
    lines += [f"ranks = {problem.ranks}", f"stages = {per_pipe}"]
    lines.append(f"comm = {problem.comm!r}")
    for s in range(per_pipe):
        lines += ["", f"[cost.stage.{s}]", f"F = {problem.f[s]!r}", f"I = {problem.i[s]!r}"]
        lines.append(f"W = {problem.w[s]!r}")
    return "\n".join(lines) + "\n"


def compare_makespan(program: Program, costs: CostModel, *, model: CommModel) -> float:
    """The makespan `pipecc compare` prints for `program` with `costs` (as given: per share,
    converted for the program, host time included) under `model`."""
    return simulate(program, costs.for_program(program), model=model).makespan


def as_run_on(program: Program, backend: str) -> Program:
    """A bundled schedule's compiled program as `pipecc run` runs it on `backend`: on gloo
    its compute order placed by the early-recv policy (a bundled schedule places no comm op
    by hand), on nccl as compiled (the default policy)."""
    if backend != "gloo":
        return program
    return insert_comms(strip_comms(program), placement=POLICIES["early-recv"])


def adopt(problem: Problem, program: Program, *, model: CommModel, unit: str = "") -> Lowered:
    """A bundled schedule's own program, as `pipecc run` places it on the backend
    (`as_run_on`), as the result, with the cut's costs; verified like every result, under
    the comm models its placement needs (raises LoweringError if it fails)."""
    report = verify(program, Options(models=models_for(program.backend)))
    if not report.ok:
        raise LoweringError(f"the bundled program fails verification: {report.violations[0]}")
    costs = stage_costs(problem, unit)
    makespan = simulate(program, costs, model=model).makespan
    return Lowered(
        program, costs, makespan, simulate(program, costs, model=CommModel.EAGER).makespan
    )


def place(program: Program, costs: CostModel, placing: Placing) -> Program:
    """The compute-only `program` with its comm ops placed as `placing` says."""
    if placing.policy == ALIGNED:
        return align_comms(program, costs=costs, model=placing.model)
    return insert_comms(program, placement=POLICIES[placing.policy])


def placed_makespan(problem: Problem, order: Order, placing: Placing) -> float:
    """The step of `order` placed as `placing` says, under its comm model (no checks: for
    comparing bundled schedules, which are verified where they are shipped)."""
    costs = stage_costs(problem)
    program = place(to_program(problem, order), costs, placing)
    return simulate(program, costs, model=placing.model).makespan


def lower(
    problem: Problem,
    order: Order,
    *,
    placing: Placing = NCCL_ALIGNED,
    name: str = "search",
    unit: str = "",
) -> Lowered:
    """Place `order` as `placing` says, verify it under the comm models it is meant for and
    check it (module docstring); raises LoweringError if any check fails."""
    costs = stage_costs(problem, unit)
    compute_only = to_program(problem, order, name)
    program = place(compute_only, costs, placing)
    report = verify(program, Options(models=placing.verified_under))
    if not report.ok:
        raise LoweringError(f"the searched program fails verification: {report.violations[0]}")
    if _computes(program) != _computes(compute_only):
        raise LoweringError("alignment changed the searched compute order")
    evaluation = evaluate(problem, order)
    if evaluation is None or not fits(problem, evaluation):
        raise LoweringError("the searched order does not run within the memory cap")
    makespan = simulate(program, costs, model=placing.model).makespan
    eager = simulate(program, costs, model=CommModel.EAGER).makespan
    if abs(eager - evaluation.makespan) > 1e-6 * max(1.0, eager):
        raise LoweringError(
            f"the simulator's latency-model makespan {eager:g} differs from the search's"
            f" {evaluation.makespan:g}"
        )
    return Lowered(program, costs, makespan, eager)
