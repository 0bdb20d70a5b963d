"""NCCL's point-to-point matching, emulated over gloo for the CPU tests (test_nccl_emulation.py).

NCCL started without `device_id` makes its communicators lazily: a `batch_isend_irecv`
(the ops posted between the group's `_start_coalescing` and `_end_coalescing`) runs on the
process group's communicator, a lone `send`/`recv` on a 2-rank communicator of its pair.
Each communicator has one stream, so its ops match first in, first out per pair, and a
message posted on one communicator is never received on another. `nccl_lazy()` makes the
world's gloo group match that way: it says it coalesces (so runtime/comm/channel.py posts
as it does on NCCL), an op posted inside a coalescing block goes out on the group itself,
in order, at the block's end, one work completing the block (posting_cases.coalescing); a
lone op goes out on a second gloo group of the same ranks, made when the context opens
(gloo matches per pair in order, as the pair communicators do). A message grouped on one
side and lone on the other then never matches: its receive waits on the other group until
the timeout, or takes the pair's next message there (the wrong tensor).

What it leaves out: NCCL runs a communicator's ops one after another on its stream, while
gloo progresses each op on its own. Which programs deadlock on one stream is the verifier's
`nccl-single` replay (docs/verify.md), not this emulation's. Functions here run in the
spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from posting_cases import Coalesced, coalescing
from runtime_cases import Case, run_cases

WAIT = timedelta(seconds=60)


@contextmanager
def nccl_lazy() -> Iterator[Coalesced]:
    """The world group matches as NCCL's lazy communicators do (module docstring), while
    the context is open. Every rank opens it together (it makes a gloo group)."""
    world = dist.group.WORLD
    assert world is not None
    pairs = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    with coalescing({id(world): pairs}) as seen:
        yield seen


def crossing_case(rank: int, grouped_alone: bool) -> list[float]:
    """Rank 0 sends 10s then 20s to rank 1, the first in a batch of one and the second
    alone, while rank 1 receives the first alone and the second in a batch
    (`grouped_alone`); or every post a batch, as the runtime posts on NCCL. What rank 1
    received, in the order of its receives (the other ranks: nothing)."""
    if rank > 1:
        return []
    if rank == 0:
        op, first, second = dist.isend, torch.full((3,), 10.0), torch.full((3,), 20.0)
        alone = (False, grouped_alone)
    else:
        op, first, second = dist.irecv, torch.zeros(3), torch.zeros(3)
        alone = (grouped_alone, False)
    peer = 1 - rank
    works = [*_post(op, first, peer, alone[0]), *_post(op, second, peer, alone[1])]
    for work in works:
        if work is not None:
            work.wait(WAIT)
    return [] if rank == 0 else [float(first[0]), float(second[0])]


def _post(op: Any, tensor: torch.Tensor, peer: int, alone: bool) -> list[Any]:
    if alone:
        return [op(tensor, peer)]
    return list(dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]))


def run_emulated(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    """Under `nccl_lazy`: the crossing messages both ways, then each case; for each case,
    how many point-to-point ops went out in coalesced groups."""
    results: dict[str, Any] = {"cases": {}, "coalesced": {}}
    with nccl_lazy() as seen:
        results["crossing"] = crossing_case(rank, grouped_alone=True)
        results["batched"] = crossing_case(rank, grouped_alone=False)
        for case in cases:
            groups = len(seen.groups)
            results["cases"].update(run_cases(rank, world, [case]))
            results["coalesced"][case.name] = sum(seen.groups[groups:])
    return results
