"""The one message key, and what each computation consumes and produces (DESIGN §2, §5).

A forward of stage s consumes the activation of stage s-1 and produces the input of stage
s+1; a backward (B or I) of stage s consumes the gradient from stage s+1 and produces the
gradient for stage s-1; a W consumes what its I left behind. A message is named by the
stage that receives it: (what, pipe, stage, mb), a `Message`; `consumed`, `produced` and
`carried` name the message of a computation or a comm op (the runtime's mailbox is keyed by
them), and `MessageKeys` builds its tables from the same two rules.

`MessageKeys` answers these questions for one placement, and gives each message its dense
integer key, the one encoding every layer uses (the wiring of the replay, the verifier, the
passes): the slot `(mb · pipes + pipe) · stride + stage` of a (pipe, stage, mb), times two,
plus one for a gradient. It precomputes per (kind, pipe, stage) a `FlowTemplate` so that the
hot loops do one table look-up per op. `StageMajorKeys` numbers the same messages stage by
stage for the comm passes, whose tables are walked one stage's microbatches at a time.
"""

from __future__ import annotations

from typing import NamedTuple

from pipecc.ir.ops import Compute, Kind, Msg, Recv, Send
from pipecc.ir.placement import Placement


class Message(NamedTuple):
    """The name of a tensor that crosses a stage boundary: (what, pipe, receiving stage, mb)."""

    what: Msg
    pipe: int
    stage: int
    mb: int


class Flow(NamedTuple):
    """A message in integer form: its key, the sending rank, the receiving rank."""

    key: int
    src: int
    dst: int


class FlowTemplate(NamedTuple):
    """The message a (kind, pipe, stage) consumes or produces, for any microbatch:
    its key is `mb * MessageKeys.mb_stride + base`."""

    base: int
    src: int
    dst: int
    what: Msg
    pipe: int
    stage: int  # the receiving stage


def consumed(kind: Kind, pipe: int, stage: int, mb: int) -> Message:
    """The message a computation (not a W) receives, when its stage has the neighbour it
    comes from: a forward's activation, a backward's (B or I) output gradient."""
    return Message(Msg.ACT if kind is Kind.F else Msg.GRAD, pipe, stage, mb)


def produced(kind: Kind, pipe: int, stage: int, mb: int) -> Message:
    """The message a computation (not a W) hands on, when its stage has the neighbour it goes
    to: a forward's output for stage + 1, a backward's input gradient for stage - 1."""
    if kind is Kind.F:
        return Message(Msg.ACT, pipe, stage + 1, mb)
    return Message(Msg.GRAD, pipe, stage - 1, mb)


def carried(op: Send | Recv) -> Message:
    """The message a send or a receive carries."""
    return Message(op.what, op.pipe, op.stage, op.mb)


_WHAT = (Msg.ACT, Msg.GRAD)
_GRAD = Msg.GRAD
Table = dict[Kind, list[list[FlowTemplate | None]]]


class MessageKeys:
    """The message keys and the dependencies of computations under one placement.

    A name outside the placement (a bad pipe or stage, a negative microbatch: a malformed
    program) gets a negative key of its own from `name_key`, so such a program still replays.
    """

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.pipes = self._pipes = placement.num_pipes
        self.stages = tuple(placement.num_stages(p) for p in range(self._pipes))
        self.stride = self._stride = max(self.stages)
        self.mb_stride = self._pipes * self._stride * 2
        self.ranks_of = tuple(
            tuple(placement.holder(pipe, stage).rank for stage in range(self.stages[pipe]))
            for pipe in range(self._pipes)
        )
        self._odd: dict[tuple[Msg, int, int, int], int] = {}
        self.inputs: Table = {kind: [] for kind in Kind}
        self.outputs: Table = {kind: [] for kind in Kind}
        for pipe, ranks in enumerate(self.ranks_of):
            for kind in Kind:
                self.inputs[kind].append(
                    [self._input(kind, pipe, s, ranks) for s in range(len(ranks))]
                )
                self.outputs[kind].append(
                    [self._output(kind, pipe, s, ranks) for s in range(len(ranks))]
                )

    def _template(self, what: Msg, pipe: int, stage: int, src: int, dst: int) -> FlowTemplate:
        base = self.key(what, pipe, stage, 0)
        return FlowTemplate(base, src, dst, what, pipe, stage)

    def _input(
        self, kind: Kind, pipe: int, stage: int, ranks: tuple[int, ...]
    ) -> FlowTemplate | None:
        if kind is Kind.W or stage == (0 if kind is Kind.F else len(ranks) - 1):
            return None
        what, _, to, _ = consumed(kind, pipe, stage, 0)
        src = ranks[stage - 1] if kind is Kind.F else ranks[stage + 1]
        return self._template(what, pipe, to, src, ranks[stage])

    def _output(
        self, kind: Kind, pipe: int, stage: int, ranks: tuple[int, ...]
    ) -> FlowTemplate | None:
        if kind is Kind.W or stage == (len(ranks) - 1 if kind is Kind.F else 0):
            return None
        what, _, to, _ = produced(kind, pipe, stage, 0)
        return self._template(what, pipe, to, ranks[stage], ranks[to])

    def slot(self, pipe: int, stage: int, mb: int) -> int:
        """The dense index of (pipe, stage, mb): a message's key without its kind bit."""
        return (mb * self._pipes + pipe) * self._stride + stage

    def place(self, slot: int) -> tuple[int, int, int]:
        """(pipe, stage, mb) of a slot (inverse of `slot`)."""
        rest, stage = divmod(slot, self._stride)
        mb, pipe = divmod(rest, self._pipes)
        return pipe, stage, mb

    def key(self, what: Msg, pipe: int, stage: int, mb: int) -> int:
        """The dense integer key of message (what, pipe, stage, mb), inside the placement."""
        return (((mb * self._pipes + pipe) * self._stride + stage) << 1) | (what is _GRAD)

    def inside(self, pipe: int, stage: int, mb: int) -> bool:
        """The name is one of the placement's (a malformed program may name others)."""
        return 0 <= pipe < self._pipes and 0 <= stage < self.stages[pipe] and mb >= 0

    def name_key(self, what: Msg, pipe: int, stage: int, mb: int) -> int:
        """`key`, or for a name outside the placement a negative key of its own."""
        if 0 <= pipe < self._pipes and 0 <= stage < self.stages[pipe] and mb >= 0:
            # `key`, inlined: the replay's wiring asks once per comm op of 10⁶
            return (((mb * self._pipes + pipe) * self._stride + stage) << 1) | (what is _GRAD)
        return self._odd.setdefault((what, pipe, stage, mb), -2 - len(self._odd))

    def input_key(self, op: Compute, rank: int) -> int:
        """The key of the message `op` receives from another rank, or -1 (none, or local)."""
        if not self.inside(op.pipe, op.stage, op.mb):
            return -1
        template = self.inputs[op.kind][op.pipe][op.stage]
        if template is None or template.src == rank:
            return -1
        return op.mb * self.mb_stride + template.base

    def input_table(self) -> list[list[list[tuple[int, int]]]]:
        """table[kind][pipe][stage] = (key - mb·mb_stride, sending rank) of the message a
        Compute of that kind (F, B, I, W in that order) receives, or (-1, -1) for none;
        the op receives it from another rank when the sending rank is not its own."""
        return [
            [
                [(-1, -1) if t is None else (t.base, t.src) for t in self.inputs[kind][pipe]]
                for pipe in range(self._pipes)
            ]
            for kind in (Kind.F, Kind.B, Kind.I, Kind.W)
        ]

    def by_stage(self, microbatches: int) -> StageMajorKeys:
        """The same messages numbered stage by stage, for `microbatches` microbatches."""
        return StageMajorKeys(self, microbatches)

    def message(self, key: int) -> Message:
        """The message with integer key `key` (inverse of `key`)."""
        pipe, stage, mb = self.place(key >> 1)
        return Message(_WHAT[key & 1], pipe, stage, mb)

    def input_flow(self, kind: Kind, pipe: int, stage: int, mb: int) -> Flow | None:
        """The boundary tensor a computation needs from a neighbouring stage, or None
        (the first stage's forward, the last stage's backward, every W)."""
        template = self.inputs[kind][pipe][stage]
        if template is None:
            return None
        return Flow(mb * self.mb_stride + template.base, template.src, template.dst)

    def output_flow(self, kind: Kind, pipe: int, stage: int, mb: int) -> Flow | None:
        """The boundary tensor a computation hands to a neighbouring stage, or None."""
        template = self.outputs[kind][pipe][stage]
        if template is None:
            return None
        return Flow(mb * self.mb_stride + template.base, template.src, template.dst)


class StageMajorKeys:
    """The message keys of the comm passes: `MessageKeys`' (what, pipe, stage) base times M,
    plus the microbatch. A rank's ops go through the microbatches of a few stages in order, so
    their look-ups in the tables indexed by key walk memory in order: with the microbatch-major
    keys every look-up of a large program was a cache miss."""

    def __init__(self, keys: MessageKeys, microbatches: int) -> None:
        self.flow, self.count = keys, microbatches
        self.size = microbatches * keys.mb_stride  # every key is below this

    def key(self, what: Msg, pipe: int, stage: int, mb: int) -> int:
        return self.flow.key(what, pipe, stage, 0) * self.count + mb

    def message(self, key: int) -> Message:
        base, mb = divmod(key, self.count)
        return self.flow.message(base)._replace(mb=mb)
