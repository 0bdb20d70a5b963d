"""Data dependencies: nothing runs or is sent before the data it needs exists (DESIGN §5).

Per rank, in program order: F(s, mb) after F(s-1, mb) when stage s-1 is on the same rank,
else after the recv of its activation is posted; B/I(s, mb) after F(s, mb) and after the
gradient from stage s+1 (locally, or through a posted recv); W(s, mb) after I(s, mb); a send
after the computation that makes its tensor. Across ranks the order is carried by messages:
with these local facts, a run without deadlock delivers every tensor after it is made.

`check_compute_order` decides whether a compute-only program (a torch CSV without comm
cells) can run at all, and names a dependency cycle when it cannot.
"""

from __future__ import annotations

import networkx as nx

from pipecc.diagnostics import (
    BackwardBeforeForwardError,
    BackwardBeforeGradientError,
    DataflowError,
    ForwardBeforeInputError,
    MissingRecvError,
    RecvAfterUseError,
    SendBeforeComputeError,
    UnrunnableOrderError,
    WeightBeforeInputGradError,
)
from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import Compute, Instr, Kind, Msg, Send, Sequential, computations, is_compute
from pipecc.semantics.wiring import inputs
from pipecc.verify.context import Context

# A fact is "F / a backward / an I of (pipe, stage, mb) has run": (position << 2) | one of
_F, _BACKWARD, _I = 0, 1, 2
_KF, _KW, _KI = Kind.F, Kind.W, Kind.I


def _parts(instr: Instr) -> tuple[Compute, ...]:
    return computations(instr)


def _fact(keys: MessageKeys, pipe: int, stage: int, mb: int, what: int) -> int:
    """The fact id, or -1 when (pipe, stage, mb) is outside the placement."""
    if not keys.inside(pipe, stage, mb):
        return -1
    return (keys.slot(pipe, stage, mb) << 2) | what


def _made_at(ctx: Context, rank: int) -> dict[int, float]:
    """fact -> index of the first instruction of `rank` that makes it (plus k/n for the
    k-th of the n parts of a Sequential, which run in order)."""
    keys, w = ctx.keys, ctx.wiring
    pipes, stages, slot = keys.pipes, keys.stages, keys.slot
    instrs, base = ctx.program.ranks[rank], w.offsets[rank]
    made: dict[int, float] = {}
    setdefault = made.setdefault
    for g in w.computes[rank]:
        instr = instrs[g - base]
        parts = computations(instr)
        for k, (kind, _, pipe, stage, mb, _) in enumerate(parts):
            if kind is _KW or not (0 <= pipe < pipes and 0 <= stage < stages[pipe]) or mb < 0:
                continue
            fact = slot(pipe, stage, mb) << 2
            at = g - base + (k / len(parts) if type(instr) is Sequential else 0)
            if kind is _KF:
                setdefault(fact, at)
                continue
            setdefault(fact | _BACKWARD, at)
            if kind is _KI:
                setdefault(fact | _I, at)
    return made


def check_dataflow(ctx: Context) -> None:
    """Report computations and sends placed before their data exists."""
    for rank in range(ctx.program.num_ranks):
        made = _made_at(ctx, rank)
        _check_computes(ctx, rank, made)
        _check_sends(ctx, rank, made)
    _check_received(ctx)


def _check_computes(ctx: Context, rank: int, made: dict[int, float]) -> None:
    """Each computation after what it needs on its own rank: facts are compared by the
    index of the first instruction that makes them (stage ± 1 is fact ± 4)."""
    keys, w = ctx.keys, ctx.wiring
    pipes, stages, slot, ranks_of = keys.pipes, keys.stages, keys.slot, keys.ranks_of
    instrs, base = ctx.program.ranks[rank], w.offsets[rank]
    never = len(instrs)
    get = made.get
    for g in w.computes[rank]:
        index = g - base
        instr = instrs[index]
        parts = inputs(instr)  # a MoE op needs its data at its first phase
        for k, op in enumerate(parts):
            kind, _, pipe, stage, mb, _ = op
            if not (0 <= pipe < pipes and 0 <= stage < stages[pipe]) or mb < 0:
                continue  # reported by the coverage check
            here = index + (k / len(parts) if type(instr) is Sequential else 0)
            fact = slot(pipe, stage, mb) << 2
            holders = ranks_of[pipe]
            if kind is _KW:
                if get(fact | _I, get(fact | _BACKWARD, never)) >= here:
                    _report(
                        ctx,
                        WeightBeforeInputGradError,
                        rank,
                        index,
                        op,
                        f"runs before I{op.chunk}.{mb}, the input-gradient backward it completes",
                    )
            elif kind is _KF:
                if stage and holders[stage - 1] == rank and get(fact - 4, never) >= here:
                    _report_local(ctx, rank, index, op, stage - 1)
            else:
                if holders[stage] == rank and get(fact, never) >= here:
                    _report(
                        ctx,
                        BackwardBeforeForwardError,
                        rank,
                        index,
                        op,
                        f"runs before its own forward F{op.chunk}.{mb}",
                    )
                if (
                    stage + 1 < len(holders)
                    and holders[stage + 1] == rank
                    and get((fact + 4) | _BACKWARD, never) >= here
                ):
                    _report_local(ctx, rank, index, op, stage + 1)


def _report_local(ctx: Context, rank: int, index: int, op: Compute, upstream: int) -> None:
    chunk = ctx.program.placement.holder(op.pipe, upstream).chunk
    if op.kind is _KF:
        _report(
            ctx,
            ForwardBeforeInputError,
            rank,
            index,
            op,
            f"runs before F of stage {upstream} (chunk {chunk}, same rank), which makes its input",
        )
    else:
        _report(
            ctx,
            BackwardBeforeGradientError,
            rank,
            index,
            op,
            f"runs before the backward of stage {upstream} (chunk {chunk}, same rank), "
            "which makes its gradient",
        )


def _check_sends(ctx: Context, rank: int, made: dict[int, float]) -> None:
    """A send is posted after the computation on its rank that makes its tensor (sends of
    a tensor made on another rank are reported by the route check)."""
    keys, w = ctx.keys, ctx.wiring
    base = w.offsets[rank]
    never = len(ctx.program.ranks[rank])
    for row in w.sends[rank]:
        for g in row:
            key = w.message[g]
            if key < 0:
                continue
            position = key >> 1
            grad = key & 1
            producer = position + 1 if grad else position - 1
            pipe, stage, _ = keys.place(position)
            if not 0 <= (stage + 1 if grad else stage - 1) < keys.stages[pipe]:
                continue
            if keys.ranks_of[pipe][stage + 1 if grad else stage - 1] != rank:
                continue
            if made.get((producer << 2) | (_BACKWARD if grad else _F), never) >= g - base:
                _report_send(ctx, rank, g - base)


def _report_send(ctx: Context, rank: int, index: int) -> None:
    send = ctx.instr(rank, index)
    assert type(send) is Send  # the caller found a send here
    act = send.what is Msg.ACT
    producer = send.stage - 1 if act else send.stage + 1
    made = f"F of stage {producer}" if act else f"the backward of stage {producer}"
    text = (
        f"{ctx.describe(rank, index)} is posted before {made} mb {send.mb}, which "
        "makes the tensor it sends"
    )
    ctx.report(SendBeforeComputeError(text, ctx.span(rank, index), rank=rank, index=index))


def _check_received(ctx: Context) -> None:
    """A computation fed from another rank needs the recv of its input posted before it."""
    w = ctx.wiring
    for g in w.unreceived:
        rank, index = w.locate(g)
        op = _parts(ctx.instr(rank, index))[0]
        _report(
            ctx,
            MissingRecvError,
            rank,
            index,
            op,
            f"needs a tensor from another rank that rank {rank} never receives",
        )
    for rank, computes in enumerate(w.computes):
        late = [g for g in computes if w.deps[g] and w.deps[g][-1] > g]
        for g in late:
            index = g - w.offsets[rank]
            recv = w.deps[g][-1] - w.offsets[rank]
            op = _parts(ctx.instr(rank, index))[0]
            _report(
                ctx,
                RecvAfterUseError,
                rank,
                index,
                op,
                f"consumes {ctx.what(ctx.instr(rank, recv))}, posted only later, at @{recv}",
            )


def _report(
    ctx: Context, cls: type[DataflowError], rank: int, index: int, op: Compute, why: str
) -> None:
    text = f"{op.label()} (stage {op.stage}, mb {op.mb}) on rank {rank} @{index} {why}"
    ctx.report(cls(text, ctx.span(rank, index), rank=rank, index=index))


# ---- can a compute-only program run at all? ------------------------------------------------


class _Needs:
    """For each computation: the facts it needs and makes, and who makes each fact."""

    def __init__(self, ctx: Context) -> None:
        self.keys = ctx.keys
        self.ops: list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = []
        self.maker: dict[int, tuple[int, int]] = {}
        for rank, instrs in enumerate(ctx.program.ranks):
            row = []
            for index, instr in enumerate(instrs):
                if is_compute(instr):
                    parts = _parts(instr)
                    made = tuple(f for op in parts for f in self._makes(op) if f >= 0)
                    needs = tuple(
                        f for op in parts for f in self._needs(op) if f >= 0 and f not in made
                    )
                    row.append((index, needs, made))
                    for fact in made:
                        self.maker.setdefault(fact, (rank, index))
            self.ops.append(row)

    def _makes(self, op: Compute) -> tuple[int, ...]:
        _, _, pipe, stage, mb, _ = op
        if op.kind is Kind.F:
            return (_fact(self.keys, pipe, stage, mb, _F),)
        if op.kind is Kind.W:
            return ()
        extra = (_fact(self.keys, pipe, stage, mb, _I),) if op.kind is Kind.I else ()
        return (_fact(self.keys, pipe, stage, mb, _BACKWARD), *extra)

    def _needs(self, op: Compute) -> tuple[int, ...]:
        kind, _, pipe, stage, mb, _ = op
        keys = self.keys
        if kind is Kind.F:
            return (_fact(keys, pipe, stage - 1, mb, _F),) if stage > 0 else ()
        if kind is Kind.W:
            return (_fact(keys, pipe, stage, mb, _I),)
        last = 0 <= pipe < keys.pipes and stage == keys.stages[pipe] - 1
        down = () if last else (_fact(keys, pipe, stage + 1, mb, _BACKWARD),)
        return (_fact(keys, pipe, stage, mb, _F), *down)


def check_compute_order(ctx: Context) -> bool:
    """True when the compute order can run (program order plus data dependencies form no
    cycle); otherwise report the cycle as an UnrunnableOrderError and return False."""
    needs = _Needs(ctx)
    cursor = [0] * len(needs.ops)
    made: set[int] = set()
    waiting: dict[int, list[int]] = {}
    ready = list(range(len(needs.ops)))
    while ready:
        rank = ready.pop()
        row = needs.ops[rank]
        while cursor[rank] < len(row):
            _, wanted, makes = row[cursor[rank]]
            missing = next((f for f in wanted if f not in made and f in needs.maker), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            for fact in makes:
                made.add(fact)
                ready.extend(waiting.pop(fact, ()))
            cursor[rank] += 1
    stuck = [
        (rank, row[cursor[rank]][0])
        for rank, row in enumerate(needs.ops)
        if cursor[rank] < len(row)
    ]
    if not stuck:
        return True
    _report_cycle(ctx, needs, cursor, made, stuck)
    return False


def _report_cycle(
    ctx: Context,
    needs: _Needs,
    cursor: list[int],
    made: set[int],
    stuck: list[tuple[int, int]],
) -> None:
    graph: nx.DiGraph = nx.DiGraph()
    for rank, row in enumerate(needs.ops):
        for k in range(cursor[rank], len(row)):
            index, wanted, _ = row[k]
            if k > cursor[rank]:
                graph.add_edge((rank, index), (rank, row[k - 1][0]), why="program order")
            for fact in wanted:
                if fact not in made and fact in needs.maker:
                    graph.add_edge((rank, index), needs.maker[fact], why="needs")
    cycle = nx.find_cycle(graph, source=stuck[0])
    lines = []
    for a, b in cycle:
        why = graph.edges[a, b]["why"]
        reason = (
            f"the op before it on rank {a[0]}"
            if why == "program order"
            else "which makes the data it needs"
        )
        lines.append(f"  {ctx.describe(*a)}  waits for  {ctx.describe(*b)}  ({reason})")
    text = (
        "the compute order cannot run, under any placement of sends and receives: "
        "every op on this cycle waits for the next\n" + "\n".join(lines)
    )
    rank, index = cycle[0][0]
    noted = {rank}
    notes = []
    for _, (r, i) in cycle:
        if r not in noted:
            noted.add(r)
            notes.append(ctx.note(r, i, f"rank {r} is on the cycle here"))
    ctx.report(
        UnrunnableOrderError(
            text, ctx.span(rank, index), notes=tuple(notes), rank=rank, index=index
        )
    )
