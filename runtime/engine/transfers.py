"""The program's sends, receives and waits on this rank, over a `Channel` (runtime/comm/channel.py).

A send takes its message's tensors out of the mailbox; a receive uses the buffers its step
was bound with (allocated once per signature, runtime/engine/bound.py). Both are queued until
their group ends, then posted together, each through the point-to-point ops its step keeps:
on NCCL every post, a lone op too, through one `batch_isend_irecv` (one communicator in
program order: runtime/comm/channel.py), on gloo op by op. A wait
completes the posted ops it names and drops each received message in the mailbox for the
instruction that consumes it. An instruction is named in text only when one fails.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pipecc.diagnostics import ProgramError, RankError, RecvTimeoutError
from pipecc.ir.ops import Msg, Recv, Send
from pipecc.ir.printer import describe

from ..boundaries.specs import Specs
from ..comm.channel import Channel, OpTimeout
from .compute import take
from .context import Pending, StepContext
from .steps import PostStep, WaitStep, where

_SENT = torch.empty(0)  # what a send's op holds between its posts


class Transfers:
    """Posting and completing this rank's comm instructions."""

    def __init__(
        self,
        channel: Channel,
        specs: dict[tuple[Msg, int, int], Specs],
        device: torch.device,
        timeout: float,
    ) -> None:
        self.channel = channel
        self.specs = specs  # the receive specs of the signature in use (what its buffers hold)
        self.device = device
        self.timeout = timeout

    def post(self, ctx: StepContext, step: PostStep) -> None:
        """Queue a send or receive (the interpreter commits the group at its end)."""
        if step.send:
            tensors = take(ctx, step.slot)
            tensors = tuple(t if t.is_contiguous() else t.contiguous() for t in tensors)
            if len(step.ops) != len(tensors):  # made once, then given each step's tensors
                step.ops = [self.channel.p2p(True, t, step.peer) for t in tensors]
        elif step.buffers is None:
            raise ProgramError("no boundary says what this message holds")
        else:
            tensors = step.buffers
        ctx.queue.append((step, tensors))

    def commit(self, ctx: StepContext) -> None:
        """Post the queued ops: one op, or a group together (the channel says how)."""
        ops: list[dist.P2POp] = []
        for step, tensors in ctx.queue:
            if step.send:
                for op, tensor in zip(step.ops, tensors, strict=True):
                    op.tensor = tensor  # its last post completed: the step's wait came first
            ops.extend(step.ops)
        try:
            handles = self.channel.post(ops)
        except RuntimeError as err:  # the backend refused (a closed connection): not user code
            ctx.queue.clear()
            raise RankError(f"posting failed: {_short(str(err))}") from err
        first = 0  # each queued op's tensors are a contiguous run of `ops`
        for step, tensors in ctx.queue:
            mine = tuple(handles[first : first + len(tensors)])
            ctx.pending[step.index] = Pending(step, mine, tensors)
            first += len(tensors)
        ctx.queue.clear()

    def wait(self, ctx: StepContext, step: WaitStep, rank: int) -> tuple[list[Send | Recv], float]:
        """Complete the ops of `step`; the ops waited for and when the last completed.
        `rank` names the instruction in errors."""
        released = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        waited: list[Send | Recv] = []
        for op_index in step.ops:
            works = ctx.reductions.pop(op_index, None)
            if works is not None:  # a reduction over mesh dimensions: in place, no mail
                for work in works:
                    work.wait()
                released = time.perf_counter()
                continue
            pending = ctx.pending.pop(op_index, None)
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
