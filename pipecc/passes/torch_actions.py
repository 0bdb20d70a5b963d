"""torch.distributed.pipelining's actions as typed values, and their link to pipecc's IR.

An `Action` is one cell of a torch schedule: a stage, an action kind and a microbatch
(`0F1`, `3SEND_B2`, `1UNSHARD`), or an `OVERLAP_F_B` container holding sub-actions in the
order written (`(0F7;7B3)OVERLAP_F_B`). `str(action)` is torch's own notation, so lists of
actions compare with what torch prints, cell for cell. SEND cells name the sending stage and
RECV cells the receiving stage, as torch does.

`compute_actions` reads a Program's compute order as actions; `build_rank` turns one rank's
actions (with or without comm cells) back into instructions, with torch's runtime semantics:
each comm cell is one op posted at its position, a compute op waits for the receives it
consumes, and the sends are waited at the end of the step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from pipecc.diagnostics import Span
from pipecc.ir.ops import (
    Compute,
    Fused,
    Instr,
    Kind,
    Msg,
    Recv,
    Send,
    Sequential,
    StageAction,
    StageOp,
    Wait,
)
from pipecc.ir.placement import Placement
from pipecc.ir.program import Program


class ActionKind(enum.Enum):
    """torch's computation types, by the names its CSV cells use."""

    F = "F"
    I = "I"  # noqa: E741
    W = "W"
    B = "B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OVERLAP_F_B = "OVERLAP_F_B"
    REDUCE_GRAD = "REDUCE_GRAD"

    __hash__ = object.__hash__

    @property
    def is_comm(self) -> bool:
        return self in _COMMS

    @property
    def is_stage_op(self) -> bool:
        """UNSHARD, RESHARD, REDUCE_GRAD: per-stage actions with no microbatch."""
        return self in _STAGE_OPS


_COMMS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_STAGE_OPS = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})
COMPUTE_KINDS = {
    Kind.F: ActionKind.F,
    Kind.I: ActionKind.I,
    Kind.W: ActionKind.W,
    Kind.B: ActionKind.B,
}
KIND_OF = {action: kind for kind, action in COMPUTE_KINDS.items()}

Key = tuple[int, ActionKind, int | None]


class Action(NamedTuple):
    """One torch action. `parts` holds an OVERLAP_F_B's sub-actions (its stage is -1, as
    torch's); `span` (where it was read, if anywhere) takes no part in `key`."""

    stage: int
    kind: ActionKind
    mb: int | None = None
    parts: tuple[Action, ...] = ()
    span: Span | None = None

    @property
    def key(self) -> Key:
        return (self.stage, self.kind, self.mb)

    def leaves(self) -> tuple[Action, ...]:
        """The sub-actions of an OVERLAP_F_B, else the action itself."""
        return self.parts if self.kind is ActionKind.OVERLAP_F_B else (self,)

    def __str__(self) -> str:
        if self.kind is ActionKind.OVERLAP_F_B:
            return "(" + ";".join(str(p) for p in self.parts) + ")OVERLAP_F_B"
        return f"{self.stage}{self.kind.value}{'' if self.mb is None else self.mb}"


def overlap(parts: Sequence[Action], span: Span | None = None) -> Action:
    """An OVERLAP_F_B container of `parts`, in the order given."""
    return Action(-1, ActionKind.OVERLAP_F_B, None, tuple(parts), span)


def of_compute(op: Compute) -> Action:
    return Action(op.stage, COMPUTE_KINDS[op.kind], op.mb, (), op.span)


def of_instr(instr: Instr) -> Action | None:
    """The action of a compute instruction; None for comm ops and waits."""
    match instr:
        case Compute():
            return of_compute(instr)
        case Fused(forward=f, backward=b):
            return overlap((of_compute(f), of_compute(b)), instr.span)
        case Sequential(parts=parts):
            return overlap(tuple(map(of_compute, parts)), instr.span)
        case StageOp(kind=kind, stage=stage):
            return Action(stage, ActionKind(kind.value), None, (), instr.span)
        case Send() | Recv() | Wait():
            return None
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def compute_actions(program: Program) -> list[list[Action]]:
    """Each rank's compute order as torch actions (comm ops, waits and StageOps left out)."""
    return [
        [a for a in map(of_instr, instrs) if a is not None and not a.kind.is_stage_op]
        for instrs in program.ranks
    ]


def stage_ranks(program: Program) -> dict[int, int]:
    """Stage → rank of a one-pipe program, as torch's stage_index_to_group_rank."""
    return {slot.stage: slot.rank for slot in program.placement.slots}


# ---- actions → instructions ------------------------------------------------------------------


class RowBuilder:
    """Turns one rank's actions into instructions (the module docstring's semantics)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def build(self, actions: Sequence[Action]) -> tuple[Instr, ...]:
        out: list[Instr] = []
        recvs: dict[tuple[Msg, int, int], int] = {}  # posted, not yet waited
        sends: list[int] = []
        for action in actions:
            if action.kind.is_comm:
                op = self.comm(action)
                if type(op) is Recv:
                    recvs[(op.what, op.stage, op.mb)] = len(out)
                else:
                    sends.append(len(out))
                out.append(op)
                continue
            if action.kind.is_stage_op:
                out.append(self.stage_op(action))
                continue
            instr = self.compute(action)
            consumed = [recvs.pop(key) for key in _inputs(action) if key in recvs]
            if consumed:
                out.append(Wait(tuple(sorted(consumed)), action.span))
            out.append(instr)
        if sends:
            out.append(Wait(tuple(sends), None))
        return tuple(out)

    def compute(self, action: Action) -> Compute | Sequential:
        """A compute action; an OVERLAP_F_B is a Sequential: its parts run in the order
        written, as torch's runtime runs them."""
        if action.kind is ActionKind.OVERLAP_F_B:
            return Sequential(tuple(self._one(p) for p in action.parts), action.span)
        return self._one(action)

    def _one(self, action: Action) -> Compute:
        holder = self.placement.holder(0, action.stage)
        mb = action.mb or 0
        return Compute(KIND_OF[action.kind], holder.chunk, 0, action.stage, mb, action.span)

    def stage_op(self, action: Action) -> StageOp:
        holder = self.placement.holder(0, action.stage)
        kind = StageAction(action.kind.value)
        return StageOp(kind, holder.chunk, 0, action.stage, action.span)

    def comm(self, action: Action) -> Send | Recv:
        """A comm cell as an op; the peer stage must exist (checked by the caller)."""
        forward = action.kind in (ActionKind.SEND_F, ActionKind.RECV_F)
        what = Msg.ACT if forward else Msg.GRAD
        mb = action.mb or 0
        if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            to = action.stage + 1 if forward else action.stage - 1
            peer = self.placement.holder(0, to).rank
            return Send(what, peer, 0, to, mb, None, action.span)
        source = action.stage - 1 if forward else action.stage + 1
        peer = self.placement.holder(0, source).rank
        return Recv(what, peer, 0, action.stage, mb, None, action.span)


def peer_stage(action: Action) -> int:
    """The stage at the other end of a comm action."""
    if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
        return action.stage + 1
    return action.stage - 1


def _inputs(action: Action) -> list[tuple[Msg, int, int]]:
    keys = []
    for part in action.leaves():
        if part.kind is ActionKind.F:
            keys.append((Msg.ACT, part.stage, part.mb or 0))
        elif part.kind in (ActionKind.B, ActionKind.I):
            keys.append((Msg.GRAD, part.stage, part.mb or 0))
    return keys
