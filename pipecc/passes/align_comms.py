"""Place sends, receives and waits so that no rank waits for a message it could have had.

Requires: a program (compute-only or lowered; every comm op in it, hand-placed ones
included, is discarded and placed again), a cost model and the comm model it will run under.
Ensures: the same compute order on every rank; every message sent once and received once,
in one global order on every pair, so the program is deadlock-free and mismatch-free under
every comm model (the argument of `insert_comms`); and, for the given costs and comm model,
as little placement-bound wait as the candidates below reach — zero on every bundled schedule
that was measured (docs/align.md, benchmarks/align.py).

Algorithm (deterministic, linear in instructions per candidate):
1. Replay the compute order with the real durations and latencies, each op as soon as its
   inputs exist: the pure-dataflow timeline, the best any placement can reach.
2. Lower with that timeline (`insert_comms.lower`): a send right after the op that produces
   its tensor; a receive before the compute op during which its message comes to exist (so a
   rendezvous transfer can start the moment the data is there — posted any later, the
   transfer would wait for the receiver to finish its current op); a send completed once its
   receiver has consumed it, a receive right before the op that needs it.
3. Groups matter only where ops queue on nccl streams. Three groupings are tried — posts of
   one moment together, every post alone, every gap's posts together — each replayed under
   the comm model; the one with the least placement-bound wait (then the shortest makespan)
   is kept.
"""

from __future__ import annotations

from dataclasses import replace

from pipecc.analysis.gaps import classify
from pipecc.ir.program import Program
from pipecc.passes.insert_comms import CommPlacement, Grouping, RecvPosting, lower, strip_comms
from pipecc.perf import paused_gc
from pipecc.semantics import CommModel, replay
from pipecc.semantics.costs import CostModel, CostTiming

POLICY = "aligned"
CANDIDATES = (Grouping.BY_TIME, Grouping.NONE, Grouping.PER_GAP)


def align_comms(
    prog: Program, *, costs: CostModel, model: CommModel = CommModel.NCCL_SINGLE
) -> Program:
    """Re-place every comm op of `prog` for `costs` under `model` (module docstring)."""
    with paused_gc():
        return _align(prog, costs, model)


def _align(prog: Program, costs: CostModel, model: CommModel) -> Program:
    compute_only = strip_comms(prog)
    timing = CostTiming(costs)
    base = CommPlacement(
        POLICY,
        duration=timing.op_duration,
        latency=costs.latency,
        recv_posting=RecvPosting.BEFORE_BUSY,
    )
    best: tuple[float, float, int] | None = None
    chosen = None
    for order, grouping in enumerate(CANDIDATES):
        candidate = lower(compute_only, replace(base, grouping=grouping))
        score = (*_score(candidate, costs, model), order)
        if best is None or score < best:
            best, chosen = score, candidate
    assert chosen is not None
    return chosen


def _score(program: Program, costs: CostModel, model: CommModel) -> tuple[float, float]:
    """(total placement-bound wait, makespan) of `program` under `model` with `costs`."""
    run = replay(program, model=model, timing=CostTiming(costs))
    if not run.finished:  # cannot happen (the lowering's argument); never prefer it
        return (float("inf"), float("inf"))
    gaps = classify(program, run, costs)
    placement = sum(gap.placement for rank in gaps for gap in rank)
    return (round(placement, 9), round(run.makespan(), 9))
