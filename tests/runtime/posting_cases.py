"""The posting paths gloo does not take by itself, for the CPU tests (test_posting.py).

`coalescing()` makes every gloo process group of this process coalesce as NCCL does: its
backend says `supports_coalescing`, so runtime/comm/channel.py sends a group through torch's
`batch_isend_irecv`, which then takes its coalescing branch; the group's ops are queued
between `_start_coalescing` and `_end_coalescing`, posted at the end in order, and one work
completes the whole group (what NCCL returns). A gloo work waited twice never returns, so the
group's work completes its ops once and is then done. Functions here run in the spawned
processes: keep them importable and picklable.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pipecc.runtime.comm import channel as comm
from runtime_cases import Case, run_cases

Post = Callable[..., Any]


class GroupWork(dist.Work):
    """One work for a coalesced group: waits for each of its ops' works, once."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works
        self.done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done:
            for work in self.works:
                work.wait() if timeout is None else work.wait(timeout)
            self.done = True
        return True


@dataclass
class Coalesced:
    """What the coalescing groups saw: ops per coalesced group."""

    groups: list[int] = field(default_factory=list)
    queued: dict[int, list[tuple[Post, tuple[Any, ...]]]] = field(default_factory=dict)


@contextmanager
def coalescing(lone: Mapping[int, dist.ProcessGroup] | None = None) -> Iterator[Coalesced]:
    """Gloo groups that coalesce, as NCCL's do, while the context is open. With `lone`, an
    op posted outside a coalesced group on group `pg` goes out on `lone[id(pg)]` instead
    (nccl_emulation.py: NCCL's lazy pair communicators)."""
    seen = Coalesced()
    gloo, group = dist.ProcessGroupGloo, dist.ProcessGroup
    send, recv = group.send, group.recv

    def start(pg: dist.ProcessGroup, device: torch.device) -> None:
        seen.queued[id(pg)] = []

    def end(pg: dist.ProcessGroup, device: torch.device) -> dist.Work:
        queued = seen.queued.pop(id(pg))
        seen.groups.append(len(queued))
        return GroupWork([post(pg, *args) for post, args in queued])

    def deferred(post: Post) -> Post:
        def call(pg: dist.ProcessGroup, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
            if id(pg) in seen.queued:
                seen.queued[id(pg)].append((post, (tensors, peer, tag)))
                return None
            return post(pg if lone is None else lone[id(pg)], tensors, peer, tag)

        return call

    saved = {
        (gloo, "supports_coalescing"): gloo.supports_coalescing,
        (group, "_start_coalescing"): group._start_coalescing,
        (group, "_end_coalescing"): group._end_coalescing,
        (group, "send"): send,
        (group, "recv"): recv,
    }
    setattr(gloo, "supports_coalescing", property(lambda self: True))  # noqa: B010
    setattr(group, "_start_coalescing", start)  # noqa: B010
    setattr(group, "_end_coalescing", end)  # noqa: B010
    setattr(group, "send", deferred(send))  # noqa: B010
    setattr(group, "recv", deferred(recv))  # noqa: B010
    try:
        yield seen
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def exchange_case(rank: int, world: int) -> dict[str, Any]:
    """A group of two sends and two receives of different shapes and dtypes through the
    coalesced branch: what arrived, and the works `_post_now` handed back per op."""
    peer = 1 - rank
    channel = comm.Channel(None, range(world), timeout=30.0, nccl=False)
    outgoing = (torch.arange(6.0).reshape(2, 3) + 10 * rank, torch.tensor([rank, 7, 8]))
    incoming = (torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64))
    ops = []
    for sent, received in zip(outgoing, incoming, strict=True):
        ops += [channel.p2p(True, sent, peer), channel.p2p(False, received, peer)]
    works = comm._post_now(ops, True)
    for posted in works:
        for work in posted:
            work.wait(timedelta(seconds=30))
    return {
        "received": [t.clone() for t in incoming],
        "shared": all(w == works[0] for w in works) and len(works[0]) == 1,
        "ops": len(ops),
    }


def directions_case(rank: int, world: int) -> dict[str, Any]:
    """Gloo's two groups, one per direction: which group each op takes, whether a second
    channel of the same pipeline reuses them, and what arrives when both ranks send each
    other many messages at once (each direction's messages in their order)."""
    peer = 1 - rank
    channel = comm.Channel(None, range(world), timeout=30.0, nccl=False)
    again = comm.Channel(None, range(world), timeout=30.0, nccl=False)
    world_group = dist.group.WORLD
    count = 12
    sent = [torch.full((3,), 100.0 * rank + i) for i in range(count)]
    received = [torch.zeros(3) for _ in range(count)]
    ops = []
    for i in range(count):  # a receive and a send of each message, both ways at once
        ops += [channel.p2p(False, received[i], peer), channel.p2p(True, sent[i], peer)]
    for works in comm._post_now(ops, False):
        for work in works:
            work.wait(timedelta(seconds=30))
    single = comm.Channel(None, range(world), timeout=30.0, nccl=False, direction_groups=False)
    return {
        "distinct": channel.downward is not None and channel.downward is not world_group,
        "send_down": ops[1].group is channel.downward,
        "recv_down": ops[0].group is channel.downward,
        "reused": again.downward is channel.downward,
        "received": [t[0].item() for t in received],
        "single": single.downward is single.group,
        # the cache holds the world it was made for weakly, and is emptied at exit
        "weak": isinstance(comm._DOWNWARD[tuple(range(world))][0], weakref.ref),
    }


@contextmanager
def posting_threads() -> Iterator[set[str]]:
    """The names of the threads that posted (runtime/comm/channel.py's `_post_now`) meanwhile."""
    names: set[str] = set()
    post_now = comm._post_now

    def recorded(ops: list[dist.P2POp], coalesced: bool) -> list[list[dist.Work]]:
        names.add(threading.current_thread().name.split("_")[0])
        return post_now(ops, coalesced)

    setattr(comm, "_post_now", recorded)  # noqa: B010
    try:
        yield names
    finally:
        setattr(comm, "_post_now", post_now)  # noqa: B010


def run_posting(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    """The cases through the poster thread (`gloo_poster_thread`), then the exchange and
    the cases again over coalescing gloo groups (posting in place, the default); which
    threads posted in each."""
    directions = directions_case(rank, world)
    with posting_threads() as threaded_posters:
        threaded = run_cases(rank, world, [replace(c, poster_thread=True) for c in cases])
    with coalescing() as seen:
        exchange = exchange_case(rank, world)
        exchange_groups = list(seen.groups)
        with posting_threads() as coalesced_posters:
            coalesced = run_cases(rank, world, cases)
    return {
        "directions": directions,
        "threaded": threaded,
        "threaded_posters": threaded_posters,
        "exchange": exchange,
        "exchange_groups": exchange_groups,
        "coalesced": coalesced,
        "coalesced_groups": seen.groups[len(exchange_groups) :],
        "coalesced_posters": coalesced_posters,
    }
