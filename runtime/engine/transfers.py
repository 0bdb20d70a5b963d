"""The program's sends, receives and waits on this rank, over a `Channel` (runtime/comm/channel.py).

A send takes its message's tensors out of the mailbox; a receive allocates its buffers from
the boundary specs. Both are queued until their group ends, then posted together
(`batch_isend_irecv` for a group, alone otherwise). A wait completes the posted ops it names
and drops each received message in the mailbox for the instruction that consumes it.
"""

from __future__ import annotations

import time

import torch

from pipecc.diagnostics import ProgramError, RankError, RecvTimeoutError
from pipecc.ir.keys import carried
from pipecc.ir.ops import Msg, Recv, Send, Wait
from pipecc.ir.printer import describe

from ..boundaries.specs import Specs
from ..comm.channel import Channel, OpTimeout
from .compute import take
from .context import Pending, StepContext


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
        self.specs = specs
        self.device = device
        self.timeout = timeout

    def post(self, ctx: StepContext, index: int, instr: Send | Recv, commit: bool) -> None:
        """Queue a send or receive; at the end of its group, post the group. The first
        post of a step first completes the step's shape gather
        (runtime/boundaries/signatures.py)."""
        ctx.settle()
        if type(instr) is Send:
            tensors = take(ctx, carried(instr))
            tensors = tuple(t if t.is_contiguous() else t.contiguous() for t in tensors)
        else:
            specs = self.specs[(instr.what, instr.pipe, instr.stage)]
            tensors = tuple(torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs)
        ctx.queue.append((index, instr, tensors))
        if commit:
            self.commit(ctx)

    def commit(self, ctx: StepContext) -> None:
        """Post the queued ops: one op alone, a group together (`batch_isend_irecv`)."""
        ops = [
            self.channel.p2p(type(instr) is Send, tensor, instr.peer)
            for _, instr, tensors in ctx.queue
            for tensor in tensors
        ]
        handles = self.channel.post(ops, batched=ctx.queue[0][1].group is not None)
        first = 0  # each queued op's tensors are a contiguous run of `ops`
        for index, instr, tensors in ctx.queue:
            mine = tuple(handles[first : first + len(tensors)])
            ctx.pending[index] = Pending(instr, mine, tensors)
            first += len(tensors)
        ctx.queue.clear()

    def wait(self, ctx: StepContext, where: str, instr: Wait) -> tuple[list[Send | Recv], float]:
        """Complete the ops of `instr`; the ops waited for and when the last completed.
        `where` names the instruction in errors."""
        released = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        waited: list[Send | Recv] = []
        for op_index in instr.ops:
            pending = ctx.pending.pop(op_index, None)
            if pending is None:
                raise ProgramError(f"instruction {op_index} is not a posted, unwaited op")
            for posted in pending.posted:
                try:
                    self.channel.complete(posted, deadline)
                except Exception as err:
                    raise self._failure(where, op_index, pending, err) from err
            released = time.perf_counter()
            waited.append(pending.instr)
            if type(pending.instr) is Recv:
                ctx.mail[carried(pending.instr)] = pending.tensors
        return waited, released

    def _failure(self, where: str, op_index: int, pending: Pending, err: Exception) -> RankError:
        what = f"{describe(pending.instr)} (instruction {op_index})"
        if isinstance(err, OpTimeout):
            return RecvTimeoutError(f"{where}: {what} did not complete within {self.timeout:g} s")
        return RankError(f"{where}: {what} failed: {_short(str(err))}")


def _short(text: str) -> str:
    """A backend's error without its source location and advice (gloo's are long)."""
    text = text.split("\n")[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]
