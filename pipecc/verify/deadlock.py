"""Deadlock under each comm model, with the cycle as the witness (DESIGN §5).

One replay per model decides it (pipecc.semantics: straight-line programs with FIFO
matching have one outcome). When a replay gets stuck, its blocked state is a graph in which
every stuck instruction or incomplete op points at what it waits for; networkx finds the
cycle, and the report lists it hop by hop, then each rank's last completed instructions.

Several models often get stuck the same way (a pair that sends before it receives hangs
under nccl, nccl-single and rendezvous alike): one witness is reported per distinct cycle,
naming every model it occurs under. Two witnesses are the same cycle when they are of one
kind (deadlock or needs-buffering, cycle or chain), pass through the same set of (rank,
instruction) pairs, and leave every rank stuck at the same instruction.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, cast

import networkx as nx

from pipecc.diagnostics import DeadlockError, NeedsBufferingError, Note, Violation
from pipecc.ir.ops import Collective, Recv, Send
from pipecc.semantics import Block, CommModel, Replay, Stuck, replay
from pipecc.verify.context import Context

Node = tuple[int, int]
GRID_OPS = 4  # completed instructions shown per rank
GRID_RANKS = 8


class Status(enum.Enum):
    """The verdict under one comm model."""

    PASSES = "passes"
    DEADLOCK = "deadlock"
    NEEDS_BUFFERING = "needs buffering"
    ORPHANED = "ops without a partner never complete"


@dataclass(frozen=True, slots=True)
class Verdict:
    model: CommModel
    status: Status


class _Witness(NamedTuple):
    """What one model's failure is reported as: a deadlock or a needs-buffering violation,
    shown by the blocked state of the replay under `model` (for a program that passes eager
    only because its sends are buffered, the rendezvous replay's)."""

    kind: Status
    model: CommModel


# the weakest model first: a cycle that several models share is explained by the rules of
# the weakest of them (it needs no more than those)
_WEAKEST_FIRST = (CommModel.EAGER, CommModel.RENDEZVOUS, CommModel.NCCL, CommModel.NCCL_SINGLE)


class _Replays:
    """Each model replayed at most once, with its witness (a cycle, or a chain that ends
    at an op nothing matches) when it gets stuck."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.done: dict[CommModel, Replay] = {}
        self.witnesses: dict[CommModel, tuple[list[Node], bool]] = {}

    def __call__(self, model: CommModel) -> Replay:
        if model not in self.done:
            self.done[model] = replay(self.ctx.program, model=model, wiring=self.ctx.wiring)
        return self.done[model]

    def witness(self, model: CommModel) -> tuple[list[Node], bool]:
        if model not in self.witnesses:
            run = self(model)
            self.witnesses[model] = _witness(run, {(s.rank, s.index): s for s in run.stuck})
        return self.witnesses[model]

    def cycle(self, model: CommModel) -> bool:
        """Stuck on a cycle (not only on ops that nothing matches)."""
        return not self(model).finished and self.witness(model)[1]

    def same_cycle(self, witness: _Witness) -> tuple[object, ...]:
        """The key of a distinct cycle (module docstring): its kind, whether it closes, the
        (rank, instruction) pairs on it, and where each rank is stuck."""
        run = self(witness.model)
        path, closed = self.witness(witness.model)
        stuck_at = tuple(run.blocked_at(r) for r in range(run.program.num_ranks))
        return (witness.kind, closed, frozenset(path), stuck_at)


def check_deadlock(ctx: Context, models: tuple[CommModel, ...]) -> tuple[Verdict, ...]:
    """Replay under each model; report one deadlock (or needs-buffering) witness per
    distinct cycle, naming the models it occurs under."""
    runs = _Replays(ctx)
    verdicts = []
    cycles: dict[tuple[object, ...], list[_Witness]] = {}
    for model in models:
        status, witness = _judge(model, runs)
        verdicts.append(Verdict(model, status))
        if witness is not None:
            same = cycles.setdefault(runs.same_cycle(witness), [])
            if witness not in same:
                same.append(witness)
    for same in cycles.values():
        ctx.report(_violation(ctx, same, runs))
    return tuple(verdicts)


def _judge(model: CommModel, runs: _Replays) -> tuple[Status, _Witness | None]:
    """The verdict under `model`, and the witness to report for it.

    A program that completes under eager passes there, but passing under eager is not safe
    when rendezvous hangs on a cycle: that is a needs-buffering violation (its witness is
    the rendezvous cycle), and the models that hang on it say "needs buffering". A hang
    whose root is an op nothing matches is a deadlock when a rank waits on it, and otherwise
    left to the orphan check (the ranks end, the op never completes).
    """
    run = runs(model)
    eager, rendezvous = CommModel.EAGER, CommModel.RENDEZVOUS
    if run.finished:
        if model is eager and runs.cycle(rendezvous):
            return Status.PASSES, _Witness(Status.NEEDS_BUFFERING, rendezvous)
        return Status.PASSES, None
    if not runs.witness(model)[1]:
        blocked = any(run.blocked_at(r) is not None for r in range(run.program.num_ranks))
        if not blocked:
            return Status.ORPHANED, None
        return Status.DEADLOCK, _Witness(Status.DEADLOCK, model)
    if runs(eager).finished and runs.cycle(rendezvous):
        # it runs only if sends never wait for receives
        return Status.NEEDS_BUFFERING, _Witness(Status.NEEDS_BUFFERING, model)
    return Status.DEADLOCK, _Witness(Status.DEADLOCK, model)


def _violation(ctx: Context, same: list[_Witness], runs: _Replays) -> Violation:
    """One witness for the models in `same`, explained by the weakest model's replay."""
    model = min((w.model for w in same), key=_WEAKEST_FIRST.index)
    kind = same[0].kind
    run = runs(model)
    edges = {(s.rank, s.index): s for s in run.stuck}
    path, closed = runs.witness(model)
    ranks = []
    for rank, _ in path:
        if rank not in ranks:
            ranks.append(rank)
    name = ", ".join(w.model.value for w in same)
    if closed:
        who = " → ".join(str(r) for r in [*ranks, ranks[0]])
        head = (
            f"deadlock under {name}: rank {ranks[0]} waits for itself"
            if len(ranks) == 1
            else f"deadlock under {name}: ranks {who} wait for each other in a cycle"
        )
    else:
        last = path[-1]
        head = (
            f"deadlock under {name}: rank {path[0][0]} waits forever for "
            f"{ctx.describe(*last)}, which nothing matches"
        )
    if kind is Status.NEEDS_BUFFERING:
        head = (
            "needs buffering: the program completes only when sends are buffered "
            f"(eager); it hangs for large messages or across nodes. {head}"
        )
    shape = (
        "cycle (each line waits for the next, the last for the first):"
        if closed
        else "chain (each line waits for the next):"
    )
    lines = [head, _stuck_line(ctx, run, ranks), f"  {shape}"]
    lines += [_hop(ctx, run, edges[node]) for node in path]
    lines += _extra(run, runs)
    lines += _grid(ctx, run, ranks)
    first = path[0]
    notes: list[Note] = []
    seen = {first[0]}
    for rank, index in path[1:]:
        if rank not in seen and run.blocked_at(rank) == index:
            seen.add(rank)
            notes.append(ctx.note(rank, index, f"rank {rank} is stuck here"))
    cls = NeedsBufferingError if kind is Status.NEEDS_BUFFERING else DeadlockError
    return cls(
        "\n".join(lines), ctx.span(*first), notes=tuple(notes), rank=first[0], index=first[1]
    )


def _stuck_line(ctx: Context, run: Replay, ranks: list[int]) -> str:
    parts = []
    for rank in ranks:
        at = run.blocked_at(rank)
        parts.append(
            f"rank {rank} at @{at} {ctx.what(ctx.instr(rank, at))}"
            if at is not None
            else f"rank {rank} ran to its end with ops incomplete"
        )
    return "  stuck: " + "; ".join(parts)


def _witness(run: Replay, edges: dict[Node, Stuck]) -> tuple[list[Node], bool]:
    """A cycle of the blocked state (closed=True), else the chain from the first stuck
    rank to an op that nothing matches. Both start at a rank's stuck instruction."""
    graph: nx.DiGraph = nx.DiGraph()
    for node, stuck in edges.items():
        graph.add_node(node)
        if stuck.on is not None:
            graph.add_edge(node, stuck.on)
    starts = [(r, i) for r in range(run.program.num_ranks) if (i := run.blocked_at(r)) is not None]
    for start in starts or list(edges):
        try:
            cycle = [a for a, _ in nx.find_cycle(graph, source=start)]
        except nx.NetworkXNoCycle:
            continue
        entry = next((k for k, n in enumerate(cycle) if edges[n].why is Block.WAITS_FOR), 0)
        return cycle[entry:] + cycle[:entry], True
    node = (starts or list(edges))[0]
    path = [node]
    while (on := edges[node].on) is not None and on not in path:
        node = on
        path.append(node)
    return path, False


def _hop(ctx: Context, run: Replay, stuck: Stuck) -> str:
    rank, index, why, on = stuck
    instr = ctx.instr(rank, index)
    where = ctx.line(rank, index)
    src = f"  [{where}]" if where else ""
    where_text = f"rank {rank} @{index}"
    return f"    {where_text:<13} {ctx.what(instr):<44} {_reason(ctx, run, stuck)}{src}"


def _reason(ctx: Context, run: Replay, stuck: Stuck) -> str:
    rank, index, why, on = stuck
    match why:
        case Block.WAITS_FOR:
            assert on is not None
            return f"waits for @{on[1]}"
        case Block.NOT_POSTED:
            assert on is not None
            return f"not posted: rank {rank} is stuck at @{on[1]}, before it"
        case Block.NO_PARTNER:
            instr = cast("Send | Recv | Collective", ctx.instr(rank, index))
            if isinstance(instr, Collective):
                return "no collective of every other member matches it: it never completes"
            other = "receive" if type(instr) is Send else "send"
            return f"no {other} on rank {instr.peer} matches it: it never completes"
        case Block.MEMBERS:
            assert on is not None
            return (
                f"completes with rank {on[0]} @{on[1]}, which has not reached it "
                f"({_collective_rule(run.model)})"
            )
        case Block.PARTNER:
            assert on is not None
            return f"completes with its partner, rank {on[0]} @{on[1]} ({_rule(run.model)})"
        case Block.STREAM:
            assert on is not None
            return f"queued behind @{on[1]}, not complete ({_stream_rule(ctx, run.model, stuck)})"
        case _:
            raise AssertionError(why)


def _rule(model: CommModel) -> str:
    return {
        CommModel.EAGER: "eager: a receive completes once its send is posted",
        CommModel.RENDEZVOUS: "rendezvous: a send and its receive complete together, once "
        "both are posted",
        CommModel.NCCL: "nccl: a pair transfers once both ops are posted and at the head of "
        "their streams",
        CommModel.NCCL_SINGLE: "nccl-single: a pair transfers once both ops are posted and "
        "at the head of their streams",
    }[model]


def _collective_rule(model: CommModel) -> str:
    if model.has_streams:
        return (
            f"{model.value}: a collective completes once every member's is posted and at "
            "the head of its streams"
        )
    return f"{model.value}: a collective completes once every member has reached it"


def _stream_rule(ctx: Context, model: CommModel, stuck: Stuck) -> str:
    if model is CommModel.NCCL_SINGLE:
        return f"nccl-single: rank {stuck.rank}'s ops run in posting order on one stream"
    instr = ctx.instr(stuck.rank, stuck.index)
    if type(instr) is Collective:
        return (
            f"nccl: a collective of rank {stuck.rank} sits at the head of every stream "
            "toward its members"
        )
    peer = instr.peer if type(instr) is Send or type(instr) is Recv else "?"
    return f"nccl: rank {stuck.rank}'s ops toward rank {peer} run in posting order"


def _extra(run: Replay, runs: _Replays) -> list[str]:
    """Which weaker models the program passes, to say what the cycle depends on."""
    if not run.model.has_streams or not runs(CommModel.RENDEZVOUS).finished:
        return []
    return [
        "  it runs under rendezvous: this cycle closes only through NCCL's stream order "
        "(an op waits behind an earlier op on its stream, pytorch/pytorch#165664); post "
        "the ops of every rank pair in one global order, or group the pair"
    ]


def _grid(ctx: Context, run: Replay, ranks: list[int]) -> list[str]:
    """Each rank's last completed instructions, and ▶ the one it is stuck at."""
    others = [
        r for r in range(run.program.num_ranks) if r not in ranks and run.blocked_at(r) is not None
    ]
    shown = (ranks + others)[:GRID_RANKS]
    lines = ["  last completed instructions (▶ where the rank is stuck):"]
    for rank in shown:
        stop = run.blocked_at(rank)
        instrs = ctx.program.ranks[rank]
        end = len(instrs) if stop is None else stop
        cells = [f"@{i} {instrs[i].label()}" for i in range(max(0, end - GRID_OPS), end)]
        if end > GRID_OPS:
            cells.insert(0, "…")
        tail = f"▶ @{stop} {instrs[stop].label()}" if stop is not None else "(ran to the end)"
        lines.append(f"    rank {rank} | {'  '.join([*cells, tail])}")
    hidden = len(ranks) + len(others) - len(shown)
    if hidden > 0:
        lines.append(f"    … and {hidden} more stuck rank(s)")
    return lines
