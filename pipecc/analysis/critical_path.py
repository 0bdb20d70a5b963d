"""Why does an instruction start when it does? The critical path back to time 0.

`critical_path(run, rank, index)` walks the causes the replay engine recorded: each
instruction starts when the previous one on its rank ends, or when the receive it needs
completes; a receive completes when its transfer ends, and a transfer starts when both sides
are ready (posted, and under nccl at the head of their streams). Each link of the chain says
which of these it was, with its time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from pipecc.ir.ops import Instr, Recv, Send, StageOp, Wait, is_compute
from pipecc.ir.printer import describe
from pipecc.semantics import CauseKind, Replay


@dataclass(frozen=True, slots=True)
class Link:
    """One step of a critical path: at `time`, on `rank`, instruction `index` — `reason`."""

    rank: int
    index: int
    time: float
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "index": self.index, "time": self.time, "reason": self.reason}


class Moment(enum.Enum):
    """The moment of an instruction that a link of the path explains."""

    START = "start"  # a compute op, post or wait begins
    DONE = "done"  # a send or receive completes
    READY = "ready"  # a send or receive can transfer (posted; under nccl, at its streams' head)


class Node(NamedTuple):
    """A moment of instruction `at` on `rank`, still to be explained."""

    moment: Moment
    rank: int
    at: int


def critical_path(run: Replay, rank: int, index: int) -> list[Link]:
    """The chain of program-order and message edges that sets the start of `index` on
    `rank`, from that instruction back to time 0 (`run` is a timed replay)."""
    ranks = run.program.ranks
    links: list[Link] = []
    node: Node | None = Node(Moment.START, rank, index)
    while node is not None:
        moment, r, i = node
        if moment is Moment.START:
            node = _explain_start(run, ranks[r], r, i, links)
        elif moment is Moment.DONE:
            node = _explain_done(run, ranks, r, i, links)
        else:
            node = _explain_ready(run, ranks, r, i, links)
    return links


def _explain_start(
    run: Replay, instrs: tuple[Instr, ...], r: int, i: int, links: list[Link]
) -> Node | None:
    at = run.start_time(r, i) or 0.0
    cause = run.cause(r, i)
    here = describe(instrs[i])
    if cause.kind is CauseKind.START:
        links.append(Link(r, i, at, f"{here}: the first instruction of rank {r}"))
        return None
    if cause.kind is CauseKind.PROGRAM and _is_post(instrs[i]) and _is_post(instrs[i - 1]):
        return Node(Moment.START, r, i - 1)  # a run of posts at one moment: one link is enough
    if cause.kind is CauseKind.PROGRAM:
        prev = instrs[i - 1]
        verb = (
            "ends"
            if _is_compute(prev) or type(prev) is StageOp
            else ("is released" if type(prev) is Wait else "is posted")
        )
        links.append(
            Link(
                r,
                i,
                at,
                f"{here}: starts when the previous instruction "
                f"[{i - 1}] {describe(prev)} {verb} at {at:g}"
                f"{_inputs_slack(run, instrs, r, i, at)}",
            )
        )
        return Node(Moment.START, r, i - 1)
    op = instrs[cause.index]
    what = "waits for" if cause.kind is CauseKind.WAIT else "needs the data of"
    links.append(
        Link(r, i, at, f"{here}: {what} [{cause.index}] {describe(op)}, which completes at {at:g}")
    )
    return Node(Moment.DONE, r, cause.index)


def _explain_done(
    run: Replay, ranks: tuple[tuple[Instr, ...], ...], r: int, i: int, links: list[Link]
) -> Node | None:
    done = run.done_time(r, i) or 0.0
    cause = run.completion_cause(r, i)
    op = ranks[r][i]
    if cause.kind is CauseKind.TRANSFER:
        pr, pi = cause.rank, cause.index
        partner = ranks[pr][pi]
        ready = run.ready_time(pr, pi) or 0.0
        flight = done - ready
        side = "sent" if type(partner) is Send else "received"
        links.append(
            Link(
                pr,
                pi,
                ready,
                f"the transfer starts when rank {pr}'s "
                f"[{pi}] {describe(partner)} is ready at {ready:g} "
                f"({side} there); in flight {flight:g}, done at "
                f"{done:g}",
            )
        )
        return Node(Moment.READY, pr, pi)
    if cause.kind is CauseKind.POST:
        if type(op) is Recv or type(op) is Send:
            posted = run.post_time(r, i) or 0.0
            links.append(
                Link(
                    r,
                    i,
                    done,
                    f"{describe(op)} completes at {done:g}: posted at "
                    f"{posted:g}, its transfer was bound by its own post",
                )
            )
        return Node(Moment.START, r, i)
    return Node(Moment.READY, r, i)


def _explain_ready(
    run: Replay, ranks: tuple[tuple[Instr, ...], ...], r: int, i: int, links: list[Link]
) -> Node | None:
    cause = run.ready_cause(r, i)
    ready = run.ready_time(r, i) or 0.0
    if cause.kind is CauseKind.STREAM:
        ahead = ranks[cause.rank][cause.index]
        links.append(
            Link(
                r,
                i,
                ready,
                f"[{i}] {describe(ranks[r][i])} waits on its nccl stream "
                f"behind [{cause.index}] {describe(ahead)}, which "
                f"completes at {ready:g}",
            )
        )
        return Node(Moment.DONE, cause.rank, cause.index)
    return Node(Moment.START, r, i)


def _inputs_slack(run: Replay, instrs: tuple[Instr, ...], r: int, i: int, at: float) -> str:
    """For a compute op held by its own rank: when its received inputs had arrived."""
    if not _is_compute(instrs[i]):
        return ""
    base = run.wiring.offsets[r]
    notes = []
    for g in run.wiring.deps[base + i]:
        done = run.done[g]
        if done is not None:
            notes.append(
                f"[{g - base}] {describe(instrs[g - base])} had completed at "
                f"{done:g}, {at - done:g} earlier"
            )
    return f" (its input: {'; '.join(notes)})" if notes else ""


def _is_post(instr: Instr) -> bool:
    return type(instr) is Send or type(instr) is Recv


def _is_compute(instr: Instr) -> bool:
    return is_compute(instr)
