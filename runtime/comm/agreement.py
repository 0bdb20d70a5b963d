"""Agreement among the ranks of a pipeline: every rank's findings, gathered in one collective.

Every check that can fail differently on different ranks (a module missing on one rank, a
declared boundary that the real run contradicts) is gathered from all ranks before any
point-to-point op of the program, so every rank raises the same `SetupError` instead of
some ranks hanging on a peer that gave up. These gathers run only when a step brings an
input signature the runtime has not seen (runtime/boundaries/discovery.py), never in a step
whose shapes are known.

Every collective the runtime issues itself (these gathers, the gradient norm's and the
loss's all-reduce, runtime/comm/training.py) completes through `finish`: on gloo under
`RuntimeConfig.timeout`, on NCCL under the process group's own (no host wait is added).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from pipecc.diagnostics import RankError, SetupError


def agree(
    found: list[str],
    group: dist.ProcessGroup | None,
    world: int,
    device: torch.device,
    timeout: float | None = None,
) -> None:
    """Gather every rank's findings; raise the same SetupError on every rank if any.

    `found[i]` lines already name their rank. `timeout` as `gather_texts`'."""
    texts = gather_texts("\n".join(found), group, world, device, timeout=timeout)
    lines = [line for text in texts for line in text.splitlines()]
    if lines:
        raise SetupError("the pipeline cannot start:\n  " + "\n  ".join(lines))


class ExchangeTimeout(Exception):
    """A rank did not come to a gather within its time limit."""


def finished(work: dist.Work | None, timeout: float | None, what: str) -> None:
    """`finish`, a failure raised as a `RankError` that says `what` failed."""
    try:
        finish(work, timeout)
    except ExchangeTimeout as err:  # gloo's text without its source location and advice
        text = str(err)
        text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
        raise RankError(f"{what} failed: {text.split('. This is typically')[0]}") from err


def finish(work: dist.Work | None, timeout: float | None) -> None:
    """Complete a collective the runtime issued: within `timeout` seconds (gloo), else
    as the process group's own timeout says (None: NCCL, whose `wait` does not block the
    host). A gloo wait that fails raises `ExchangeTimeout` (gloo says the same for a peer
    that timed out, closed its connection or died)."""
    if work is None:
        return
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout))
    except RuntimeError as err:
        raise ExchangeTimeout(str(err).split("\n")[0][:200]) from err


def gather_texts(
    text: str,
    group: dist.ProcessGroup | None,
    world: int,
    device: torch.device,
    *,
    timeout: float | None = None,
) -> list[str]:
    """Every rank's `text`, in rank order (called by every rank of `group` alike).

    Text travels as UTF-8 bytes in two `all_gather`s (sizes, then padded bytes; the second
    only when some text is not empty): `all_gather_object` would need numpy. `timeout`:
    seconds the first may block (gloo) before `ExchangeTimeout`; None: the group's own."""
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    finish(dist.all_gather(sizes, size, group=group, async_op=True), timeout)
    longest = max(int(s.item()) for s in sizes)
    if longest == 0:
        return ["" for _ in range(world)]
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    mine = mine.to(device)
    texts = [torch.zeros_like(mine) for _ in range(world)]
    finish(dist.all_gather(texts, mine, group=group, async_op=True), timeout)
    return [bytes(t[: int(n.item())].tolist()).decode() for t, n in zip(texts, sizes, strict=True)]
