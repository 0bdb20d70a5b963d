"""Split each MoE stage's computations into phases, with the expert-parallel all-to-alls.

A stage with K MoE layers (`Program.moe`, docs/parallelism.md "Expert parallelism") runs
its forward as pre0, experts0, ..., experts(K-1), post (`ir.ops.phases`) with an
all_to_all over the mesh's `ep` dimension between each two: layer l's dispatch after
pre l, its combine after experts l. A backward (B or I) runs the reverse, with the
gradients' all-to-alls: combine-grad before experts l, dispatch-grad after it. A W holds no
all-to-all and stays whole. Each all-to-all is its own instruction,
`Collective(all_to_all, (rank,), what, dims=("ep",), stages=(stage,))`, its `what` naming
the layer, the direction and the microbatch (`dispatch L0 F1.3`, `combine-grad L1 B0.2`; an
I's are a B's: the same gradients cross).

A plain op's all-to-alls are blocking. A fused F&B (or F&I) of MoE stages is written, with
`overlap`, as DualPipe's interleave: the backward half's phases alternate with the forward
half's (the forward walking layers 0..K-1 while the backward walks K-1..0), each
all-to-all posted asynchronously after the phase that makes its tensor and waited just
before the other half's next phase, so it travels while the other half computes; without
`overlap`, its forward's phases then its backward's, blocking (the sequential form).

The op's receives and sends stay where they are: its first phase consumes what it receives,
its sends follow its last phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

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
    all_to_all_what,
    phases,
)
from pipecc.ir.program import Program
from pipecc.passes.splice import positions, splice

DIM = "ep"
KIND = CollectiveKind.ALL_TO_ALL


def expand_moe(prog: Program, layers: Sequence[int], *, overlap: bool = True) -> Program:
    """`prog` with the MoE stages' F, B and I split into phases and all-to-alls (module
    docstring); `layers[s]`: the MoE layers of stage s (pipe 0's numbering).

    Requires: a pipeline's program (not the whole mesh) without phases, `len(layers)` its
    stages (InputError otherwise). Ensures: every Wait keeps its ops; `prog.moe` is `layers`.
    """
    stages = prog.placement.num_stages(0)
    if len(layers) != stages:
        raise InputError(f"--moe: {len(layers)} layer counts for a program of {stages} stages")
    if prog.is_whole_mesh:
        raise InputError(
            "the program is written for the whole mesh (one list per global rank): --moe "
            "splits a pipeline's program"
        )
    if any(type(x) is Phase for instrs in prog.ranks for x in instrs):
        raise InputError("--moe: the program is split into MoE phases already")
    moe = tuple(layers)
    ranks = tuple(
        _Expander(rank, moe, overlap).rank(instrs) for rank, instrs in enumerate(prog.ranks)
    )
    return replace(prog, ranks=ranks, moe=moe)


def all_to_alls(program: Program) -> list[int]:
    """The number of all-to-all instructions of each rank."""
    return [
        sum(type(x) is Collective and x.kind is KIND for x in instrs) for instrs in program.ranks
    ]


class _Half:
    """One op's phases and the all-to-alls between them (after phase j: `a2a[j]`)."""

    def __init__(self, rank: int, op: Compute, layers: int, asynchronous: bool) -> None:
        self.phases = phases(op, layers)
        self.a2a = tuple(
            Collective(
                KIND,
                (rank,),
                all_to_all_what(op, layers, j),
                asynchronous,
                (DIM,),
                (op.stage,),
                1,
                op.span,
            )
            for j in range(len(self.phases) - 1)
        )

    def sequential(self) -> list[Instr]:
        out: list[Instr] = []
        for j, phase in enumerate(self.phases):
            out.append(phase)
            if j < len(self.a2a):
                out.append(self.a2a[j])
        return out


class _Expander:
    """One rank's list, expanded."""

    def __init__(self, rank: int, layers: tuple[int, ...], overlap: bool) -> None:
        self.at = rank
        self.layers = layers
        self.overlap = overlap
        self.waits: dict[int, Collective] = {}  # id of a placeholder Wait -> its all-to-all

    def rank(self, instrs: Sequence[Instr]) -> tuple[Instr, ...]:
        before: dict[int, list[Instr]] = {}
        for i, x in enumerate(instrs):
            found = self.expand(x)
            if found is not None:
                before[i] = found
        if not before:
            return tuple(instrs)
        split = {id(instrs[i]) for i in before}
        placed = splice(instrs, before=before, drop=lambda x: id(x) in split)
        return self._fill(placed)

    def layers_of(self, op: Compute) -> int:
        stage = op.stage
        return self.layers[stage] if 0 <= stage < len(self.layers) else 0

    def expand(self, x: Instr) -> list[Instr] | None:
        """The instructions that replace `x`, or None to keep it."""
        match x:
            case Compute(kind=kind) if kind is not Kind.W and self.layers_of(x):
                return _Half(self.at, x, self.layers_of(x), False).sequential()
            case Fused(forward=f, backward=b) if self.layers_of(f) or self.layers_of(b):
                return self.fused(f, b)
            case Sequential(parts=parts) if any(self.layers_of(op) for op in parts):
                return [y for op in parts for y in self.plain(op)]
            case _:
                return None

    def plain(self, op: Compute) -> list[Instr]:
        if op.kind is Kind.W or not self.layers_of(op):
            return [op]
        return _Half(self.at, op, self.layers_of(op), False).sequential()

    def fused(self, f: Compute, b: Compute) -> list[Instr]:
        if not self.overlap:
            return self.plain(f) + self.plain(b)
        fh = _Half(self.at, f, self.layers_of(f), True) if self.layers_of(f) else None
        bh = _Half(self.at, b, self.layers_of(b), True) if self.layers_of(b) else None
        if fh is None or bh is None:  # one half has no MoE layer: nothing to hide behind
            return self.plain(f) + self.plain(b)
        return self.interleave(fh, bh)

    def interleave(self, fh: _Half, bh: _Half) -> list[Instr]:
        """DualPipe's order: for j = 0, 1, ...: the backward's phase j, its all-to-all j
        posted; the forward's phase j, its all-to-all j posted; each all-to-all waited just
        before the phase that consumes it, or before the other half's next post."""
        out: list[Instr] = []
        pending: dict[int, Collective | None] = {id(fh): None, id(bh): None}

        def need(half: _Half) -> None:
            op = pending[id(half)]
            if op is not None:
                pending[id(half)] = None
                wait = Wait(())
                self.waits[id(wait)] = op
                out.append(wait)

        def step(half: _Half, j: int, other: _Half) -> None:
            if j >= len(half.phases):
                return
            need(half)  # its own all-to-all j-1: this phase consumes it
            out.append(half.phases[j])
            need(other)  # the other half's, travelling behind this phase
            if j < len(half.a2a):
                out.append(half.a2a[j])
                pending[id(half)] = half.a2a[j]

        for j in range(max(len(fh.phases), len(bh.phases))):
            step(bh, j, fh)
            step(fh, j, bh)
        need(fh)
        need(bh)
        return out

    def _fill(self, placed: tuple[Instr, ...]) -> tuple[Instr, ...]:
        """The placeholder Waits, listing the all-to-alls' final indices."""
        if not self.waits:
            return placed
        ops = [op for x in placed if id(x) in self.waits for op in (self.waits[id(x)],)]
        at = dict(zip((id(op) for op in ops), positions(placed, ops), strict=True))
        return tuple(
            Wait((at[id(self.waits[id(x)])],)) if id(x) in self.waits else x for x in placed
        )
