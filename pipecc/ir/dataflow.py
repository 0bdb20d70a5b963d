"""What each computation consumes and produces: the data dependencies of DESIGN §2 and §5.

A forward of stage s consumes the activation of stage s-1 and produces the input of stage
s+1; a backward (B or I) of stage s consumes the gradient from stage s+1 and produces the
gradient for stage s-1; a W consumes what its I left behind. A message is named by the
stage that receives it.

`Dataflow` answers these questions for one placement. It gives each message a dense integer
key (mb · stride + base), which the passes over 10⁵–10⁶ ops use as dictionary keys, and
precomputes per (kind, pipe, stage) a `FlowTemplate` so that the hot loops do one table
look-up per op.
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


class Flow(NamedTuple):
    """A message in integer form: its key, the sending rank, the receiving rank."""

    key: int
    src: int
    dst: int


class FlowTemplate(NamedTuple):
    """The message a (kind, pipe, stage) consumes or produces, for any microbatch:
    its key is `mb * Dataflow.mb_stride + base`."""

    base: int
    src: int
    dst: int
    what: Msg
    pipe: int
    stage: int  # the receiving stage


_WHAT = (Msg.ACT, Msg.GRAD)
Table = dict[Kind, list[list[FlowTemplate | None]]]


class Dataflow:
    """The dependencies of computations under one placement."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._pipes = placement.num_pipes
        self._stride = max(placement.num_stages(p) for p in range(self._pipes))
        self.mb_stride = self._pipes * self._stride * 2
        rank_of = [
            [placement.holder(pipe, stage).rank for stage in range(placement.num_stages(pipe))]
            for pipe in range(self._pipes)
        ]
        self.inputs: Table = {kind: [] for kind in Kind}
        self.outputs: Table = {kind: [] for kind in Kind}
        for pipe, ranks in enumerate(rank_of):
            for kind in Kind:
                self.inputs[kind].append(
                    [self._input(kind, pipe, s, ranks) for s in range(len(ranks))]
                )
                self.outputs[kind].append(
                    [self._output(kind, pipe, s, ranks) for s in range(len(ranks))]
                )

    def _template(self, what: Msg, pipe: int, stage: int, src: int, dst: int) -> FlowTemplate:
        base = ((pipe * self._stride + stage) << 1) | (what is Msg.GRAD)
        return FlowTemplate(base, src, dst, what, pipe, stage)

    def _input(self, kind: Kind, pipe: int, stage: int, ranks: list[int]) -> FlowTemplate | None:
        if kind is Kind.F:
            if stage == 0:
                return None
            return self._template(Msg.ACT, pipe, stage, ranks[stage - 1], ranks[stage])
        if kind is Kind.W or stage == len(ranks) - 1:
            return None
        return self._template(Msg.GRAD, pipe, stage, ranks[stage + 1], ranks[stage])

    def _output(self, kind: Kind, pipe: int, stage: int, ranks: list[int]) -> FlowTemplate | None:
        if kind is Kind.F:
            if stage == len(ranks) - 1:
                return None
            return self._template(Msg.ACT, pipe, stage + 1, ranks[stage], ranks[stage + 1])
        if kind is Kind.W or stage == 0:
            return None
        return self._template(Msg.GRAD, pipe, stage - 1, ranks[stage], ranks[stage - 1])

    def key(self, what: Msg, pipe: int, stage: int, mb: int) -> int:
        """The dense integer key of message (what, pipe, stage, mb)."""
        return mb * self.mb_stride + (((pipe * self._stride + stage) << 1) | (what is Msg.GRAD))

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
