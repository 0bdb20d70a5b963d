"""Checkpoint cases, run in the GPT cases' process group (P=2; test_runtime_gpt.py).

The GPT of examples/gpt.py with 4 blocks and a tied head, trained with AdamW, global
clipping and an LR schedule. A run of STEPS steps saves a checkpoint after step SAVE_AT;
a second run (new stages, runtime, optimizer and scheduler) loads it, on the same program
or on another, and trains the remaining steps. Functions here run in the spawned
processes: keep them importable and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpt_cases import ROWS, GptCase, _gpt, run_gpt_cases
from pipecc.runtime import (
    PipelineRuntime,
    RuntimeConfig,
    load_checkpoint,
    save_checkpoint,
    shared_parameters,
)
from torch import nn

from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

STEPS, SAVE_AT = 4, 2


@dataclass(frozen=True)
class CheckpointCase:
    """Train `source` for STEPS steps, saving after SAVE_AT; resume on `target`."""

    name: str
    source: Program
    target: Program
    folder: str
    dropout: float = 0.0
    mode: str = "resume"  # or "clash" (stage-local names), "missing" (saved without optimizer)


def config(dropout: float) -> Any:
    return _gpt().GPTConfig(vocab=32, dim=16, heads=2, seq=8, layers=4, tied=True,
                            dropout=dropout)  # fmt: skip


class Job:
    """One training run's objects on this rank."""

    def __init__(self, rank: int, program: Program, dropout: float, local: bool = False) -> None:
        stages = _gpt().build_stages(program.placement.num_stages(0), config(dropout))
        if local:  # each stage's blocks renumbered from 0: stage-local names
            for stage in stages:
                stage.blocks = nn.Sequential(*list(stage.blocks))
        modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
        cfg = RuntimeConfig(shared=shared_parameters(stages), seed=5)
        self.runtime = PipelineRuntime(program, modules, loss_fn=_gpt().loss_fn, config=cfg)
        self.optimizer = torch.optim.AdamW(self.runtime.parameters(), lr=1e-2, eps=1e-6)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _decay)
        self.stages, self.rank = stages, rank

    def train(self, step: int) -> float:
        program = self.runtime.program
        data = _gpt().make_batch(ROWS * program.num_microbatches, seed=step, config=config(0.0))
        self.optimizer.zero_grad(set_to_none=True)
        self.runtime.step(*data)
        self.runtime.clip_grad_norm_(0.5)
        self.optimizer.step()
        self.scheduler.step()
        return float(self.runtime.global_loss())

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name (each name once)."""
        placement = self.runtime.program.placement
        return {
            name: param.detach().clone()
            for slot in placement.chunks(self.rank)
            for name, param in self.stages[slot.stage].named_parameters()
        }


def _decay(step: int) -> float:
    return 1.0 / (1.0 + step)


def run_all(
    rank: int, world: int, payload: tuple[list[GptCase], list[CheckpointCase]]
) -> dict[str, dict[str, Any]]:
    """The GPT cases, then the checkpoint cases, in one process group."""
    results = run_gpt_cases(rank, world, payload[0])
    for case in payload[1]:
        results[case.name] = run_checkpoint_case(rank, case)
    return results


def run_checkpoint_case(rank: int, case: CheckpointCase) -> dict[str, Any]:
    try:
        if case.mode == "clash":
            job = Job(rank, case.source, case.dropout, local=True)
            save_checkpoint(case.folder, job.runtime, job.optimizer)
            return {}
        if case.mode == "missing":  # saved without the optimizer, loaded with one
            job = Job(rank, case.source, case.dropout)
            save_checkpoint(case.folder, job.runtime)
            load_checkpoint(case.folder, job.runtime, job.optimizer)
            return {}
        return _resume(rank, case)
    except PipeccError as err:
        return {"error": type(err).__name__, "message": str(err)}


def _resume(rank: int, case: CheckpointCase) -> dict[str, Any]:
    first = Job(rank, case.source, case.dropout)
    losses = []
    for step in range(STEPS):
        losses.append(first.train(step))
        if step == SAVE_AT - 1:
            extra = {"next_batch": SAVE_AT, "rank": rank}
            save_checkpoint(case.folder, first.runtime, first.optimizer,
                            scheduler=first.scheduler, extra=extra)  # fmt: skip
    second = Job(rank, case.target, case.dropout)
    found = load_checkpoint(case.folder, second.runtime, second.optimizer,
                            scheduler=second.scheduler)  # fmt: skip
    resumed = [second.train(step) for step in range(found["next_batch"], STEPS)]
    unrestored = None
    if case.dropout:  # the same load, but the runtime's step count left at 0: other masks
        third = Job(rank, case.target, case.dropout)
        load_checkpoint(case.folder, third.runtime, third.optimizer, scheduler=third.scheduler)
        third.runtime.steps = 0
        unrestored = third.train(SAVE_AT)
    keys = dcp.FileSystemReader(case.folder).read_metadata().state_dict_metadata
    dist.barrier()
    same = case.source == case.target
    return {
        "losses": losses[SAVE_AT:],
        "resumed": resumed,
        "extra": found,
        "unrestored": unrestored,
        "steps": second.runtime.steps,
        "keys": sorted(keys),
        "weights": (first.weights(), second.weights()) if same else None,
        "lr": (first.scheduler.get_last_lr(), second.scheduler.get_last_lr()),
        "distinct": len({id(p) for s in first.stages for p in s.parameters()}),
        "folder": str(Path(case.folder)),
    }
