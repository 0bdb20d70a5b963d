"""A runtime that failed: every rank of its pipeline told at once, every later call refused.

When anything goes wrong on one rank while the ranks are not in step (an exception in the
user's stage or loss, a pipecc error inside the program, a wait or collective that timed
out; not the errors an agreement raises on every rank alike, which leave the ranks in
step), the runtime's `Guard`:

1. remembers it (`Failed`: the step, the rank where it first happened, its message), so
   every later call of that runtime (`step`, `forward`, `clip_grad_norm_`, `global_loss`)
   raises `RuntimeFailed` at once instead of waiting for peers that went on or gave up;
2. leaves a notice in the job's key-value store (the first failure of the pipeline wins:
   one `compare_set`), so a rank told in (3) names the rank where it began;
3. closes, on gloo, this rank's connections in the pipeline's process groups: a receive
   nobody sends, waited for one millisecond. gloo closes a pair whose wait timed out and
   the peer's pending and later ops on it fail at once ("Connection closed by peer"), so
   a peer blocked in a wait or a collective fails within milliseconds, not after
   `RuntimeConfig.timeout`; it then fails its own runtime the same way, which reaches the
   ranks further along. (Measured on torch 2.13: `ProcessGroup.abort()`, `shutdown()` and
   `destroy_process_group` close nothing on gloo while the process lives.) On NCCL nothing
   is closed: a peer's wait is bounded by the process group's own timeout (its watchdog).

A failure costs nothing until it happens: the guard is a `try` around each call.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch
import torch.distributed as dist

from pipecc.diagnostics import PipeccError, RankError

from ..compat import default_store

FAILED_AT = "this runtime failed at step"  # how a runtime that failed begins to say so
TAG = 1_000_003  # the tag of the receive that closes a pair: no program's message has it
CLOSE_AFTER = timedelta(milliseconds=1)


class RuntimeFailed(RankError):
    """A call of a runtime that failed earlier (or whose peer failed): it must be rebuilt,
    in a new job, from a checkpoint."""


@dataclass(frozen=True)
class Failed:
    """Where a runtime failed first: the step, the pipeline rank, the first line of what
    was raised there."""

    step: int
    rank: int
    reason: str

    def message(self) -> str:
        return (
            f"{FAILED_AT} {self.step} on rank {self.rank} ({self.reason}); "
            "restart from a checkpoint"
        )


class Guard:
    """One runtime's failure memory and notice (module docstring). `groups`: the process
    groups this rank's peers may wait in (None: the world), closed on a failure when
    `close` (gloo)."""

    def __init__(
        self,
        rank: int,
        rank_map: Sequence[int],
        groups: Sequence[dist.ProcessGroup | None] = (),
        *,
        close: bool = False,
    ) -> None:
        self.rank = rank
        distinct = {id(g): g for g in (g or dist.group.WORLD for g in groups) if g is not None}
        self.groups = tuple(distinct.values())
        self.close = close
        self.key = _notice_key(rank_map) if groups else ""  # the pipeline's notice
        self.failed: Failed | None = None
        self._passing: BaseException | None = None  # raised on every rank alike

    def check(self) -> None:
        """Raise `RuntimeFailed` when this runtime failed before."""
        if self.failed is not None:
            raise RuntimeFailed(self.failed.message())

    def passing(self, err: BaseException) -> BaseException:
        """`err` is raised on every rank alike (an agreement's): it fails nothing."""
        self._passing = err
        return err

    @contextlib.contextmanager
    def guard(self, step: int) -> Iterator[None]:
        """Around a call: any exception but a passing one fails the runtime; a failure that
        began on another rank is raised as `RuntimeFailed` naming it."""
        try:
            yield
        except Exception as err:  # (a KeyboardInterrupt fails nothing: the job ends)
            passing, self._passing = self._passing, None
            if err is passing or self.failed is not None:
                raise
            origin = self.fail(step, err)
            if origin.rank != self.rank:  # what this rank saw, then where it began
                raise RuntimeFailed(f"{_first_line(err)}; {origin.message()}") from err
            raise

    def fail(self, step: int, err: BaseException) -> Failed:
        """Remember the failure, leave the notice (or read the first one), tell the peers."""
        mine = Failed(step, self.rank, _first_line(err))
        self.failed = self._published(mine)
        if self.close:
            close_pairs(self.groups)
        return self.failed

    def _published(self, mine: Failed) -> Failed:
        store = default_store()
        if store is None or not self.key:
            return mine
        text = json.dumps([mine.step, mine.rank, mine.reason])
        try:
            stored = store.compare_set(self.key, "", text).decode()
            step, rank, reason = json.loads(stored)
        except Exception:  # the store is gone (its host died): this rank's own account
            return mine
        return Failed(int(step), int(rank), str(reason))


class Guarded(Protocol):
    """A runtime whose public calls are guarded: its guard and its step counter."""

    guard: Guard
    steps: int


Runtime = TypeVar("Runtime", bound=Guarded)
Args = ParamSpec("Args")
Result = TypeVar("Result")
Method = Callable[Concatenate[Runtime, Args], Result]


def guarded(
    after: int,
) -> Callable[[Method[Runtime, Args, Result]], Method[Runtime, Args, Result]]:
    """A public call of a runtime: refused once the runtime failed; any failure in it fails
    the runtime and tells every rank. `after`: 0 for a call that runs step `steps`, 1 for one
    that reads the last step's results (the step a failure is said to be at)."""

    def decorate(method: Method[Runtime, Args, Result]) -> Method[Runtime, Args, Result]:
        @functools.wraps(method)
        def call(self: Runtime, /, *args: Args.args, **kwargs: Args.kwargs) -> Result:
            self.guard.check()
            with self.guard.guard(max(self.steps - after, 0)):
                return method(self, *args, **kwargs)

        return call

    return decorate


def _notice_key(rank_map: Sequence[int]) -> str:
    """The store key of this pipeline's failure notice, one per runtime: every rank of a
    pipeline builds its runtimes in the same order, so the n-th runtime of each rank has
    the same key (each rank counts its own in the store)."""
    ranks = "-".join(map(str, rank_map))
    store = default_store()
    serial = 0
    if store is not None:
        try:
            serial = store.add(f"pipecc/runtimes/{ranks}/{dist.get_rank()}", 1)
        except Exception:  # a store without counters: one notice for the pipeline
            serial = 0
    return f"pipecc/failed/{ranks}/{serial}"


def close_pairs(groups: Sequence[dist.ProcessGroup]) -> None:
    """Close this rank's gloo connections to every other member of `groups` (module
    docstring, 3)."""
    me = dist.get_rank()
    for group in groups:
        for peer in dist.get_process_group_ranks(group):
            if peer == me:
                continue
            try:
                work = dist.irecv(torch.empty(1), src=peer, group=group, tag=TAG)
                if work is not None:
                    work.wait(CLOSE_AFTER)
            except Exception:  # timed out (the pair is closed now) or closed already
                continue


def _first_line(err: BaseException) -> str:
    text = err.message if isinstance(err, PipeccError) else f"{type(err).__name__}: {err}"
    return text.split("\n")[0][:300]
