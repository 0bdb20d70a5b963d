"""A pipeline's program with its MoE stages split into phases, for `pipecc run` and the tests.

The compiler splits a program for `--moe K` (pipecc/passes/expand_moe.py, the contract of
issue 33): each F, B and I of a stage with K MoE layers becomes its phases with an
all-to-all over `ep` between each two, a fused F&B (or F&I) DualPipe's interleave (each
all-to-all posted async after the phase that makes its tensor, waited just before the other
half's next phase) or, without overlap, its halves in sequence. `pipecc run` takes such a
program as it is; given a program without phases and a model file whose stages are MoE
stages (runtime/engine/moe_block.py), it splits it here the same way, with K from the
stages, and adds the dense gradients' reduction over `ep` when the program has none
(`dp-grad dense sN`, blocking, after the rank's last instruction). The runtime runs either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from pipecc.diagnostics import InputError
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Instr,
    Kind,
    Phase,
    Sequential,
    Wait,
    phases,
)
from pipecc.ir.program import Program

from ..engine.moe_block import blocks_of

A2A = CollectiveKind.ALL_TO_ALL


def moe_layers(stages: Sequence[torch.nn.Module]) -> tuple[int, ...]:
    """The MoE blocks of each stage (0 for a stage that is no MoE stage)."""
    return tuple(len(blocks_of(stage) or ()) for stage in stages)


def split_moe(program: Program, layers: Sequence[int], *, overlap: bool = True) -> Program:
    """`program` with its MoE stages' F, B and I split into phases and all-to-alls, and the
    dense gradients reduced over `ep` (module docstring; also without MoE layers: an EP rank
    is a data-parallel replica). A program with phases: as it is."""
    if program.moe is not None:
        return program
    moe = tuple(layers)
    ranks = program.ranks
    if any(moe):
        ranks = tuple(_Rank(rank, moe, overlap).expand(instrs) for rank, instrs in enumerate(ranks))
    return replace(program, ranks=_reduced(program, ranks, moe), moe=moe if any(moe) else None)


def what(op: Compute, layers: int, j: int) -> str:
    """The `what` of the all-to-all after phase j of `op` (dispatch L0 F1.3, ...)."""
    if op.kind is Kind.F:
        return f"{'dispatch' if j % 2 == 0 else 'combine'} L{j // 2} {op.label()}"
    verb = "combine-grad" if j % 2 == 0 else "dispatch-grad"
    return f"{verb} L{layers - 1 - j // 2} {op.label()}"


class _Rank:
    """One rank's list, expanded; Waits renumbered."""

    def __init__(self, rank: int, layers: tuple[int, ...], overlap: bool) -> None:
        self.rank, self.layers, self.overlap = rank, layers, overlap
        self.out: list[Instr] = []

    def expand(self, instrs: Sequence[Instr]) -> tuple[Instr, ...]:
        moved: dict[int, int] = {}
        for index, instr in enumerate(instrs):
            if type(instr) is Wait:
                self.out.append(Wait(tuple(moved[i] for i in instr.ops)))
            elif type(instr) is Compute and self._k(instr):
                self._plain(instr)
            elif type(instr) is Fused and (self._k(instr.forward) or self._k(instr.backward)):
                self._fused(instr.forward, instr.backward)
            elif type(instr) is Sequential and any(self._k(op) for op in instr.parts):
                for op in instr.parts:
                    self._plain(op)
            else:
                moved[index] = len(self.out)
                self.out.append(instr)
        return tuple(self.out)

    def _k(self, op: Compute) -> int:
        return 0 if op.kind is Kind.W or op.stage >= len(self.layers) else self.layers[op.stage]

    def _a2a(self, op: Compute, j: int, asynchronous: bool) -> Collective:
        text = what(op, self._k(op), j)
        return Collective(A2A, (self.rank,), text, asynchronous, ("ep",), (op.stage,))

    def _plain(self, op: Compute) -> None:
        if not self._k(op):
            self.out.append(op)
            return
        steps = phases(op, self._k(op))
        for j, phase in enumerate(steps):
            self.out.append(phase)
            if j < len(steps) - 1:
                self.out.append(self._a2a(op, j, False))

    def _fused(self, forward: Compute, backward: Compute) -> None:
        if not (self.overlap and self._k(forward) and self._k(backward)):
            self._plain(forward)
            self._plain(backward)
            return
        halves = (phases(backward, self._k(backward)), phases(forward, self._k(forward)))
        ops = (backward, forward)
        pending: list[int | None] = [None, None]
        for j in range(max(len(h) for h in halves)):
            for side in (0, 1):
                self._interleaved(halves[side], ops[side], j, side, pending)
        for side in (1, 0):
            self._wait(pending, side)

    def _interleaved(
        self, half: tuple[Phase, ...], op: Compute, j: int, side: int, pending: list[int | None]
    ) -> None:
        """Phase j of one half: its own all-to-all waited, the phase, the other half's
        waited, its all-to-all posted."""
        if j >= len(half):
            return
        self._wait(pending, side)
        self.out.append(half[j])
        self._wait(pending, 1 - side)
        if j < len(half) - 1:
            pending[side] = len(self.out)
            self.out.append(self._a2a(op, j, True))

    def _wait(self, pending: list[int | None], side: int) -> None:
        index = pending[side]
        if index is not None:
            pending[side] = None
            self.out.append(Wait((index,)))


def _reduced(
    program: Program, ranks: tuple[tuple[Instr, ...], ...], moe: tuple[int, ...]
) -> tuple[tuple[Instr, ...], ...]:
    """Each rank's dense gradients reduced over `ep` (with ep > 1, and none yet)."""
    mesh = program.mesh
    if mesh is None or mesh.ep == 1:
        return ranks
    if any(
        type(x) is Collective and "ep" in x.dims and x.kind is not A2A for r in ranks for x in r
    ):
        return ranks
    out = []
    for rank, instrs in enumerate(ranks):
        stages = sorted(slot.stage for slot in program.placement.chunks(rank))
        added = tuple(
            Collective(
                CollectiveKind.ALL_REDUCE,
                (rank,),
                f"dp-grad {'dense ' if s < len(moe) and moe[s] else ''}s{s}",
                False,
                ("ep",),
                (s,),
            )  # fmt: skip
            for s in stages
        )
        out.append(instrs + added)
    return tuple(out)


def refuse_unsplit(program: Program, mesh: Any, layers: Sequence[int], model: str) -> None:
    """On a mesh with ep > 1 a model of MoE stages runs in phases, with their all-to-alls:
    the program `pipecc run --moe K` resolved and verified (the compiler's expand_moe), never
    one split after the verification. A MoE model given a program without them is refused."""
    if program.moe is not None or mesh is None or mesh.ep == 1 or not any(layers):
        return
    raise InputError(
        f"{model}: its stages hold MoE layers ({', '.join(map(str, layers))} by stage) and the "
        f"mesh has ep={mesh.ep}: give --moe K (K MoE layers a stage), so that the program run "
        "holds their dispatch and combine all-to-alls, verified with every other op "
        "(docs/parallelism.md)"
    )
