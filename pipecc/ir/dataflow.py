"""What each computation consumes and produces: the data dependencies of DESIGN §2 and §5.

A forward of stage s consumes the activation of stage s-1 and produces the input of stage
s+1; a backward (B or I) of stage s consumes the gradient from stage s+1 and produces the
gradient for stage s-1; a W consumes what its I left behind. A message is named by the
stage that receives it.

`Dataflow` answers these questions for one placement. Besides `Message` objects it gives
each message a dense integer key, which the passes over 10⁵–10⁶ ops use as dictionary keys
(hashing an enum is a Python-level call; hashing an int is not).
"""

from __future__ import annotations

from typing import NamedTuple

from pipecc.ir.ops import Kind, Msg
from pipecc.ir.placement import Placement


class Message(NamedTuple):
    """The name of a tensor that crosses a stage boundary: (what, pipe, receiving stage, mb)."""

    what: Msg
    pipe: int
    stage: int
    mb: int

    def label(self) -> str:
        return f"{self.what.value}(pipe {self.pipe}, stage {self.stage}, mb {self.mb})"


class Edge(NamedTuple):
    """A message between two ranks (src == dst when the stages share a rank)."""

    message: Message
    src: int
    dst: int

    @property
    def local(self) -> bool:
        return self.src == self.dst


class Flow(NamedTuple):
    """An edge in integer form: message key, sending rank, receiving rank."""

    key: int
    src: int
    dst: int


_WHAT = (Msg.ACT, Msg.GRAD)


class Dataflow:
    """The dependencies of computations under one placement."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._pipes = placement.num_pipes
        self._stride = max(placement.num_stages(p) for p in range(self._pipes))
        self._rank_of = [
            [placement.holder(pipe, stage).rank for stage in range(placement.num_stages(pipe))]
            for pipe in range(self._pipes)
        ]

    def key(self, what: Msg, pipe: int, stage: int, mb: int) -> int:
        """The dense integer key of message (what, pipe, stage, mb)."""
        return (((mb * self._pipes + pipe) * self._stride + stage) << 1) | (what is Msg.GRAD)

    def message(self, key: int) -> Message:
        """The message with integer key `key` (inverse of `key`)."""
        what = _WHAT[key & 1]
        rest = key >> 1
        stage = rest % self._stride
        rest //= self._stride
        return Message(what, rest % self._pipes, stage, rest // self._pipes)

    def input_flow(self, kind: Kind, pipe: int, stage: int, mb: int) -> Flow | None:
        """The boundary tensor a computation needs from a neighbouring stage, or None
        (the first stage's forward, the last stage's backward, every W)."""
        ranks = self._rank_of[pipe]
        if kind is Kind.F:
            if stage == 0:
                return None
            return Flow(self.key(Msg.ACT, pipe, stage, mb), ranks[stage - 1], ranks[stage])
        if kind is Kind.W or stage == len(ranks) - 1:
            return None
        return Flow(self.key(Msg.GRAD, pipe, stage, mb), ranks[stage + 1], ranks[stage])

    def output_flow(self, kind: Kind, pipe: int, stage: int, mb: int) -> Flow | None:
        """The boundary tensor a computation hands to a neighbouring stage, or None."""
        ranks = self._rank_of[pipe]
        if kind is Kind.F:
            if stage == len(ranks) - 1:
                return None
            return Flow(self.key(Msg.ACT, pipe, stage + 1, mb), ranks[stage], ranks[stage + 1])
        if kind is Kind.W or stage == 0:
            return None
        return Flow(self.key(Msg.GRAD, pipe, stage - 1, mb), ranks[stage], ranks[stage - 1])

    def edge(self, flow: Flow | None) -> Edge | None:
        if flow is None:
            return None
        return Edge(self.message(flow.key), flow.src, flow.dst)
