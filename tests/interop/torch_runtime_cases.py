"""pipecc's torch CSV exports, trained for one step by torch's own `_PipelineScheduleRuntime`.

The functions here run inside spawned gloo process groups (one per world size, every case in
one go, DESIGN §7): each rank builds torch `PipelineStage`s for the stages its CSV row holds,
loads the CSV with torch's `_load_csv`, runs one step and returns, per case, its largest
absolute gradient error against a single-process reference and the largest reference
gradient, so the test can form `max_rel_grad_diff` over all parameters of all ranks.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, NamedTuple

import torch
from torch import nn

HIDDEN = 6
ROWS = 2  # rows per microbatch


class TorchCase(NamedTuple):
    """One export: its CSV text, the format torch loads it as, the pipeline's sizes."""

    name: str
    csv_text: str
    torch_format: str  # "compute_only" or "compute_comms"
    microbatches: int
    num_stages: int
    defer: bool = False  # defer_pp_recv=True (torch lowers compute_only CSVs with it)


def build(num_stages: int) -> list[nn.Module]:
    """The model: one Linear + GELU per stage, seeded, so every process builds the same."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(num_stages)]


def batch(microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows = ROWS * microbatches
    x = torch.randn(rows, HIDDEN, generator=generator)
    return x, torch.randn(rows, HIDDEN, generator=generator)


def reference(case: TorchCase) -> tuple[float, list[list[torch.Tensor]]]:
    """The mean loss over microbatches and every stage's parameter gradients, one process."""
    stages = build(case.num_stages)
    x, y = batch(case.microbatches)
    total = 0.0
    for mb in range(case.microbatches):
        out = x[mb * ROWS : (mb + 1) * ROWS]
        for stage in stages:
            out = stage(out)
        loss = nn.functional.mse_loss(out, y[mb * ROWS : (mb + 1) * ROWS])
        (loss / case.microbatches).backward()  # type: ignore[no-untyped-call]
        total += float(loss.detach())
    grads = [[p.grad.clone() for p in s.parameters()] for s in stages]  # type: ignore[union-attr]
    return total / case.microbatches, grads


def held_stages(csv_text: str, rank: int) -> list[int]:
    """The stages rank `rank`'s row names (torch infers the placement the same way)."""
    from torch.distributed.pipelining.schedules import _Action

    row = csv_text.splitlines()[rank].split(",")
    found: set[int] = set()
    for cell in row:
        action = _Action.from_str(cell)
        if action is None:
            continue
        for part in action.sub_actions or (action,):
            if part.computation_type.value in ("F", "B", "I", "W"):
                found.add(part.stage_index)
    return sorted(found)


def run_case(rank: int, world: int, case: TorchCase) -> dict[str, Any]:
    """One step of `case` on this rank under torch's runtime."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    modules = build(case.num_stages)
    mine = held_stages(case.csv_text, rank)
    stages = [PipelineStage(modules[s], s, case.num_stages, torch.device("cpu")) for s in mine]
    schedule = _PipelineScheduleRuntime(
        stages,
        n_microbatches=case.microbatches,
        loss_fn=nn.functional.mse_loss,
        defer_pp_recv=case.defer,
    )
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "schedule.csv")
        with open(path, "w") as handle:
            handle.write(case.csv_text)
        schedule._load_csv(path, format=case.torch_format)
    x, y = batch(case.microbatches)
    losses: list[torch.Tensor] = []
    schedule.step(x, target=y, losses=losses)
    want_loss, want = reference(case)
    diff = scale = 0.0
    for s in mine:
        for got, ref in zip(modules[s].parameters(), want[s], strict=True):
            assert got.grad is not None
            diff = max(diff, float((got.grad - ref).abs().max()))
            scale = max(scale, float(ref.abs().max()))
    loss = float(torch.stack(losses).mean()) if losses else None
    return {"diff": diff, "scale": scale, "loss": loss, "want_loss": want_loss}


def run_cases(rank: int, world: int, cases: list[TorchCase]) -> dict[str, dict[str, Any]]:
    """Every case on this rank; a case that raises reports its error instead."""
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        try:
            results[case.name] = run_case(rank, world, case)
        except Exception as err:  # reported per case, so one failure does not hide the rest
            results[case.name] = {"error": f"{type(err).__name__}: {err}"}
    return results
