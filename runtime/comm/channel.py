"""Point-to-point traffic of one pipeline: posting, completing, and the duplicated-stage sum.

Program ranks (0..P-1) are mapped to global ranks of the process group, so one pipeline can
live inside a larger world (pipeline × data parallel). Where the backend coalesces (NCCL)
every post goes out through `batch_isend_irecv`, a single op too, as torch's own schedules
post: NCCL initialised lazily (no `device_id`) runs a coalesced batch on the process group's
communicator but a lone `isend`/`irecv` on a 2-rank communicator of its own, and a message
posted on one communicator never matches a receive posted on another. Through
`batch_isend_irecv` every op of the pipeline goes through the group's one communicator in
program order, lazy and eager initialisation alike, which is what `nccl-single` models and
what `pipecc verify --backend nccl` proves (docs/verify.md). A batch may return one work for
the whole group, shared by its ops. On gloo, which does not coalesce, each op goes to the
process group directly, one work per op, and every one of them is waited (pytorch#152938).

Posting happens in the calling thread by default, as torch's own schedules post: on NCCL a
post only enqueues work on a CUDA stream; on gloo a send to a peer whose receive gloo has
already been told about writes the data then and there, anything else sends gloo a notice
and returns. `poster_thread` (the runtime's `gloo_poster_thread`; `PIPECC_POST_THREAD=1` for
`pipecc run`) hands every gloo post to one poster thread instead, in program order (a FIFO
of one worker keeps the order the program was verified with), and the compute thread goes
on; a `wait` first waits for its post to have happened. Why posting in place is the
default: docs/performance.md, "Host overhead". The tests run the gloo suite's schedules both
ways (docs/runtime.md).

One gloo group per direction: gloo connects each pair of ranks of a group by one socket, and
when the two ranks of a pair send to each other at the same moment (every exchange of a
symmetric schedule such as DualPipeV at P=2) one of the sends now and then stalls for
milliseconds (docs/performance.md#one-gloo-group-per-direction). So on gloo a pipeline's
messages to a higher rank go over its own group and those to a lower rank over a second
group of the same ranks (`downward_group`), made once per pipeline and process when the
first runtime is built: each socket then carries data one way. Messages between two ranks
in one direction still go over one group, in program order, so which message matches which
receive is exactly as verified. (Not where the backend coalesces, as NCCL does: every op
goes through the one group.) `direction_groups=False` (the runtime's
`gloo_direction_groups`; `PIPECC_GLOO_DIRECTIONS=0` for `pipecc run`) keeps one group for
both directions.

Completing a work: on gloo, `wait(timeout)` blocks the host and raises when the peer has not
matched in time (or has died: gloo reports the closed connection); gloo raises a
RuntimeError either way, so a failure after the deadline becomes an `OpTimeout`, a
`TimeoutError`, which the transfers recognise by its type. On NCCL, `wait()` only
orders the current CUDA stream after the transfer and returns at once, so the host never
blocks in the hot loop; a transfer that never completes is then caught by NCCL's watchdog,
after the process group's timeout.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pipecc.diagnostics import SetupError

from ..compat import group_coalesces, post_p2p

Work = dist.Work
CLOCK_SLACK = 0.01  # seconds: gloo counts a wait's timeout in whole milliseconds


class Posted:
    """One posted op: the works that complete it, once its post has happened."""

    __slots__ = ("_group", "_index", "_works")

    def __init__(
        self, works: list[Work] | None = None, group: Group | None = None, index: int = 0
    ) -> None:
        self._works = works
        self._group = group
        self._index = index

    def works(self, timeout: float) -> list[Work]:
        if self._works is None:
            assert self._group is not None
            posted = self._group.result(timeout)
            # taken out of the group's result: a received buffer is then held by this op
            # alone, and freed once it is consumed, not when the group's last op is
            self._works, posted[self._index] = posted[self._index], []
            self._group = None
        return self._works


class Group:
    """A group of ops handed to the poster thread: posted there, in submission order; its
    result (each op's works, or the error posting raised) read by the ops' waits.

    Done is a lock held from creation until the post has happened, the cheapest thing a
    waiting thread can block on (a `concurrent.futures.Future` costs several times more
    host time per group, on the instruction path of every send)."""

    __slots__ = ("_coalesced", "_done", "_error", "_ops", "_posted")

    def __init__(self, ops: list[dist.P2POp], coalesced: bool) -> None:
        self._ops: list[dist.P2POp] | None = ops
        self._coalesced = coalesced
        self._posted: list[list[Work]] | None = None
        self._error: BaseException | None = None
        self._done = threading.Lock()
        self._done.acquire()

    def post(self) -> None:
        """In the poster thread: post the ops now."""
        try:
            assert self._ops is not None
            self._posted = _post_now(self._ops, self._coalesced)
        except BaseException as err:  # raised in the thread that waits for the group
            self._error = err
        finally:
            self._ops = None
            self._done.release()

    def result(self, timeout: float) -> list[list[Work]]:
        """Each op's works, once posted; the error posting raised; or `OpTimeout` when the
        post has not happened within `timeout` seconds."""
        if self._posted is None and self._error is None:
            if not self._done.acquire(timeout=timeout):
                raise OpTimeout("the op was not posted before its deadline")
            self._done.release()  # the group's other ops pass at once
        if self._error is not None:
            raise self._error
        assert self._posted is not None
        return self._posted


class Poster:
    """One thread that posts the groups submitted to it, one after the other, in the order
    submitted (a FIFO of one worker keeps the order the program was verified with). Started
    at the first submission; stopped when its channel is collected."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Group | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, ops: list[dist.P2POp], coalesced: bool) -> Group:
        group = Group(ops, coalesced)
        if self._thread is None:
            self._thread = threading.Thread(
                target=_serve, args=(self._queue,), name="pipecc-post", daemon=True
            )
            self._thread.start()
        self._queue.put(group)
        return group

    def shutdown(self) -> None:
        self._queue.put(None)


def _serve(groups: queue.SimpleQueue[Group | None]) -> None:
    """The poster thread's loop (it holds the queue only, not the channel)."""
    while (group := groups.get()) is not None:
        group.post()


class OpTimeout(TimeoutError):
    """A posted op that did not complete (or was not posted) by its deadline. Gloo reports a
    timed-out wait as a plain RuntimeError, so the deadline having passed is what says it."""


class Channel:
    """P2P between the ranks of one pipeline. `poster_thread`: post gloo's ops from one
    poster thread; `direction_groups`: a second gloo group for the messages to a lower rank
    (module docstring; the runtime's `gloo_poster_thread` and `gloo_direction_groups`)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank_map: Sequence[int],
        *,
        timeout: float,
        nccl: bool,
        poster_thread: bool = False,
        direction_groups: bool = True,
    ) -> None:
        self.group = group
        self.rank_map = tuple(rank_map)
        self.timeout = timeout
        self.blocking = not nccl
        # every post through `batch_isend_irecv` where the backend coalesces: NCCL, or a
        # test backend that coalesces on gloo (tests/runtime/posting_cases.py)
        self.coalesced = nccl or group_coalesces(group, torch.device("cpu"))
        self._poster: Poster | None = None
        if self.blocking and poster_thread:
            self._poster = Poster()
            weakref.finalize(self, self._poster.shutdown)
        self.downward = group  # the group of messages to a lower rank (module docstring)
        if self.blocking and len(self.rank_map) > 1 and direction_groups and not self.coalesced:
            self.downward = downward_group(group, self.rank_map, timeout)

    def p2p(self, send: bool, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        """The op that sends `tensor` to program rank `peer`, or receives it from there: over
        the pipeline's group when the message goes to a higher rank, over `downward` when it
        goes to a lower one (both ends choose alike)."""
        op = dist.isend if send else dist.irecv
        other = self.rank_map[peer]
        me = dist.get_rank()
        upward = me < other if send else other < me
        return dist.P2POp(op, tensor, other, self.group if upward else self.downward)

    def post(self, ops: Sequence[dist.P2POp]) -> list[Posted]:
        """Post `ops`, one group of the program (or one op), in order; one handle per op:
        where the backend coalesces, through one `batch_isend_irecv` (module docstring)."""
        if not ops:
            return []
        if self._poster is None:
            return [Posted(works) for works in _post_now(list(ops), self.coalesced)]
        group = self._poster.submit(list(ops), self.coalesced)  # in order
        return [Posted(group=group, index=i) for i in range(len(ops))]

    def complete(self, posted: Posted, deadline: float) -> None:
        """Wait for one posted op until `deadline` (a `time.monotonic()` value)."""
        for work in posted.works(max(deadline - time.monotonic(), 0.001)):
            if self.blocking:
                try:
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                except RuntimeError as err:
                    if time.monotonic() >= deadline - CLOCK_SLACK:
                        raise OpTimeout(str(err)) from err
                    raise  # the peer failed (closed, reset) before the deadline
            else:
                work.wait()

    def exchange(
        self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor]
    ) -> None:
        """Send `outgoing[peer]` to each peer while receiving `incoming[peer]`, one batch."""
        ops = []
        for peer in sorted(outgoing):
            ops.append(self.p2p(True, outgoing[peer], peer))
            ops.append(self.p2p(False, incoming[peer], peer))
        deadline = time.monotonic() + self.timeout
        for posted in self.post(ops):
            self.complete(posted, deadline)


def uses_nccl(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether the pipeline's tensors, on `device`, go over NCCL in `group`. A group made
    without naming a backend serves CUDA tensors with NCCL and CPU tensors with gloo
    (`get_backend` then says "undefined"; its config says "cpu:gloo,cuda:nccl")."""
    return device.type == "cuda" and "nccl" in dist.get_backend_config(group)


# per pipeline (its global ranks): the group it was made for (weakly: the cache must not
# keep a destroyed world alive) and its downward group. Emptied when the interpreter exits,
# before its teardown: a gloo group freed during the teardown can abort the process
# ("terminate called without an active exception", 3 exits in 10 under load).
_DOWNWARD: dict[tuple[int, ...], tuple[weakref.ref[dist.ProcessGroup], dist.ProcessGroup]] = {}
atexit.register(_DOWNWARD.clear)


def downward_group(
    group: dist.ProcessGroup | None, rank_map: Sequence[int], timeout: float
) -> dist.ProcessGroup:
    """A second gloo group of the pipeline's ranks, for its messages to a lower rank: made
    on the pipeline's ranks only (`use_local_synchronization`: other pipelines of a larger
    world take no part), the first time a runtime of this pipeline is built in this process,
    and kept while the group it was made for lives (a new world makes it again) until the
    interpreter exits. Every rank of the pipeline builds its runtimes in the same order, so
    they make it together."""
    parent = group if group is not None else dist.group.WORLD
    key = tuple(rank_map)
    kept = _DOWNWARD.get(key)
    if kept is not None and kept[0]() is parent:
        return kept[1]
    try:
        made = dist.new_group(
            sorted(key),
            timeout=timedelta(seconds=timeout),
            backend="gloo",
            use_local_synchronization=True,
            group_desc="pipecc pipeline, to lower ranks",
        )
    except Exception as err:  # e.g. a rank of the pipeline never built its runtime
        raise SetupError(
            f"rank {dist.get_rank()}: could not make the pipeline's second gloo group (ranks "
            f"{list(key)}; gloo_direction_groups=False does without it): "
            f"{type(err).__name__}: {err}"
        ) from err
    assert isinstance(made, dist.ProcessGroup) and parent is not None  # a world exists
    _DOWNWARD[key] = (weakref.ref(parent), made)
    return made


def _post_now(ops: list[dist.P2POp], coalesced: bool) -> list[list[Work]]:
    """Post `ops` now; for each op, the works that complete it. Where the backend coalesces
    (NCCL) they go through `batch_isend_irecv`, one op alone too, so every op is on the
    process group's communicator (module docstring). Elsewhere (gloo) that would post the
    ops one by one anyway, so each goes to its process group directly, without the argument
    checks of `isend`/`irecv` (the ops come from a verified program): on gloo this Python
    may run in the poster thread, holding the interpreter lock that the compute thread needs
    (measured: docs/performance.md, "What made the difference")."""
    if not coalesced:
        return [_single(op) for op in ops]
    works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
    if len(works) == len(ops):
        return [[w] for w in works]
    return [works for _ in ops]


def _single(op: dist.P2POp) -> list[Work]:
    """One op on its process group (`P2POp` resolved the group and the peer's rank in it);
    a tensor subclass goes through `isend`/`irecv`, which dispatch on it."""
    if type(op.tensor) is not torch.Tensor:
        work = op.op(op.tensor, op.peer, group=op.group, tag=op.tag)
    else:
        tensor = torch.view_as_real(op.tensor) if op.tensor.is_complex() else op.tensor
        work = post_p2p(op, tensor)
    return [work] if work is not None else []
