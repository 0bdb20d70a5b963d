"""Host overhead: pipecc's step against torch.distributed.pipelining's where a step is all runtime.

    .venv/bin/python benchmarks/runtime_overhead.py                # 20 timed rounds
    .venv/bin/python benchmarks/runtime_overhead.py --rounds 5     # a smoke run
    .venv/bin/python benchmarks/runtime_overhead.py --only 1f1b zbv

Stages so small that the arithmetic is a sliver of the step: 8 blocks of Linear(16, 16) +
GELU cut into the program's equal stages (2 for 1F1B, 4 for interleaved 1F1B, ZB-V and
DualPipeV), 2 rows a microbatch, MSE loss, P=2 ranks on gloo, one thread a rank, M=32. For
each schedule, pipecc's runtime on the program `pipecc run` runs on gloo (the bundled
schedule compiled with the early-recv comm policy) and torch's schedule of the same name
(`Schedule1F1B`, `ScheduleInterleaved1F1B`, `ScheduleZBVZeroBubble`, `ScheduleDualPipeV`,
static stage shapes) are built on copies of the same weights, and all eight step in turn in
every round, in the same processes: 3 warm-up rounds, then `--rounds`. A step is rank 0's
wall time between a barrier before and a barrier after; each figure is the median over the
rounds (ms). Target: pipecc / torch at most 0.5, the median over the four schedules (on a
GPU compute is asynchronous and the host decides the speed of small microbatches); the
last line says whether it is met. The models, the runtimes and the alternation are
benchmarks/runtime_vs_torch.py's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import Any

import torch
from pipecc.runtime.tools.spawn import spawn
from runtime_vs_torch import (
    Config,
    Model,
    Runners,
    alternate,
    make_pipecc,
    make_torch,
    stage_ids,
    torch_step,
)

SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")
HIDDEN, ROWS, MICROBATCHES, RANKS, WARMUP = 16, 2, 32, 2, 3
TARGET = 0.5  # pipecc / torch, median over the schedules


def runners(config: Config, rank: int) -> Runners:
    """torch's and pipecc's step of one schedule, on copies of the same weights."""
    model = Model(config)
    torch_stages, pipecc_stages = model.stages(), model.stages()
    mine = stage_ids(config.schedule, rank, config.ranks)
    batch = model.batch()
    baseline = make_torch(model, torch_stages, rank)
    runtime = make_pipecc(model, pipecc_stages, rank, early=True)
    return {
        f"{config.schedule} torch": (
            functools.partial(torch_step, baseline, rank, config.ranks, batch),
            [torch_stages[s] for s in mine],
        ),
        f"{config.schedule} pipecc": (
            functools.partial(runtime.step, *batch),
            [pipecc_stages[s] for s in mine],
        ),
    }


def worker(rank: int, world: int, configs: list[Config]) -> dict[str, float]:
    """Every schedule's two runtimes stepped alternately; the median step of each (ms)."""
    torch.set_num_threads(1)
    steps: Runners = {}
    for config in configs:
        steps.update(runners(config, rank))
    times = alternate(steps, configs[0].warmup, configs[0].steps)
    return {name: statistics.median(t) for name, t in times.items()}


def report(names: list[str], medians: dict[str, float], rounds: int) -> list[str]:
    """The table's lines: per schedule torch, pipecc and their ratio; then the verdict."""
    lines = [
        f"medians of {rounds} alternating rounds (ms): 8 x (Linear(16, 16) + GELU), 2 rows a "
        f"microbatch, M={MICROBATCHES}, P={RANKS}, gloo, one thread a rank",
        f"{'schedule':17} {'torch':>7} {'pipecc':>7} {'ratio':>6}",
    ]
    ratios = []
    for name in names:
        torch_ms, pipecc_ms = medians[f"{name} torch"], medians[f"{name} pipecc"]
        ratios.append(pipecc_ms / torch_ms)
        lines.append(f"{name:17} {torch_ms:7.1f} {pipecc_ms:7.1f} {ratios[-1]:6.2f}")
    median = statistics.median(ratios)
    verdict = "met" if median <= TARGET else "not met"
    lines.append(
        f"pipecc/torch: median {median:.2f} over {len(ratios)} schedules "
        f"(target <= {TARGET:.2f}: {verdict})"
    )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (at least 3)")
    parser.add_argument("--only", nargs="*", default=list(SCHEDULES), choices=SCHEDULES)
    args = parser.parse_args(argv)
    rounds = max(3, args.rounds)
    configs = [
        Config(name, "mlp", HIDDEN, MICROBATCHES, rounds, WARMUP, ranks=RANKS, mlp_rows=ROWS)
        for name in args.only
    ]
    results: list[dict[str, Any]] = spawn(worker, RANKS, configs, timeout=3600)
    lines = report(args.only, results[0], rounds)
    print("\n".join(lines), flush=True)
    return lines


if __name__ == "__main__":
    main()
