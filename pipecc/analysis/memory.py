"""The one memory rule (DESIGN §2): how many activations a rank holds, instruction by
instruction.

One unit is one stage's activations for one microbatch: F allocates 1; B frees 1; I frees 0
(what W needs stays); W frees 1; a fused op allocates its forward before its backward frees;
a sequential op (torch's OVERLAP_F_B) applies its parts in the order written.
With these units the peaks are P for 1F1B and ZB-H1 and 2P-1 for ZB-H2, on rank 0. The
verifier's --max-activations and the simulator's peaks in units read them here.

The same rule in bytes (below: parameters, gradients, optimizer state, activations, message
buffers, unsharded parameters, each stage's sizes from the cost model) gives each rank's
whole predicted peak: `simulate`'s and `compare`'s `peak_bytes`, `verify --memory-budget`
and `pipecc run --memory`'s prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, cast

from pipecc.ir.keys import Message, carried, consumed, produced
from pipecc.ir.ops import (
    Collective,
    Compute,
    Fused,
    Instr,
    Kind,
    Phase,
    Recv,
    Send,
    Sequential,
    StageAction,
    StageOp,
    Wait,
    computations,
)
from pipecc.ir.program import Program
from pipecc.semantics.costs import CostModel, StageCost

_F, _I = Kind.F, Kind.I


class RankPeak(NamedTuple):
    """The most live activation units of a rank, first reached at instruction `at` (-1 for a
    rank without computations)."""

    peak: int
    at: int


def activation_delta(kind: Kind) -> int:
    """Units a computation of this kind allocates (+1) or frees (-1)."""
    # identity tests: hashing an enum member for a dict lookup is a Python-level call
    return 1 if kind is _F else 0 if kind is _I else -1


def phase_ops(phase: Phase) -> tuple[Compute, ...]:
    """Where a MoE op's activations count: a forward allocates at its first phase, a
    backward frees (or, an I, keeps) at its last; its other phases change nothing."""
    op = phase.op
    if phase.is_first if op.kind is _F else phase.is_last:
        return (op,)
    return ()


def peak_activations(instrs: Sequence[Instr]) -> RankPeak:
    """The peak of one rank's instruction list, in units."""
    live, top, at = 0, 0, -1
    for index, instr in enumerate(instrs):
        if type(instr) is Compute:
            live += activation_delta(instr.kind)
        elif type(instr) is Fused:
            live += activation_delta(instr.forward.kind)
            if live > top:  # the forward allocates before the backward frees
                top, at = live, index
            live += activation_delta(instr.backward.kind)
        elif type(instr) is Phase:
            live += sum(activation_delta(op.kind) for op in phase_ops(instr))
        elif type(instr) is Sequential:  # torch's OVERLAP_F_B: its parts in the order written
            for op in instr.parts:
                live += activation_delta(op.kind)
                if live > top:
                    top, at = live, index
            continue
        else:
            continue
        if live > top:
            top, at = live, index
    return RankPeak(top, at)


# ---- bytes ---------------------------------------------------------------------------------
#
# The rule in bytes, over one rank's instruction list (docs/simulate.md "Memory in bytes"):
#
# - from the start of the step: each of the rank's stages' parameters (`sharded_param_bytes`
#   where given, else `param_bytes`) and optimizer state (`optim_bytes`); a stage given as
#   sharded whose program holds no UNSHARD keeps its unsharded copy the whole step;
# - a stage's gradients (`grad_bytes`) appear at its first backward: B allocates all of them;
#   with split backward the first I those of the parameters I computes, `grad_bytes -
#   grad_bytes_w`, and the first W the rest, `grad_bytes_w` (default: all in W);
# - activations of (stage, mb): F allocates `act_bytes` (what it keeps for the backward, its
#   inputs included); I leaves `act_bytes_w` (what stays until W; default `act_bytes`: I
#   frees nothing), W frees that; B frees all; F&B allocates its forward before its
#   backward frees; a sequential op applies its parts in the order written;
# - every receive buffer, `bytes` of the message's stage, the whole step (the runtime allocates
#   one per receive when it binds a shape signature and reuses them every step of it; a
#   forward's received input is that buffer, so `act_bytes` leaves it out, as it leaves out
#   an input handed on by a stage of the same rank: that stage's output); a gradient a B or
#   I hands on,
#   `bytes` of the stage it goes to, from that op to the wait that completes its send (or to
#   the computation of this rank that takes it); a forward's output is part of its
#   activations, but for `out_bytes` (what the stage does not keep: a recomputed stage's
#   output), held as a gradient handed on is;
# - UNSHARD allocates `unsharded_param_bytes`, RESHARD frees it;
# - during a computation, `workspace_<kind>` more than the larger of before and after, where
#   a W's before counts the gradients it allocates (a stage's first W makes them while the
#   activations it frees, held by its deferred work until it ends, are still alive);
# - the gradient sum of parameters held by several ranks holds `workspace_sum` of each of the
#   rank's stages above what was live before it: at its collective, or after the program
#   for a program with two pipes (DualPipe's duplicated stages) that holds no collective
#   (the runtime sums them after it).


def activation_peak_bytes(instrs: Sequence[Instr], size: Callable[[int], float]) -> float:
    """The peak of live activations of one rank's computations in bytes, a unit of stage s
    weighing `size(s)` (the unit rule above in bytes; `peak_bytes` is the whole peak of a
    rank: parameters, gradients, optimizer, buffers and workspace too)."""
    live = peak = 0.0
    for instr in instrs:
        if type(instr) is Compute:
            parts: tuple[Compute, ...] = (instr,)
        elif type(instr) is Fused or type(instr) is Sequential:
            parts = computations(instr)
        elif type(instr) is Phase:
            parts = phase_ops(instr)
        else:
            continue
        for op in parts:
            live += activation_delta(op.kind) * size(op.stage)
            peak = max(peak, live)
    return peak


class Breakdown(NamedTuple):
    """Live bytes by kind at one moment."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    unsharded: float = 0.0
    workspace: float = 0.0  # an op's own peak above the larger of before and after

    def total(self) -> float:
        return sum(self)

    def to_json(self) -> dict[str, float]:
        return {name: value for name, value in zip(self._fields, self, strict=True)}


class BytePeak(NamedTuple):
    """The largest live bytes of a rank, first reached at instruction `at` (-1: before its
    first instruction), and what they were."""

    peak: float
    at: int
    breakdown: Breakdown


class StageBytes(NamedTuple):
    """The sizes of one stage the rule reads (defaults applied)."""

    params: float
    grads: float
    grads_w: float
    optim: float
    act: float
    act_w: float
    sharded: bool
    unsharded: float
    message: float  # one message named by this stage (`bytes`)
    workspace: tuple[float, float, float, float]  # F, B, I, W
    summing: float = 0.0  # the gradient sum's workspace (`workspace_sum`)
    out: float = 0.0  # of a forward's output, what the stage does not keep (`out_bytes`)


_PARAMS, _GRADS, _OPTIM, _ACTS, _BUFFERS, _UNSHARDED = range(6)
_KIND_INDEX = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 3}


def stage_bytes(costs: CostModel, stage: int, *, optimizer: bool = True) -> StageBytes:
    """The sizes of `stage` from a (converted) cost model; `optimizer=False` leaves the
    optimizer state out (`pipecc run` takes no optimizer step)."""
    cost = costs.stage(stage)
    act = cost.act_bytes or 0.0
    grads = cost.grad_bytes or 0.0
    sharded = cost.sharded_param_bytes is not None
    return StageBytes(
        params=(cost.sharded_param_bytes if sharded else cost.param_bytes) or 0.0,
        grads=grads,
        grads_w=grads if cost.grad_bytes_w is None else cost.grad_bytes_w,
        optim=(cost.optim_bytes or 0.0) if optimizer else 0.0,
        act=act,
        act_w=act if cost.act_bytes_w is None else cost.act_bytes_w,
        sharded=sharded,
        unsharded=cost.unsharded_param_bytes or 0.0,
        message=cost.bytes or 0.0,
        workspace=(
            cost.workspace_F or 0.0,
            cost.workspace_B or 0.0,
            cost.workspace_I or 0.0,
            cost.workspace_W or 0.0,
        ),
        summing=cost.workspace_sum or 0.0,
        out=cost.out_bytes or 0.0,
    )


def peak_bytes(program: Program, rank: int, size: Callable[[int], StageBytes]) -> BytePeak:
    """The peak of `rank` in bytes, stage s weighing `size(s)` (the rule above)."""
    return _ByteSweep(program, rank, size).run()


class _ByteSweep:
    """One pass over a rank's instructions, keeping live bytes by kind."""

    def __init__(self, program: Program, rank: int, size: Callable[[int], StageBytes]) -> None:
        self.instrs = program.ranks[rank]
        self.placement = program.placement
        self.rank = rank
        self._sizes: dict[int, StageBytes] = {}
        self._size = size
        self.live = [0.0] * 6
        # gradients handed on (and forward outputs not kept: `out_bytes`), until sent or used
        self.buffers: dict[Message, float] = {}
        self.sending: dict[int, Message] = {}  # a Send's index -> the gradient it carries
        self.acts: dict[tuple[int, int, int], float] = {}  # (pipe, stage, mb) -> bytes
        self.grads_seen: set[tuple[int, Kind]] = set()  # (stage, I or W/B) allocated
        self.best = BytePeak(0.0, -1, Breakdown())
        self._start(program)
        self.summing = sum(self.size(slot.stage).summing for slot in program.placement.chunks(rank))
        self.sums_after = program.placement.num_pipes > 1 and not any(
            type(op) is Collective for op in self.instrs
        )

    def _start(self, program: Program) -> None:
        unshards = {op.stage for op in self.instrs if type(op) is StageOp}
        # receive buffers: the runtime allocates one per receive when it binds a signature
        # and keeps them for every step of it (runtime/engine/bound.py), so all are live
        pool = (self.size(op.stage).message for op in self.instrs if type(op) is Recv)
        self.live[_BUFFERS] += sum(pool)
        for slot in program.placement.chunks(self.rank):
            sizes = self.size(slot.stage)
            self.live[_PARAMS] += sizes.params
            self.live[_OPTIM] += sizes.optim
            if sizes.sharded and slot.stage not in unshards:
                self.live[_UNSHARDED] += sizes.unsharded
        self._mark(-1)

    def run(self) -> BytePeak:
        for index, instr in enumerate(self.instrs):
            self._step(index, instr)
        if self.sums_after:
            self._mark(len(self.instrs) - 1, self.summing)
        return self.best

    def _step(self, index: int, instr: Instr) -> None:
        """One instruction's effect on the live bytes."""
        kind = type(instr)
        if kind is Compute:
            self._compute(index, cast(Compute, instr))
        elif kind is Fused or kind is Sequential or kind is Phase:
            parts = phase_ops(cast(Phase, instr)) if kind is Phase else computations(instr)
            for op in parts:
                self._compute(index, op)
        elif kind is Send:
            self._send(index, cast(Send, instr))
        elif kind is Wait:
            for listed in cast(Wait, instr).ops:
                self._free(self.sending.pop(listed, None))
        elif kind is StageOp:
            self._stage_op(index, cast(StageOp, instr))
        elif kind is Collective:
            self._mark(index, self.summing)

    def size(self, stage: int) -> StageBytes:
        found = self._sizes.get(stage)
        if found is None:
            found = self._sizes[stage] = self._size(stage)
        return found

    def _mark(self, index: int, extra: float = 0.0, state: list[float] | None = None) -> None:
        """A candidate peak: `state` (default: live now) plus `extra` workspace."""
        held = self.live if state is None else state
        total = sum(held) + extra
        if total > self.best.peak:
            self.best = BytePeak(total, index, Breakdown._make([*held, extra]))

    def _send(self, index: int, op: Send) -> None:
        key = carried(op)
        if key in self.buffers:  # a gradient this rank handed on: held until the send completes
            self.sending[index] = key

    def _free(self, key: Message | None) -> None:
        if key is not None and key in self.buffers:
            self.live[_BUFFERS] -= self.buffers.pop(key)

    def _stage_op(self, index: int, op: StageOp) -> None:
        nbytes = self.size(op.stage).unsharded
        if op.kind is StageAction.UNSHARD:
            self.live[_UNSHARDED] += nbytes
            self._mark(index)
        elif op.kind is StageAction.RESHARD:
            self.live[_UNSHARDED] -= nbytes

    def _compute(self, index: int, op: Compute) -> None:
        sizes = self.size(op.stage)
        before = list(self.live)
        if op.kind is not Kind.W:
            self._free(consumed(op.kind, op.pipe, op.stage, op.mb))
        key = (op.pipe, op.stage, op.mb)
        if op.kind is Kind.F:
            self.acts[key] = sizes.act
            self.live[_ACTS] += sizes.act
            if sizes.out and not self.placement.is_last_stage(op.pipe, op.stage):
                self._hold(produced(op.kind, op.pipe, op.stage, op.mb), sizes.out)
        else:
            held = self.acts.pop(key, 0.0)
            keep = sizes.act_w if op.kind is Kind.I else 0.0
            if keep:
                self.acts[key] = keep
            self.live[_ACTS] += keep - held
            made = self._grads(op, sizes)
            if op.kind is Kind.W:  # W makes them while the activations it frees live
                before[_GRADS] += made
            if op.kind is not Kind.W:
                self._hand_back(op)
        larger = before if sum(before) > sum(self.live) else None
        self._mark(index, sizes.workspace[_KIND_INDEX[op.kind]], larger)

    def _grads(self, op: Compute, sizes: StageBytes) -> float:
        """The stage's gradients, allocated by its first backward (see the rule); returns
        the bytes allocated now."""
        part = Kind.I if op.kind is Kind.I else Kind.W
        added = 0.0
        for kind in (Kind.I, Kind.W) if op.kind is Kind.B else (part,):
            if (op.stage, kind) in self.grads_seen:
                continue
            self.grads_seen.add((op.stage, kind))
            share = sizes.grads_w if kind is Kind.W else sizes.grads - sizes.grads_w
            self.live[_GRADS] += share
            added += share
        return added

    def _hand_back(self, op: Compute) -> None:
        """The input gradient a B or I hands to the previous stage (none on stage 0)."""
        if op.stage == 0:
            return
        key = produced(op.kind, op.pipe, op.stage, op.mb)
        self._hold(key, self.size(key.stage).message)

    def _hold(self, key: Message, nbytes: float) -> None:
        """A message this rank produced, held until its send completes or a computation of
        this rank takes it."""
        self.buffers[key] = nbytes
        self.live[_BUFFERS] += nbytes


def format_bytes(value: float) -> str:
    """`21474836480` → `20 GiB`; binary units, three significant figures."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def measured_sizes(sizes: Mapping[int, Mapping[str, float]]) -> CostModel:
    """A cost model of the byte keys a run measured per stage (`pipecc run --memory`): each
    stage's table as measured, for the program it was measured on."""
    tables = tuple(
        (stage, StageCost(**{key: float(value) for key, value in table.items()}))
        for stage, table in sorted(sizes.items())
    )
    return CostModel(stages=tables)


def predict_run(program: Program, costs: CostModel) -> list[tuple[BytePeak, float]]:
    """Each rank's predicted peak without the optimizer (`pipecc run` takes no optimizer
    step), and the optimizer state it would hold beside it."""
    found = []
    for rank in range(program.num_ranks):
        peak = peak_bytes(program, rank, lambda s: stage_bytes(costs, s, optimizer=False))
        optim = sum(stage_bytes(costs, slot.stage).optim for slot in program.placement.chunks(rank))
        found.append((peak, optim))
    return found
