"""Agreement among the ranks of a pipeline: every rank's findings, gathered in one collective.

Every check that can fail differently on different ranks (a module missing on one rank, a
stage whose output does not match the next stage's input) is gathered from all ranks before
any point-to-point op, so every rank raises the same `SetupError` instead of some ranks
hanging on a peer that gave up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipecc.diagnostics import SetupError


def agree(
    found: list[str], group: dist.ProcessGroup | None, world: int, device: torch.device
) -> None:
    """Gather every rank's findings; raise the same SetupError on every rank if any.

    `found[i]` lines already name their rank."""
    texts = gather_texts("\n".join(found), group, world, device)
    lines = [line for text in texts for line in text.splitlines()]
    if lines:
        raise SetupError("the pipeline cannot start:\n  " + "\n  ".join(lines))


def gather_texts(
    text: str, group: dist.ProcessGroup | None, world: int, device: torch.device
) -> list[str]:
    """Every rank's `text`, in rank order (called by every rank of `group` alike).

    Text travels as UTF-8 bytes in two `all_gather`s (sizes, then padded bytes; the second
    only when some text is not empty): `all_gather_object` would need numpy."""
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    if longest == 0:
        return ["" for _ in range(world)]
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    mine = mine.to(device)
    texts = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(texts, mine, group=group)
    return [bytes(t[: int(n.item())].tolist()).decode() for t, n in zip(texts, sizes, strict=True)]
