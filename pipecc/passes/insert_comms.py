"""Place sends, receives and waits: the default lowering policy (docs/compile.md).

Requires: a compute-only Program from `assign_microbatches` (hand-placed Send/Recv/Wait may
already be present; they are kept where the schedule put them).
Ensures: every message between two ranks has exactly one Send on the producing rank and one
Recv on the consuming rank; every posted op is completed by exactly one Wait; a Recv is
waited before the op that consumes it. For the ops this pass places, the program runs to
completion under every comm model of DESIGN §5, `nccl-single` included, and never turns a
runnable compute order into a deadlock or a mismatch.

The policy, "default":
1. Replay the compute order with unit durations (F=1, B=2, I=1, W=1; a fused op the sum)
   and a nominal latency of 1/8 per message (`NOMINAL_LATENCY`), every op as soon as its
   data allows. This is a topological order of the whole program; a compute order that
   cannot run at all is reported here with the op each rank is stuck on. The latency breaks
   the ties of a unit-time replay the way a real one does: a message comes to exist on its
   receiver during an op, not at its boundary.
2. Give each message the time its producer ends and sort every message into one global
   order (time, then the pair of ranks, then rank and position). Two refinements
   (`comm.refine`) hold up under a latency as long as a compute op, where a pair's
   transfers run one after the other on its stream: a message goes right after a later
   one from its receiver that its sender's very next op consumes ("reply first"), unless
   the receiver's next op needs it as urgently (a cross exchange); and a receive is posted
   at least two compute ops before the op that consumes it. Each rank posts its sends and
   receives in the global order: a send right after the op that produces it, a receive
   before the compute op of its rank during which the message comes to exist (or earlier,
   as just said), each post no earlier than the one before it in the order. Every pair of
   ranks therefore sees its messages in the same order on both sides, and the global order
   is itself a run in which every op completes when it is reached (a send is posted after
   its op, a receive before its consumer: a moved message still comes to exist before its
   consumer starts) — which is why no comm model can deadlock it.
3. The posts of one gap whose messages come to exist at the same moment and go to or come
   from the same peer form one group (posted together, as `batch_isend_irecv`: a fused
   op's two outputs to one rank, a send and a receive of one pair), so that their transfers
   run at once; the others are posted alone, so that a group never ties one stream to
   another. Before each compute op one Wait completes the receives it
   consumes; a send is completed in the Wait of the first receive from the same peer posted
   after it (a send ahead of that receive on their pair is done by the time the receive is,
   under every comm model, so waiting for it there costs nothing), and the sends no receive
   follows by a final Wait, as torch's runtime completes every send at the end of the step.
   Hand-placed sends without a hand-placed `wait` follow the same rule (a program with
   hand-placed comm ops is ordered by time alone, without the refinements of step 2).

The policy "early-recv" (`EARLY_RECV`) orders by a unit-time replay without latency and
posts every receive it places before the first compute op, still in the global order, so a
transfer can start the moment its sender posts; the posts between two compute ops form one
group and a send is completed once its receiver has consumed it in the replay. It is for
gloo: there every posted op progresses on its own (DESIGN §5's `rendezvous` model), and a
receive posted late delays a transfer that could already have happened. Under NCCL's
ordered streams the early receives sit in front of the sends behind them and the program
deadlocks: it passes `verify --comm rendezvous` and `eager` only, and
the runtime refuses to run it on NCCL (the program's `backend`, `Backend.INDEPENDENT_PROGRESS`).
"""

from __future__ import annotations

from dataclasses import replace

from pipecc.diagnostics import LoweringViolation
from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import Instr, Msg, Recv, Send, StageOp, is_compute
from pipecc.ir.printer import message
from pipecc.ir.program import Backend, Program
from pipecc.passes.comm.emission import Emitter, emit_rank, hand_waited
from pipecc.passes.comm.order import (
    collect,
    integer_times,
    manual_messages,
    message_events,
    op_table,
    order_replay,
)
from pipecc.passes.comm.placement import (
    DEFAULT,
    EARLY_RECV,
    NOMINAL_LATENCY,
    POLICIES,
    POLICY,
    UNIT_COST,
    CommPlacement,
    Grouping,
    MessageOrder,
    RecvPosting,
    SendWait,
)
from pipecc.passes.comm.refine import refine
from pipecc.perf import paused_gc

__all__ = [
    "DEFAULT",
    "EARLY_RECV",
    "NOMINAL_LATENCY",
    "POLICIES",
    "POLICY",
    "UNIT_COST",
    "CommPlacement",
    "Grouping",
    "MessageOrder",
    "RecvPosting",
    "SendWait",
    "insert_comms",
    "lower",
    "strip_comms",
]


def insert_comms(
    prog: Program, *, placement: CommPlacement = DEFAULT, check_hand_placed: bool = True
) -> Program:
    """Lower a compute-only program with the default policy, or another of `POLICIES`
    (module docstring). Hand-placed messages that two ranks post in different orders raise
    `LoweringViolation`, unless `check_hand_placed` is False: then the program is returned
    as placed, for the verifier to report (pipecc.driver.compile.violation_report)."""
    return lower(prog, placement, check_hand_placed=check_hand_placed)


def strip_comms(prog: Program) -> Program:
    """`prog` with every send, receive and wait removed, hand-placed ones included: the
    compute-only program a lowering starts from (torch's per-stage StageOps stay)."""
    ranks = tuple(
        tuple(i for i in instrs if is_compute(i) or type(i) is StageOp) for instrs in prog.ranks
    )
    return replace(prog, ranks=ranks, comm="none", backend=Backend.ANY)


def lower(prog: Program, placement: CommPlacement, *, check_hand_placed: bool = True) -> Program:
    """Place the comm ops of `prog` as `placement` says (the module docstring describes the
    default; `align_comms` passes the real costs). The collector is paused: the pass makes
    10⁶ objects for a large program, acyclic (`pipecc.perf.paused_gc`), whoever calls it."""
    with paused_gc():
        return _lower(prog, placement, check_hand_placed)


def _lower(prog: Program, placement: CommPlacement, check_hand_placed: bool) -> Program:
    keys = MessageKeys(prog.placement).by_stage(prog.num_microbatches)
    table = op_table(keys, placement)
    ranks = [collect(instrs, keys, placement, table) for instrs in prog.ranks]
    consumed = order_replay(ranks, prog, keys)
    if not placement.unit_time:
        integer_times(ranks, consumed)
    span = 2 * max((len(instrs) for instrs in prog.ranks), default=1) + 2
    manual = [
        len(ops.computes) != len(instrs) for ops, instrs in zip(ranks, prog.ranks, strict=True)
    ]  # the ranks with hand-placed sends, recvs or waits
    manual_sends, manual_recvs = (
        manual_messages(prog, ranks, keys, span) if any(manual) else ({}, {})
    )
    events = message_events(ranks, manual_sends, manual_recvs, span, placement)
    hand_placed = bool(manual_sends or manual_recvs)  # (torch's StageOps alone are not)
    if not hand_placed and (placement.order is not MessageOrder.MADE or placement.recv_lead):
        refine(events, ranks, keys.size, placement)
    for ops in ranks:  # what the events now hold: freed, so that emission reuses the memory
        ops.outputs.clear()
        ops.publish = None
    lowered = []
    for rank, instrs in enumerate(prog.ranks):
        waited = hand_waited(instrs) if manual[rank] else set()
        emitter = Emitter(
            keys,
            ranks[rank].start,
            consumed,
            placement.grouping,
            placement.send_wait,
            hand_waited=waited,
            hand_order={**manual_recvs, **manual_sends},
        )
        lowered.append(emit_rank(instrs, ranks[rank], events[rank], emitter))
        events[rank] = []
    if any(manual) and check_hand_placed:  # hand-placed sends, recvs or waits
        _check_hand_placed_order(tuple(lowered))
    return Program(
        schedule=prog.schedule,
        source=prog.source,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        params=prog.params,
        comm=placement.policy,
        placement=prog.placement,
        ranks=tuple(lowered),
        backend=placement.backend,
        recompute=prog.recompute,
    )


def _check_hand_placed_order(ranks: tuple[tuple[Instr, ...], ...]) -> None:
    """Hand-placed sends or recvs can post a pair's messages in different orders on the two
    sides; matched in posting order, that would deliver the wrong tensor. Say so here."""
    sends: dict[tuple[int, int], list[Send]] = {}
    recvs: dict[tuple[int, int], list[Recv]] = {}
    for rank, instrs in enumerate(ranks):
        for instr in instrs:
            if type(instr) is Send:
                sends.setdefault((rank, instr.peer), []).append(instr)
            elif type(instr) is Recv:
                recvs.setdefault((instr.peer, rank), []).append(instr)
    for (src, dst), posted in sorted(sends.items()):
        for k, (send, recv) in enumerate(zip(posted, recvs.get((src, dst), []), strict=False)):
            if _name(send) != _name(recv):
                raise _mismatch(src, dst, k, send, recv)


def _name(op: Send | Recv) -> tuple[Msg, int, int, int]:
    return (op.what, op.pipe, op.stage, op.mb)


def _mismatch(src: int, dst: int, k: int, send: Send, recv: Recv) -> LoweringViolation:
    return LoweringViolation(
        f"rank {src}'s send #{k + 1} to rank {dst} carries {message(send, pipes=False)} but "
        f"rank {dst}'s receive #{k + 1} from rank {src} expects {message(recv, pipes=False)}: "
        "messages between two ranks match in posting order, so this would deliver the "
        "wrong tensor (check the order of the hand-placed sends and recvs)",
        send.span or recv.span,
        notes=((recv.span, "the receive"),) if send.span and recv.span else (),
    )
