"""The knobs of comm lowering: the replay that orders a program, where receives go, what is
grouped, and the named policies (`insert_comms` describes the default)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from pipecc.ir.ops import Compute, Fused, Kind, Sequential, computations
from pipecc.ir.program import Backend

UNIT_COST = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}


class RecvPosting(enum.Enum):
    """Where a receive is posted on its rank (both keep every pair in one global order)."""

    # before the first compute op that starts once the message exists (the default policy)
    WHEN_MADE = "when-made"
    # before the compute op during which the message comes to exist, so that a rendezvous
    # transfer can start the moment the data is there (the alignment pass)
    BEFORE_BUSY = "before-busy"
    # before the first compute op of the rank (the early-recv policy: rendezvous only)
    AT_START = "at-start"


class SendWait(enum.Enum):
    """Where a send is completed on its rank."""

    # before the first compute op that starts, in the ordering replay, once the receiver has
    # consumed the message
    WHEN_CONSUMED = "when-consumed"
    # with the first receive from the same peer posted after it (in the Wait that completes
    # that receive), else at the end: a send ahead of a receive on their pair's order is
    # complete by the time the receive is, under every comm model, so this Wait never blocks
    # on the send
    WITH_REPLY = "with-reply"


class Grouping(enum.Enum):
    """Which posts between two compute ops are posted together (one nccl unit)."""

    PER_GAP = "per-gap"  # all of them (the early-recv policy)
    BY_TIME = "by-time"  # those whose messages come to exist at the same moment
    # those of one moment and one peer (the default policy): two transfers of one pair made
    # together run at once, and a group never ties one stream to another
    BY_PAIR = "by-pair"
    NONE = "none"  # each alone


class MessageOrder(enum.Enum):
    """How the global order of messages is chosen (`comm.refine`)."""

    # by the moment each message comes to exist in the ordering replay
    MADE = "made"
    # the same, except that a message is put after a later one from its receiver that its
    # sender's next compute op consumes (the default policy; `comm.refine`)
    REPLY_FIRST = "reply-first"


def unit_duration(instr: Compute | Fused | Sequential) -> float:
    """The default policy's durations: `UNIT_COST`, a fused or sequential op the sum of its
    parts."""
    if type(instr) is Compute:
        return UNIT_COST[instr.kind]
    return sum(UNIT_COST[op.kind] for op in computations(instr))


def no_latency(stage: int) -> float:
    """No message latency (the early-recv policy's ordering replay)."""
    return 0.0


# The default policy's nominal message latency, in units of a forward: enough to break the
# ties of a unit-time replay the way any real latency breaks them (a message comes to exist
# on its receiver during an op, not at its boundary), small enough not to reorder what the
# compute order decides. A binary fraction, so that equal times stay exactly equal.
NOMINAL_LATENCY = 0.125


def nominal_latency(stage: int) -> float:
    """The default policy's message latency: `NOMINAL_LATENCY` for every message."""
    return NOMINAL_LATENCY


@dataclass(frozen=True, slots=True)
class CommPlacement:
    """The knobs of the lowering: the durations and latencies of the replay that orders the
    program, where receives go, what is grouped, where sends are completed, how the global
    order is refined and how far ahead receives are posted (the field defaults are the knobs
    of the early-recv policy and of the alignment pass, which set their own `recv_posting`
    and `grouping`). `DEFAULT` is the default policy; the alignment
    pass (`align_comms`) uses the real costs. A compute op's `duration` may depend
    on its kind and stage only: it is asked once per (kind, pipe, stage), not per op."""

    policy: str
    duration: Callable[[Compute | Fused | Sequential], float] = unit_duration
    latency: Callable[[int], float] = no_latency  # by receiving stage
    recv_posting: RecvPosting = RecvPosting.WHEN_MADE
    grouping: Grouping = Grouping.PER_GAP
    send_wait: SendWait = SendWait.WHEN_CONSUMED
    order: MessageOrder = MessageOrder.MADE
    # a receive is posted at least this many compute ops before the op that consumes it,
    # where the pair's order allows (0: where `recv_posting` puts it)
    recv_lead: int = 0
    backend: Backend = Backend.ANY  # what the placed program needs of the backend

    @property
    def unit_time(self) -> bool:
        """The replay's times are the unit costs' integers (no real durations, no latency)."""
        return self.duration is unit_duration and self.latency is no_latency


DEFAULT = CommPlacement(
    "default",
    latency=nominal_latency,
    recv_posting=RecvPosting.BEFORE_BUSY,
    grouping=Grouping.BY_PAIR,
    send_wait=SendWait.WITH_REPLY,
    order=MessageOrder.REPLY_FIRST,
    recv_lead=2,
)
POLICY = DEFAULT.policy
EARLY_RECV = CommPlacement(
    "early-recv", recv_posting=RecvPosting.AT_START, backend=Backend.INDEPENDENT_PROGRESS
)
POLICIES = {placement.policy: placement for placement in (DEFAULT, EARLY_RECV)}


def backend_of(policy: str) -> Backend:
    """What a program placed by the named policy needs of the backend (ANY for a name that is
    not a policy of `POLICIES`: aligned, torch-csv, none)."""
    found = POLICIES.get(policy)
    return Backend.ANY if found is None else found.backend
