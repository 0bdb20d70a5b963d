"""A fixed order timed again under other costs: the replay of `problem.evaluate`, with the
order's structure (each op's predecessor on its rank and its inputs) worked out once.

The layer search scores many cuts of one placement with the same orders: the ops, their
ranks and their inputs do not change with the cut, only the durations and the memory
changes. `OrderReplay` takes an order that runs to the end (as `evaluate` decides), lists
its ops in an order that respects every dependency (`evaluate`'s own sweep), and then
times it for any durations with one pass over flat lists. The times are `evaluate`'s:
each op starts at the later of its rank's previous op's end and its inputs' ends (plus
`comm` between ranks); a test checks they agree on random problems.
"""

from __future__ import annotations

import math

from pipecc.ir.ops import Kind
from pipecc.search.problem import Order, Problem, SearchOp, _inputs, evaluate

_KIND = {Kind.F: 0, Kind.I: 1, Kind.W: 2}


class OrderReplay:
    """One order's structure, for timing it under other costs of the same placement."""

    __slots__ = ("ranks", "_seq", "_count", "_rank_ops", "_lasts")

    def __init__(self, problem: Problem, order: Order) -> None:
        if evaluate(problem, order) is None:
            raise ValueError("the order does not run to the end")
        sequence = _dependency_order(problem, order)
        # ops numbered from 1 in that order; 0 is a sentinel that ended at time 0
        ids = {order[rank][pos]: n + 1 for n, (rank, pos) in enumerate(sequence)}
        seq = []
        for rank, pos in sequence:
            op = order[rank][pos]
            prev = ids[order[rank][pos - 1]] if pos else 0
            needs = [
                (ids[need], 1.0 if problem.rank_of(need.stage) != rank else 0.0)
                for need in _inputs(problem, op)
            ]
            (n1, c1), (n2, c2) = (*needs, (0, 0.0), (0, 0.0))[:2]
            seq.append((prev, _KIND[op.kind] * problem.num_stages + op.stage, n1, c1, n2, c2))
        self.ranks = problem.ranks
        self._seq = tuple(seq)
        self._count = len(ids)
        self._lasts = tuple(ids[ops[-1]] for ops in order if ops)
        self._rank_ops = tuple(
            tuple(_KIND[op.kind] * problem.num_stages + op.stage for op in ops) for ops in order
        )

    def makespan(self, problem: Problem) -> float:
        """The order's makespan under `problem`'s durations and latency (same placement)."""
        timed = self.score(problem)
        assert timed is not None
        return timed[0]

    def score(self, problem: Problem, cutoff: float = math.inf) -> tuple[float, float] | None:
        """(makespan, the sum of the ranks' finishing times): the search's score; None as
        soon as an op ends past `cutoff`."""
        durations = (*problem.f, *problem.i, *problem.w)
        comm = problem.comm
        end = [0.0]
        append = end.append
        for prev, what, n1, c1, n2, c2 in self._seq:
            start = end[prev]
            ready = end[n1] + c1 * comm
            if ready > start:
                start = ready
            ready = end[n2] + c2 * comm
            if ready > start:
                start = ready
            start += durations[what]
            if start > cutoff:
                return None
            append(start)
        return max(end), sum(end[last] for last in self._lasts)

    def fits(self, problem: Problem, tolerance: float = 1e-9) -> bool:
        """Whether every rank's running memory total stays within `problem`'s cap."""
        deltas = (*problem.mem_f, *problem.mem_i, *problem.mem_w)
        cap = problem.cap + tolerance
        for ops in self._rank_ops:
            total = 0.0
            for what in ops:
                total += deltas[what]
                if total > cap:
                    return False
        return True


def _dependency_order(problem: Problem, order: Order) -> list[tuple[int, int]]:
    """(rank, position) of every op, each after its inputs and its rank's earlier ops (the
    sweep of `evaluate`)."""
    done: set[SearchOp] = set()
    heads = [0] * len(order)
    out = []
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(order):
            while heads[rank] < len(ops):
                op = ops[heads[rank]]
                if any(need not in done for need in _inputs(problem, op)):
                    break
                done.add(op)
                out.append((rank, heads[rank]))
                heads[rank] += 1
                progress = True
    return out
