"""Random mutations of compiled programs, for the oracle tests.

Each mutation keeps wait indices pointing at the same ops (they are renumbered when
instructions move); a wait left with nothing to wait for is dropped.
"""

from __future__ import annotations

import random
from dataclasses import replace

from pipecc.ir.ops import Compute, Fused, Instr, Msg, Recv, Send, Wait
from pipecc.ir.placement import loop_placement
from pipecc.ir.program import Program

CLASSES = (
    "swap-adjacent",
    "swap-sends",
    "drop-recv",
    "move-wait-later",
    "duplicate-compute",
    "move-comm",
    "duplicate-comm",
    "ungroup",
)

Entry = tuple[int, bool]  # (old index, is a copy)


def _rebuild(instrs: tuple[Instr, ...], order: list[Entry]) -> tuple[Instr, ...]:
    new_of = {old: new for new, (old, copy) in enumerate(order) if not copy}
    out: list[Instr] = []
    for old, _ in order:
        instr = instrs[old]
        if type(instr) is Wait:
            ops = tuple(new_of[i] for i in instr.ops if i in new_of)
            instr = Wait(ops, instr.span)
        out.append(instr)
    # drop waits left empty, renumbering once more
    keep = [i for i, instr in enumerate(out) if not (type(instr) is Wait and not instr.ops)]
    if len(keep) == len(out):
        return tuple(out)
    return _rebuild(tuple(out), [(i, False) for i in keep])


def _indices(instrs: tuple[Instr, ...], kinds: tuple[type, ...]) -> list[int]:
    return [i for i, x in enumerate(instrs) if type(x) in kinds]


def _swap_adjacent(instrs: tuple[Instr, ...], order: list[Entry], rng: random.Random) -> bool:
    if len(instrs) < 2:
        return False
    i = rng.randrange(len(instrs) - 1)
    order[i], order[i + 1] = order[i + 1], order[i]
    return True


def _swap_sends(instrs: tuple[Instr, ...], order: list[Entry], rng: random.Random) -> bool:
    sends = _indices(instrs, (Send,))
    if len(sends) < 2:
        return False
    a, b = rng.sample(sends, 2)
    order[a], order[b] = order[b], order[a]
    return True


def _drop_recv(instrs: tuple[Instr, ...], order: list[Entry], rng: random.Random) -> bool:
    recvs = _indices(instrs, (Recv,))
    if recvs:
        order.pop(rng.choice(recvs))
    return bool(recvs)


def _move_wait_later(instrs: tuple[Instr, ...], order: list[Entry], rng: random.Random) -> bool:
    waits = _indices(instrs, (Wait,))
    if waits:
        i = rng.choice(waits)
        order.insert(rng.randrange(i, len(instrs)), order.pop(i))
    return bool(waits)


def _move_comm(instrs: tuple[Instr, ...], order: list[Entry], rng: random.Random) -> bool:
    comms = _indices(instrs, (Send, Recv))
    if comms:
        entry = order.pop(rng.choice(comms))
        order.insert(rng.randrange(len(order) + 1), entry)
    return bool(comms)


def _duplicate_compute(instrs: tuple[Instr, ...], order: list[Entry], rng: random.Random) -> bool:
    computes = _indices(instrs, (Compute, Fused))
    if computes:
        i = rng.choice(computes)
        order.insert(rng.randrange(i + 1, len(instrs) + 1), (i, True))
    return bool(computes)


def _duplicate_comm(instrs: tuple[Instr, ...], order: list[Entry], rng: random.Random) -> bool:
    """Post a send or recv a second time, somewhere after the first (unwaited)."""
    comms = _indices(instrs, (Send, Recv))
    if comms:
        i = rng.choice(comms)
        order.insert(rng.randrange(i + 1, len(instrs) + 1), (i, True))
    return bool(comms)


_EDITS = {
    "swap-adjacent": _swap_adjacent,
    "swap-sends": _swap_sends,
    "drop-recv": _drop_recv,
    "move-wait-later": _move_wait_later,
    "move-comm": _move_comm,
    "duplicate-compute": _duplicate_compute,
    "duplicate-comm": _duplicate_comm,
}


def _mutate_rank(
    instrs: tuple[Instr, ...], cls: str, rng: random.Random
) -> tuple[Instr, ...] | None:
    if cls == "ungroup":
        return ungroup(instrs)
    order: list[Entry] = [(i, False) for i in range(len(instrs))]
    if not _EDITS[cls](instrs, order, rng):
        return None
    return _rebuild(instrs, order)


def mutate(program: Program, cls: str, rng: random.Random) -> Program | None:
    """One random mutation of class `cls` on one random rank, or None if it does not apply."""
    rank = rng.randrange(program.num_ranks)
    mutated = _mutate_rank(program.ranks[rank], cls, rng)
    if mutated is None or mutated == program.ranks[rank]:
        return None
    ranks = list(program.ranks)
    ranks[rank] = mutated
    return replace(program, ranks=tuple(ranks))


def ungroup(instrs: tuple[Instr, ...]) -> tuple[Instr, ...]:
    """Every send and recv posted alone (no groups)."""
    return tuple(
        x._replace(group=None) if type(x) in (Send, Recv) else x  # type: ignore[union-attr]
        for x in instrs
    )


def ungrouped(program: Program) -> Program:
    return replace(program, ranks=tuple(ungroup(instrs) for instrs in program.ranks))


def random_comm_program(rng: random.Random) -> Program:
    """A random program of sends, recvs, groups and waits among 2-4 ranks (no computes):
    each rank posts its ops toward each peer in a random interleaving, groups random runs of
    consecutive ops, and waits on random subsets of what is outstanding."""
    num_ranks = rng.randint(2, 4)
    ops: list[list[Instr]] = [[] for _ in range(num_ranks)]
    for k in range(rng.randint(1, 8)):
        src, dst = rng.sample(range(num_ranks), 2)
        ops[src].append(Send(Msg.ACT, dst, 0, 1, k))
        ops[dst].append(Recv(Msg.ACT, src, 0, 1, k))
    ranks = []
    for mine in ops:
        rng.shuffle(mine)
        ranks.append(_with_waits(mine, rng))
    return Program(
        "random", "", num_ranks, 8, (), "random", loop_placement(num_ranks, 1), tuple(ranks)
    )


def _with_waits(posts: list[Instr], rng: random.Random) -> tuple[Instr, ...]:
    out: list[Instr] = []
    open_ops: list[int] = []
    group = 0
    for op in posts:
        if out and type(out[-1]) in (Send, Recv) and rng.random() < 0.4:
            grouped = out[-1].group  # type: ignore[union-attr]
            if grouped is None:
                grouped = group
                group += 1
                out[-1] = out[-1]._replace(group=grouped)  # type: ignore[union-attr]
            op = op._replace(group=grouped)  # type: ignore[union-attr]
        open_ops.append(len(out))
        out.append(op)
        if rng.random() < 0.4:
            chosen = sorted(rng.sample(open_ops, rng.randint(1, len(open_ops))))
            open_ops = [i for i in open_ops if i not in chosen]
            out.append(Wait(tuple(chosen)))
    if open_ops:
        out.append(Wait(tuple(open_ops)))
    return tuple(out)
