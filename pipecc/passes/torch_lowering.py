"""torch 2.13's lowering of a compute-only schedule, reimplemented from reading its source.

torch.distributed.pipelining's `_PipelineScheduleRuntime` lowers a compute-only schedule
(`_load_csv(format="compute_only")`, or a schedule class's own order) in this order, per rank
unless noted: add UNSHARD/RESHARD around the compute (`add_unshard_reshard`), add one
REDUCE_GRAD per stage after its last backward (`add_reduce_grad`), then place the sends and
receives across all ranks at once (`add_send_recv`) and, with `defer_pp_recv=True`, move each
receive to just before its consumer (`defer_recvs`). `lower` runs that chain. The functions
here produce the same actions in the same order as torch's, cell for cell (a test dumps
torch's own lowering of every bundled schedule and compares), and raise `MalformedSchedule`
where torch raises. pipecc never imports torch: nothing here does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from pipecc.diagnostics import Note, Span, Violation
from pipecc.passes.torch_actions import Action, ActionKind, Key

MAX_ACTIVE_STAGES = 3  # torch's default prefetch window for UNSHARD
_BACKWARDS = (ActionKind.B, ActionKind.I)


class MalformedSchedule(Violation):
    """torch would refuse to lower this schedule (torch: "Malformed compute schedule"):
    `stuck` maps each rank that could not proceed to the action it could not place (for a
    leftover receive, that receive)."""

    code = "torch-lowering"

    def __init__(
        self,
        message: str,
        stuck: Mapping[int, Action],
        *,
        span: Span | None = None,
        notes: tuple[Note, ...] = (),
        rank: int | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(message, span, notes=notes, rank=rank, index=index)
        self.stuck = dict(stuck)


# ---- UNSHARD / RESHARD (torch's _add_unshard_reshard) ----------------------------------------


def _next_stages(actions: Sequence[Action | None], start: int, count: int) -> list[int]:
    """The first `count` distinct stages computed from position `start` on, in order. An
    OVERLAP_F_B contributes all its sub-actions' stages before the count is checked."""
    seen: list[int] = []
    for action in actions[start:]:
        if action is None:
            continue
        if action.kind is ActionKind.OVERLAP_F_B:
            for part in action.parts:
                if part.stage not in seen:
                    seen.append(part.stage)
            if len(seen) >= count:
                break
        elif action.stage not in seen:
            seen.append(action.stage)
            if len(seen) == count:
                break
    return seen


def add_unshard_reshard(
    actions: Sequence[Action | None], max_active: int = MAX_ACTIVE_STAGES
) -> list[Action]:
    """Before each compute action: RESHARD the active stages not among the next `max_active`
    stages computed, then UNSHARD those of them not active yet; RESHARD what is left active
    at the end. Idle slots (None) are dropped.

    The stages to evict are taken in the iteration order of the set of active stages, as
    torch's are (a CPython set of small integers, given the same additions and removals).
    """
    active: set[int] = set()
    out: list[Action] = []
    for i, action in enumerate(actions):
        if action is None:
            continue
        upcoming = _next_stages(actions, i, max_active)
        fetch = [s for s in upcoming if s not in active]
        evict = [s for s in active if s not in upcoming]
        for stage in evict:
            active.remove(stage)
            out.append(Action(stage, ActionKind.RESHARD))
        for stage in fetch:
            active.add(stage)
            out.append(Action(stage, ActionKind.UNSHARD))
        out.append(action)
    for stage in list(active):
        active.remove(stage)
        out.append(Action(stage, ActionKind.RESHARD))
    return out


# ---- REDUCE_GRAD (torch's _add_reduce_grad) ---------------------------------------------------


def add_reduce_grad(actions: Sequence[Action | None], microbatches: int) -> list[Action]:
    """After the action holding a stage's M-th weight-gradient step (a B or a W, counted in
    OVERLAP_F_B sub-actions too), one REDUCE_GRAD of that stage. Idle slots are dropped."""
    counts: dict[int, int] = defaultdict(int)
    out: list[Action] = []
    for action in actions:
        if action is None:
            continue
        out.append(action)
        for part in action.leaves():
            if part.kind in (ActionKind.B, ActionKind.W):
                counts[part.stage] += 1
                if counts[part.stage] == microbatches:
                    out.append(Action(part.stage, ActionKind.REDUCE_GRAD))
    return out


# ---- I + W → B (torch's _merge_bw) ------------------------------------------------------------


def merge_bw(actions: Sequence[Action | None]) -> list[Action]:
    """An I directly followed (idle slots skipped) by the W of the same stage and microbatch
    becomes one B."""
    present = [a for a in actions if a is not None]
    out: list[Action] = []
    i = 0
    while i < len(present):
        action = present[i]
        following = present[i + 1] if i + 1 < len(present) else None
        if (
            action.kind is ActionKind.I
            and following is not None
            and following.kind is ActionKind.W
            and (following.stage, following.mb) == (action.stage, action.mb)
        ):
            out.append(Action(action.stage, ActionKind.B, action.mb))
            i += 2
        else:
            out.append(action)
            i += 1
    return out


# ---- sends and receives (torch's _add_send_recv) ---------------------------------------------


class _Comms:
    """Which actions send, to whom, and when a rank may place its next action."""

    def __init__(self, stage_rank: Mapping[int, int], num_stages: int) -> None:
        self.rank = stage_rank
        self.last = num_stages - 1

    def has_comms(self, a: Action) -> bool:
        """A forward feeds the next stage, a B or I the previous one, across ranks."""
        if a.kind is ActionKind.F:
            return a.stage != self.last and self.rank[a.stage + 1] != self.rank[a.stage]
        if a.kind in _BACKWARDS:
            return a.stage != 0 and self.rank[a.stage - 1] != self.rank[a.stage]
        return False

    def pair(self, a: Action) -> tuple[Action, Action]:
        """The send this action posts (naming its own stage) and the peer's receive."""
        if a.kind is ActionKind.F:
            return Action(a.stage, ActionKind.SEND_F, a.mb), Action(
                a.stage + 1, ActionKind.RECV_F, a.mb
            )
        return Action(a.stage, ActionKind.SEND_B, a.mb), Action(
            a.stage - 1, ActionKind.RECV_B, a.mb
        )

    def ready(self, a: Action, done: set[Key]) -> bool:
        """Its input is here: received, or computed on this rank by the neighbour stage."""
        if a.kind is ActionKind.F and a.stage != 0:
            return (a.stage, ActionKind.RECV_F, a.mb) in done or (
                a.stage - 1,
                ActionKind.F,
                a.mb,
            ) in done
        if a.kind in _BACKWARDS and a.stage != self.last:
            return (
                (a.stage, ActionKind.RECV_B, a.mb) in done
                or (a.stage + 1, ActionKind.I, a.mb) in done
                or (a.stage + 1, ActionKind.B, a.mb) in done
            )
        return True


def add_send_recv(
    per_rank: Mapping[int, Sequence[Action]], stage_rank: Mapping[int, int], num_stages: int
) -> dict[int, list[Action]]:
    """Place every send and receive: in rounds over the ranks in order, each rank places its
    next action if its inputs are here, followed by the send it makes, and appends the
    matching receive to the peer's list at once. A round in which no rank can place its
    next action raises MalformedSchedule (torch: "Malformed compute schedule")."""
    comms = _Comms(stage_rank, num_stages)
    pending = {rank: list(reversed(actions)) for rank, actions in per_rank.items()}
    out: dict[int, list[Action]] = {rank: [] for rank in per_rank}
    done: dict[int, set[Key]] = {rank: set() for rank in per_rank}
    while pending:
        progress = False
        for rank in sorted(pending):
            if not pending[rank]:
                raise MalformedSchedule(f"rank {rank} has no actions", {})
            action = pending[rank][-1]
            if not all(comms.ready(a, done[rank]) for a in action.leaves()):
                continue
            out[rank].append(action)
            for leaf in action.leaves():
                done[rank].add(leaf.key)
                if comms.has_comms(leaf):
                    send, recv = comms.pair(leaf)
                    out[rank].append(send)
                    done[rank].add(send.key)
                    peer = stage_rank[recv.stage]
                    out[peer].append(recv)
                    done[peer].add(recv.key)
            pending[rank].pop()
            if not pending[rank]:
                del pending[rank]
            progress = True
        if not progress:
            stuck = {rank: queue[-1] for rank, queue in sorted(pending.items())}
            raise MalformedSchedule(
                "malformed compute schedule: no rank can place its next action", stuck
            )
    return out


# ---- deferred receives (torch's _defer_recv_ops, defer_pp_recv=True) -------------------------


def _recv_peer(a: Action, stage_rank: Mapping[int, int]) -> int:
    return stage_rank[a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage + 1]


def _send_peer(a: Action, stage_rank: Mapping[int, int]) -> int:
    return stage_rank[a.stage + 1 if a.kind is ActionKind.SEND_F else a.stage - 1]


_RECV_OF = {
    ActionKind.F: ActionKind.RECV_F,
    ActionKind.B: ActionKind.RECV_B,
    ActionKind.I: ActionKind.RECV_B,
}


def _defer_rank(
    rank: int, actions: Sequence[Action], stage_rank: Mapping[int, int]
) -> list[Action]:
    out: list[Action] = []
    deferred: dict[Key, Action] = {}  # in posting order; a repeated key keeps its place
    for action in actions:
        if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            deferred[action.key] = action
            continue
        if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            peer = _send_peer(action, stage_rank)
            if rank < peer:  # the lower rank receives from a peer before sending to it
                for key in [k for k, v in deferred.items() if _recv_peer(v, stage_rank) == peer]:
                    out.append(deferred.pop(key))
        for leaf in action.leaves():
            if leaf.kind in _RECV_OF:
                key = (leaf.stage, _RECV_OF[leaf.kind], leaf.mb)
                if key in deferred:
                    out.append(deferred.pop(key))
        out.append(action)
    if deferred:
        left = next(iter(deferred.values()))
        raise MalformedSchedule(
            f"malformed input schedule on rank {rank}: receive(s) "
            f"{', '.join(map(str, deferred.values()))} have no consumer",
            {rank: left},
        )
    return out


def defer_recvs(
    per_rank: Mapping[int, Sequence[Action]], stage_rank: Mapping[int, int]
) -> dict[int, list[Action]]:
    """Move each receive to just before the first compute that consumes it, except that a
    rank sending to a higher-ranked peer first posts the receives deferred from that peer
    (torch's rank-parity rule against pytorch#172668)."""
    return {rank: _defer_rank(rank, actions, stage_rank) for rank, actions in per_rank.items()}


# ---- the whole chain --------------------------------------------------------------------------


def add_fsdp_actions(actions: Sequence[Action | None], microbatches: int) -> list[Action]:
    """UNSHARD/RESHARD then REDUCE_GRAD, as torch adds them to one rank's compute order."""
    return add_reduce_grad(add_unshard_reshard(actions), microbatches)


def lower(
    per_rank: Sequence[Sequence[Action | None]],
    microbatches: int,
    stage_rank: Mapping[int, int],
    *,
    defer: bool = False,
) -> list[list[Action]]:
    """What `_PipelineScheduleRuntime` runs for this compute-only schedule (torch's
    `_prepare_schedule_with_comms`, after its validation); `defer` is `defer_pp_recv=True`.
    Raises MalformedSchedule where torch raises."""
    fsdp = {rank: add_fsdp_actions(actions, microbatches) for rank, actions in enumerate(per_rank)}
    lowered = add_send_recv(fsdp, stage_rank, len(stage_rank))
    if defer:
        lowered = defer_recvs(lowered, stage_rank)
    return [lowered[rank] for rank in range(len(per_rank))]


class StageOpSlots(NamedTuple):
    """Where torch puts one rank's UNSHARD/RESHARD/REDUCE_GRAD relative to its compute ops:
    `before[k]` and `after[k]` around the k-th compute action, `tail` after the last."""

    before: tuple[tuple[Action, ...], ...]
    after: tuple[tuple[Action, ...], ...]
    tail: tuple[Action, ...]


def stage_op_slots(actions: Sequence[Action], microbatches: int) -> StageOpSlots:
    """`add_fsdp_actions` of one rank's compute actions, as slots around each compute: a
    REDUCE_GRAD follows the backward that completes its stage, an UNSHARD or RESHARD
    precedes the compute it was added for."""
    before: list[tuple[Action, ...]] = []
    after: list[list[Action]] = []
    pending: list[Action] = []
    for action in add_fsdp_actions(actions, microbatches):
        if action.kind is ActionKind.REDUCE_GRAD and after:
            after[-1].append(action)
        elif action.kind.is_stage_op:
            pending.append(action)
        else:
            before.append(tuple(pending))
            after.append([])
            pending = []
    return StageOpSlots(tuple(before), tuple(map(tuple, after)), tuple(pending))
