"""The one replay engine of DESIGN §5: untimed for `verify`, timed for `simulate` and `--align`.

    run = replay(program)                                  # untimed, nccl
    run = replay(program, model=CommModel.RENDEZVOUS, timing=my_costs)
    run.finished, run.start_time(2, 17), run.cause(2, 17), run.stuck

Timed semantics (exact; untimed replay is the same with every duration, latency and
overhead 0):

- Each rank runs its instruction list in order with its own clock, starting at 0.
- Posting a Send or Recv never blocks; it takes the rank's `post` overhead (host time, 0
  unless the timing says otherwise): it starts at the clock and ends `post` later. A unit
  (one op, or a group, below) is posted at the end of its last op's post; everything below
  that says "post" means that moment.
- A compute op (Compute or Fused) starts at max(clock, completion of every Recv on this rank
  whose tensor it consumes) and ends at start + duration. It blocks on such a Recv even
  without a Wait. The Recv it consumes is the one carrying its input message (what, pipe,
  stage, mb) on its rank: the latest one posted before it, else the first one after it (which
  it then waits for forever: a recv consumed before it is posted).
- A Wait starts (is released) at max(clock, completion of every op it lists) and ends the
  rank's `wait` overhead later. Listed indices that are not Send/Recv ops of the rank are
  ignored here (the verifier reports them).
- Matching: per ordered pair (src, dst) the k-th Send of src to dst matches the k-th Recv of
  dst from src, in posting order, whatever messages they name (NCCL and gloo untagged ops).
  An op without a partner (or whose peer is not another rank) never completes.
- Comm completion, with `latency` = time from the moment a transfer can start to the data
  being available at the receiver (not busy time):
  - EAGER: a Send completes when posted; its Recv at max(recv post, send post + latency).
  - RENDEZVOUS: a matched pair transfers from t0 = max(both posts); both complete at
    t0 + latency.
  - NCCL: each rank has one FIFO stream per peer holding its ops toward that peer (sends and
    recvs) in posting order. A *unit* is one op, or a group (consecutive ops of one rank with
    the same non-null group id), and sits on every stream it touches. A unit is active once
    it is posted and at the head of all its streams (every earlier unit on those streams has
    completed): its activation time is the max of its post and those completions. A Send and
    its Recv transfer once both their units are active, from t0 = max of the two activation
    times, and complete at t0 + latency. A unit completes when all its ops have.
  - NCCL_SINGLE: the same with one stream per rank for all its peers.
- Collectives: a Collective is a unit of its own, posted when its rank reaches it (its
  `post` overhead, like a send's). The k-th collective over one set of ranks on each member
  meets the k-th over that set on every other member; they complete together at the max of
  their members' readiness plus the collective's duration (`Timing.collective` of the first
  member), where readiness is the post under eager and rendezvous, and under nccl the
  activation of its unit, which sits on every stream toward the other members (nccl-single:
  on the rank's one stream). A blocking collective holds its rank until it completes (its
  end is then); an async one is completed by a Wait that lists it.
- Deadlock: instructions left unfinished, or posted ops left incomplete, when nothing more
  can happen.

Why a worklist suffices. Matching is fixed by posting order, so every time above is a
max-plus expression of earlier times: no choice depends on which event happens first. The
engine advances each rank until it blocks, and wakes a blocked rank when the op it waits on
completes; any processing order computes the same times (and the same blocked state), so no
global priority queue is needed and one replay decides deadlock for every timing.

Modules: `model` (CommModel, Timing), `wiring` (the static part: numbering, matching,
consumed recvs, units, streams; shared by replays of one program under several models and
timings), `engine` (the rules above), `result` (the Replay: times, causes, blocked state).
The rules live in `engine` only; `verify`, `simulate` and the alignment pass all call
`replay`.
"""

from __future__ import annotations

from pipecc.semantics.engine import replay
from pipecc.semantics.model import (
    NO_OVERHEAD,
    ZERO_TIMING,
    CommModel,
    Overhead,
    Timing,
    ZeroTiming,
)
from pipecc.semantics.result import Block, Cause, CauseKind, Replay, Stuck
from pipecc.semantics.wiring import Wiring, wire

__all__ = [
    "NO_OVERHEAD",
    "ZERO_TIMING",
    "Block",
    "Cause",
    "CauseKind",
    "CommModel",
    "Overhead",
    "Replay",
    "Stuck",
    "Timing",
    "Wiring",
    "ZeroTiming",
    "replay",
    "wire",
]
