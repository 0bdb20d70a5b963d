"""The bundled schedules as search orders: the baseline a search result is compared with.

Every bundled schedule whose placement is the problem's (loop or vshape) and which compiles
for the problem's P and M without fused ops is turned into an `Order` (a full backward B is
an I followed at once by its W: the same durations, B = I + W, and the same memory, B's
change being I's plus W's). Those that fit the memory cap are candidates of the search and
the `baseline` of its report, where each is simulated as `pipecc compare` simulates it (the
compiled program, the costs converted for it, the comm model).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NamedTuple

from pipecc.api import bundled_schedules, compile_schedule, read_text
from pipecc.diagnostics import PipeccError
from pipecc.ir.ops import Compute, Fused, Kind
from pipecc.ir.program import Program
from pipecc.search.problem import Order, Problem, SearchOp, evaluate, fits

_SPLIT = {
    Kind.F: (Kind.F,),
    Kind.I: (Kind.I,),
    Kind.W: (Kind.W,),
    Kind.B: (Kind.I, Kind.W),
}


class Bundled(NamedTuple):
    """A bundled schedule's order for the problem, its latency-model makespan and its
    compiled program (the default comm placement, as `pipecc compare` compiles it)."""

    name: str
    order: Order
    score: float
    program: Program


@functools.lru_cache(maxsize=8)
def bundled_orders(problem: Problem) -> tuple[Bundled, ...]:
    """The bundled schedules of the problem's placement that compile, as orders that fit the
    cap, best first (without the split, only those that run full backwards)."""
    found = []
    for name, order, program in compiled_orders(problem.ranks, problem.microbatches,
                                                problem.placement):  # fmt: skip
        if not problem.split and _splits(program):
            continue  # `--no-split`: only schedules of full backwards
        evaluation = evaluate(problem, order)
        if evaluation is not None and fits(problem, evaluation):
            found.append(Bundled(name, order, evaluation.score(problem.objective), program))
    return tuple(sorted(found, key=lambda b: (b.score, b.name)))


@functools.lru_cache(maxsize=8)
def compiled_orders(
    ranks: int, microbatches: int, placement: str
) -> tuple[tuple[str, Order, Program], ...]:
    """(name, order, program) of every bundled schedule of `placement` that compiles for
    `ranks` and `microbatches` without fused ops: what does not depend on the costs."""
    found = []
    for name, path in bundled_schedules().items():
        compiled = _order(name, path, ranks, microbatches, placement)
        if compiled is not None:
            found.append((name, *compiled))
    return tuple(found)


def _splits(program: Program) -> bool:
    """The program runs an I (the zero-bubble split)."""
    return any(type(i) is Compute and i.kind is Kind.I for instrs in program.ranks for i in instrs)


def _placement_line(path: Path) -> str | None:
    """The `placement` declaration's value of a schedule file (`loop` without one)."""
    found = re.search(r"^placement\s+(\S+)", read_text(path), re.MULTILINE)
    return found[1] if found else "loop"


def _order(
    name: str, path: Path, ranks: int, microbatches: int, placement: str
) -> tuple[Order, Program] | None:
    if _placement_line(path) != placement:  # spares compiling the others
        return None
    try:
        program = compile_schedule(path, ranks=ranks, microbatches=microbatches)
    except PipeccError:  # the schedule does not support this size
        return None
    if program.placement.name != placement or program.placement.num_pipes > 1:
        return None  # (two pipes: their stages are not the search's numbering)
    order = []
    for instrs in program.ranks:
        ops: list[SearchOp] = []
        for instr in instrs:
            if type(instr) is Compute:
                ops += [SearchOp(kind, instr.stage, instr.mb) for kind in _SPLIT[instr.kind]]
            elif type(instr) is Fused:  # two ops overlapped: not in the search's op set
                return None
        order.append(tuple(ops))
    return tuple(order), program
