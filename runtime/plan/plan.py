"""What the interpreter walks: a rank's instructions with their indices and group ends.

A plan pairs each instruction with its index in the rank's list (errors and waits name
instructions by it) and, for a send or receive, whether its group of posts ends after it
(the point at which the group is posted together). The forward-only plan is the program's
forward part, for evaluation. `mailbox` numbers every message the rank's instructions hand
on or take, once for the program: the engine's mailbox is a list indexed by these slots
(runtime/engine/bound.py binds each instruction to its slots).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipecc.ir.keys import Message, carried, consumed, produced
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Instr,
    Kind,
    Msg,
    Phase,
    Recv,
    Send,
    Sequential,
    Wait,
)

Plan = tuple[tuple[int, Instr, bool], ...]  # (index in the rank's list, instruction, commit)


def build_plan(indexed: Sequence[tuple[int, Instr]]) -> Plan:
    """Pair each (index, instruction) with whether its group of posts ends after it."""
    plan = []
    for position, (index, instr) in enumerate(indexed):
        commit = False
        if type(instr) is Send or type(instr) is Recv:
            after = indexed[position + 1][1] if position + 1 < len(indexed) else None
            same_group = (type(after) is Send or type(after) is Recv) and after.group == instr.group
            commit = instr.group is None or not same_group
        plan.append((index, instr, commit))
    return tuple(plan)


def forward_only(instrs: Sequence[Instr]) -> list[tuple[int, Instr]]:
    """The forward part of a program: F (the forward half of a fused op; a MoE stage's
    forward phases and their dispatch and combine), activation messages, and waits on what
    remains."""
    kept: list[tuple[int, Instr]] = []
    posted: set[int] = set()
    for index, instr in enumerate(instrs):
        match instr:
            case Compute(kind=Kind.F):
                kept.append((index, instr))
            case Fused():
                kept.append((index, instr.forward))
            case Sequential():
                kept.extend((index, op) for op in instr.parts if op.kind is Kind.F)
            case Send() | Recv() if instr.what is Msg.ACT:
                kept.append((index, instr))
                posted.add(index)
            case Phase() if instr.op.kind is Kind.F:  # a MoE stage's forward phases
                kept.append((index, instr))
            case Collective(kind=CollectiveKind.ALL_TO_ALL) if _forward_a2a(instr):
                kept.append((index, instr))
                posted.add(index)
            case Wait():
                ops = tuple(i for i in instr.ops if i in posted)
                if ops:
                    kept.append((index, Wait(ops, instr.span)))
    return kept


def mailbox(instrs: Sequence[Instr]) -> dict[Message, int]:
    """A slot for every message `instrs` may put in or take from the mailbox: what each
    computation (not a W) consumes and produces, what each send or receive carries."""
    slots: dict[Message, int] = {}
    for instr in instrs:
        if type(instr) is Send or type(instr) is Recv:
            slots.setdefault(carried(instr), len(slots))
        for op in _computes(instr):
            if op.kind is not Kind.W:
                slots.setdefault(consumed(op.kind, op.pipe, op.stage, op.mb), len(slots))
                slots.setdefault(produced(op.kind, op.pipe, op.stage, op.mb), len(slots))
    return slots


def _forward_a2a(instr: Collective) -> bool:
    """A MoE forward's dispatch or combine (not a backward's `-grad` one)."""
    return not instr.what.split(" ", 1)[0].endswith("-grad")


def _computes(instr: Instr) -> tuple[Compute, ...]:
    if isinstance(instr, Phase):  # a MoE stage's phase: its op's messages
        return (instr.op,)
    if isinstance(instr, Compute):
        return (instr,)
    if isinstance(instr, Fused):
        return (instr.forward, instr.backward)
    if isinstance(instr, Sequential):
        return instr.parts
    return ()
