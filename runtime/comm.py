"""Point-to-point traffic of one pipeline: posting, completing, and the duplicated-stage sum.

Program ranks (0..P-1) are mapped to global ranks of the process group, so one pipeline can
live inside a larger world (pipeline × data parallel). A group of posts goes out through
`batch_isend_irecv`; on gloo it returns one work per op and every one of them is waited
(pytorch#152938), on NCCL it may return one work for the whole group, shared by its ops.

Completing a work: on gloo, `wait(timeout)` blocks the host and raises when the peer has not
matched in time (or has died: gloo reports the closed connection). On NCCL, `wait()` only
orders the current CUDA stream after the transfer and returns at once, so the host never
blocks in the hot loop; a transfer that never completes is then caught by NCCL's watchdog,
after the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

Work = dist.Work


class Channel:
    """P2P between the ranks of one pipeline."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank_map: Sequence[int],
        *,
        timeout: float,
    ) -> None:
        self.group = group
        self.rank_map = tuple(rank_map)
        self.timeout = timeout
        self.blocking = dist.get_backend(group) != "nccl"

    def p2p(self, send: bool, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        op = dist.isend if send else dist.irecv
        return dist.P2POp(op, tensor, self.rank_map[peer], self.group)

    def post(self, ops: Sequence[dist.P2POp], *, batched: bool) -> list[list[Work]]:
        """Post `ops`; for each op, the works that complete it."""
        if not ops:
            return []
        if not batched and len(ops) == 1:
            op = ops[0]
            work = op.op(op.tensor, op.peer, group=self.group)
            return [[work]] if work is not None else [[]]
        works = [w for w in dist.batch_isend_irecv(list(ops)) if w is not None]
        if len(works) == len(ops):
            return [[w] for w in works]
        return [works for _ in ops]

    def wait(self, work: Work, deadline: float, now: float) -> None:
        """Complete one work before `deadline` (a `time.monotonic()` value)."""
        if self.blocking:
            work.wait(timedelta(seconds=max(deadline - now, 0.001)))
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
        now = 0.0
        for works in self.post(ops, batched=True):
            for work in works:
                self.wait(work, self.timeout, now)
