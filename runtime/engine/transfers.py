"""The program's sends, receives and waits on this rank, over a `Channel` (runtime/comm/channel.py).

A send takes its message's tensors out of the mailbox; a receive uses the buffers its step
was bound with (allocated once per signature, runtime/engine/bound.py). Both are queued until
their group ends, then posted together, each through the point-to-point ops its step keeps:
on NCCL every post, a lone op too, through one `batch_isend_irecv` (one communicator in
program order: runtime/comm/channel.py), on gloo op by op. A wait
completes the posted ops it names and drops each received message in the mailbox for the
instruction that consumes it. An instruction is named in text only when one fails.

What is posted and not yet waited belongs to the transfers: a `PostState`, fresh for each
step (`begin`), whose leftovers at the end of the step are a wrong program.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pipecc.diagnostics import ProgramError, RankError, RecvTimeoutError
from pipecc.ir.ops import Recv, Send
from pipecc.ir.printer import describe

from ..comm.channel import Channel, OpTimeout, Posted
from .context import StepContext, Tensors
from .steps import PostStep, WaitStep, where

_SENT = torch.empty(0)  # what a send's op holds between its posts


class Pending(NamedTuple):
    """A posted send or receive, until its `wait`: one handle per tensor of its message."""

    step: PostStep
    posted: tuple[Posted, ...]
    tensors: Tensors


class PostState:
    """One step's posts on this rank: the group being queued, the posted ops not yet waited
    (by instruction), and the async collectives over mesh dimensions (runtime/comm/mesh.py)
    whose works the `wait` that lists them completes."""

    __slots__ = ("pending", "queue", "reductions")

    def __init__(self) -> None:
        self.queue: list[tuple[PostStep, Tensors]] = []
        self.pending: dict[int, Pending] = {}
        self.reductions: dict[int, list[Any]] = {}

    def leftovers(self) -> list[str]:
        """Posted ops that no wait completed."""
        posted = sorted([*self.pending, *self.reductions])
        return [f"posted ops never waited: instructions {posted}"] if posted else []


class Transfers:
    """Posting and completing this rank's comm instructions."""

    def __init__(self, channel: Channel, device: torch.device, timeout: float) -> None:
        self.channel = channel
        self.device = device
        self.timeout = timeout
        self.posts = PostState()  # the step's (`begin`)

    def begin(self) -> None:
        """A new step: nothing posted yet."""
        self.posts = PostState()

    def hold(self, index: int, works: list[Any]) -> None:
        """An async collective's works, completed by the `wait` that lists `index`."""
        self.posts.reductions[index] = works

    def post(self, ctx: StepContext, step: PostStep) -> None:
        """Queue a send or receive (the interpreter commits the group at its end)."""
        if step.send:
            tensors = ctx.mail.take(step.slot)
            tensors = tuple(t if t.is_contiguous() else t.contiguous() for t in tensors)
            if len(step.ops) != len(tensors):  # made once, then given each step's tensors
                step.ops = [self.channel.p2p(True, t, step.peer) for t in tensors]
        elif step.buffers is None:
            raise ProgramError("no boundary says what this message holds")
        else:
            tensors = step.buffers
        self.posts.queue.append((step, tensors))

    def commit(self) -> None:
        """Post the queued ops: one op, or a group together (the channel says how)."""
        queue = self.posts.queue
        ops: list[dist.P2POp] = []
        for step, tensors in queue:
            if step.send:
                for op, tensor in zip(step.ops, tensors, strict=True):
                    op.tensor = tensor  # its last post completed: the step's wait came first
            ops.extend(step.ops)
        try:
            handles = self.channel.post(ops)
        except RuntimeError as err:  # the backend refused (a closed connection): not user code
            queue.clear()
            raise RankError(f"posting failed: {_short(str(err))}") from err
        first = 0  # each queued op's tensors are a contiguous run of `ops`
        for step, tensors in queue:
            mine = tuple(handles[first : first + len(tensors)])
            self.posts.pending[step.index] = Pending(step, mine, tensors)
            first += len(tensors)
        queue.clear()

    def wait(self, ctx: StepContext, step: WaitStep, rank: int) -> tuple[list[Send | Recv], float]:
        """Complete the ops of `step`; the ops waited for and when the last completed.
        `rank` names the instruction in errors."""
        released = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        waited: list[Send | Recv] = []
        for op_index in step.ops:
            works = self.posts.reductions.pop(op_index, None)
            if works is not None:  # a reduction over mesh dimensions: in place, no mail
                for work in works:
                    work.wait()
                released = time.perf_counter()
                continue
            pending = self.posts.pending.pop(op_index, None)
            if pending is None:
                raise ProgramError(f"instruction {op_index} is not a posted, unwaited op")
            for posted in pending.posted:
                try:
                    self.channel.complete(posted, deadline)
                except Exception as err:
                    named = where(rank, ctx.step, step.index, step.instr)
                    raise self._failure(named, op_index, pending, err) from err
            released = time.perf_counter()
            done = pending.step
            waited.append(done.comm)
            if done.send:
                for op in done.ops:  # the step's tensors are not kept alive by its ops
                    op.tensor = _SENT
            else:
                ctx.mail[done.slot] = pending.tensors
        return waited, released

    def _failure(self, where: str, op_index: int, pending: Pending, err: Exception) -> RankError:
        what = f"{describe(pending.step.instr)} (instruction {op_index})"
        if isinstance(err, OpTimeout):
            return RecvTimeoutError(f"{where}: {what} did not complete within {self.timeout:g} s")
        return RankError(f"{where}: {what} failed: {_short(str(err))}")


def _short(text: str) -> str:
    """A backend's error without its source location and advice (gloo's are long)."""
    text = text.split("\n")[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]
