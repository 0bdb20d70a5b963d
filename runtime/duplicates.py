"""Summing the gradients of a stage held twice (DualPipe: stage s on ranks s and P-1-s).

With two pipes over the same stages, stage s of each pipe is the same model stage; each copy
saw only its pipe's microbatches, so the step's gradient is the sum of the copies. After the
program's last instruction every holder sends its copy's gradients (flattened, one message
per peer) and receives the others', in one symmetric batch, then adds them in rank order, so
all copies end bitwise equal. This exchange is the one transfer outside the program; it
starts after the program has completed every op, so it cannot interleave with it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from pipecc.ir.placement import Placement

from .comm import Channel


def copies(placement: Placement, rank: int) -> dict[int, list[tuple[int, int]]]:
    """For each stage this rank holds that exists more than once: its (rank, chunk) copies."""
    found: dict[int, list[tuple[int, int]]] = {}
    mine = {slot.stage for slot in placement.chunks(rank)}
    for stage in sorted(mine):
        holders = sorted(
            (placement.holder(pipe, stage).rank, placement.holder(pipe, stage).chunk)
            for pipe in range(placement.num_pipes)
            if stage < placement.num_stages(pipe)
        )
        if len(holders) > 1:
            found[stage] = holders
    return found


def _flat(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    grads = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        for p in module.parameters()
    ]
    return torch.cat(grads) if grads else torch.zeros(0, device=device)


def _assign(module: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in module.parameters():
        size = p.numel()
        p.grad = flat[offset : offset + size].view_as(p).clone()
        offset += size


def sum_copies(
    channel: Channel,
    rank: int,
    shared: dict[int, list[tuple[int, int]]],
    modules: dict[int, torch.nn.Module],
    device: torch.device,
) -> None:
    """Make every copy's `.grad` the sum over all copies of its stage (`device`: where the
    runtime's tensors live, for a stage without parameters)."""
    contributions: dict[tuple[int, int], torch.Tensor] = {}  # (stage, rank) -> flat grads
    outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)
    incoming: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for stage, holders in shared.items():
        local = [_flat(modules[chunk], device) for r, chunk in holders if r == rank]
        own = local[0] if len(local) == 1 else torch.stack(local).sum(0)
        contributions[(stage, rank)] = own
        for peer in sorted({r for r, _ in holders if r != rank}):
            outgoing[peer].append(own)
            incoming[peer].append((stage, torch.empty_like(own)))
    sends = {peer: torch.cat(parts) for peer, parts in outgoing.items()}
    recvs = {peer: torch.empty_like(sends[peer]) for peer in sends}
    channel.exchange(sends, recvs)
    for peer, parts in incoming.items():
        offset = 0
        for stage, buffer in parts:
            contributions[(stage, peer)] = recvs[peer][offset : offset + buffer.numel()]
            offset += buffer.numel()
    for stage, holders in shared.items():
        ranks = sorted({r for r, _ in holders})
        total = contributions[(stage, ranks[0])].clone()
        for other in ranks[1:]:
            total += contributions[(stage, other)]
        for r, chunk in holders:
            if r == rank:
                _assign(modules[chunk], total)
