"""A cost model as the replay engine's `Timing` (pipecc.semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from pipecc.ir.ops import Collective, Compute, Fused, Phase, Send, Sequential, StageOp

from .model import CostModel


@dataclass(frozen=True, slots=True)
class CostTiming:
    """A cost model as the replay engine's `Timing` (pipecc.semantics): how long each compute
    instruction runs, each message's latency, and the host time of posts and waits."""

    costs: CostModel
    moe: tuple[int, ...] | None = None  # the program's MoE layers per stage (its phases')
    # durations by (kind, stage) or (kind, stage, kind, stage): a program of 10⁶ instructions
    # has a few dozen distinct ones
    _known: dict[tuple[object, ...], float] = field(default_factory=dict, compare=False)

    def duration(
        self, rank: int, index: int, instr: Compute | Fused | Sequential | StageOp | Phase
    ) -> float:
        return self.op_duration(instr)

    def op_duration(self, instr: Compute | Fused | Sequential | StageOp | Phase) -> float:
        if isinstance(instr, StageOp):
            return self.costs.stage_op(instr)
        if isinstance(instr, Phase):
            moe, stage = self.moe or (), instr.op.stage
            return self.costs.phase(instr, moe[stage] if stage < len(moe) else 1)
        if isinstance(instr, Sequential):  # its parts one after another
            return sum(self._compute_duration(op) for op in instr.parts)
        return self._compute_duration(instr)

    def _compute_duration(self, instr: Compute | Fused) -> float:
        if type(instr) is Compute:
            key: tuple[object, ...] = (instr.kind, instr.stage)
            value = self._known.get(key)
            if value is None:
                value = self._known[key] = self.costs.compute(instr)
            return value
        fused = cast(Fused, instr)
        f, b = fused.forward, fused.backward
        key = (f.kind, f.stage, b.kind, b.stage)
        value = self._known.get(key)
        if value is None:
            value = self._known[key] = self.costs.fused(fused)
        return value

    def latency(self, rank: int, index: int, send: Send) -> float:
        return self.costs.latency(send.stage)

    def collective(self, rank: int, index: int, op: Collective) -> float:
        return self.costs.collective(op)

    def overhead(self, rank: int) -> tuple[float, float]:
        return self.costs.overhead()
