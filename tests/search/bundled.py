"""The compute order of a bundled schedule as a search `Order` (tests and benchmarks).

A bundled `.sched` is compiled with pipecc for the problem's P and M; its compute ops become
`SearchOp`s (a full backward B becomes I then W, which the latency model runs back to back,
exactly as one B of duration I + W with B's memory change), so `problem.evaluate` times the
schedule in the same model as the search.
"""

from __future__ import annotations

from pipecc.api import compile_schedule
from pipecc.diagnostics import PipeccError
from pipecc.ir.ops import Compute, Fused, Kind
from pipecc.search.problem import OpKind, Order, Placement, Problem, SearchOp

BUNDLED = {
    Placement.LOOP: ("1f1b", "zb_h1", "zb_h2"),
    Placement.VSHAPE: ("zbv",),
}
"""The bundled schedules whose placement the search models, by placement."""

_KINDS = {
    Kind.F: (OpKind.F,),
    Kind.I: (OpKind.I,),
    Kind.W: (OpKind.W,),
    Kind.B: (OpKind.I, OpKind.W),
}


def bundled_order(name: str, problem: Problem) -> Order | None:
    """`name`'s compute order at the problem's size; None when its `require` refuses it."""
    try:
        program = compile_schedule(name, ranks=problem.ranks, microbatches=problem.microbatches)
    except PipeccError:
        return None
    order: list[tuple[SearchOp, ...]] = []
    for rank, instrs in enumerate(program.ranks):
        ops: list[SearchOp] = []
        for instr in instrs:
            if isinstance(instr, Fused):
                raise ValueError(f"{name}: fused ops have no search equivalent")
            if not isinstance(instr, Compute):
                continue
            if instr.pipe != 0 or problem.rank_of(instr.stage) != rank:
                raise ValueError(
                    f"{name}: rank {rank} runs stage {instr.stage}, not this placement"
                )
            ops.extend(SearchOp(kind, instr.stage, instr.mb) for kind in _KINDS[instr.kind])
        order.append(tuple(ops))
    return tuple(order)
