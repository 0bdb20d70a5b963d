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

`floor` is what no runtime can beat on this transport: the step the simulator gives for
pipecc's program (rendezvous, gloo's rule) with the op times of plain module calls
(runtime_vs_torch.py's `ideal` costs, timed after the rounds in the same processes) and
every message taking gloo's one-way latency, measured in the same processes: a ping-pong of
one microbatch's boundary tensor (2 x 16 float32) between the two ranks, each receive posted
before the peer sends, `isend`/`irecv`/`wait` called directly in the ranks' one thread; the
median round trip of `EXCHANGES` in each round, halved, then the median over the rounds (the
mean, which carries the host's scheduling hiccups, is printed beside it). The latency
includes the cheapest host time a message can cost (the calls into gloo and the wake-ups of
a rank that waits idle), so the floor takes no other host time; a rank that is computing
when its message arrives pays more on two cores, which the floor does not count.
`floor/torch` is the lowest pipecc / torch this transport allows; `pipecc/floor` how far
pipecc's step is above it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from pipecc.runtime.tools.spawn import spawn
from runtime_vs_torch import (
    Config,
    Model,
    Runners,
    Samples,
    alternate,
    ideal_step,
    make_pipecc,
    make_torch,
    plain_ops,
    stage_ids,
    torch_step,
)

from pipecc.ir.program import Program

SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")
HIDDEN, ROWS, MICROBATCHES, RANKS, WARMUP = 16, 2, 32, 2, 3
TARGET = 0.5  # pipecc / torch, median over the schedules
EXCHANGES = 200  # ping-pong round trips per round (the floor's message latency)


class Schedule:
    """One schedule's two runtimes on copies of the same weights, and what its floor needs."""

    def __init__(self, config: Config, rank: int) -> None:
        self.config = config
        self.model = Model(config)
        torch_stages, self.stages = self.model.stages(), self.model.stages()
        mine = stage_ids(config.schedule, rank, config.ranks)
        batch = self.model.batch()
        baseline = make_torch(self.model, torch_stages, rank)
        runtime = make_pipecc(self.model, self.stages, rank, early=True)
        self.program: Program = runtime.program
        self.runners: Runners = {
            f"{config.schedule} torch": (
                functools.partial(torch_step, baseline, rank, config.ranks, batch),
                [torch_stages[s] for s in mine],
            ),
            f"{config.schedule} pipecc": (
                functools.partial(runtime.step, *batch),
                [self.stages[s] for s in mine],
            ),
        }


def one_way_ms(rank: int, exchanges: int) -> tuple[float, float]:
    """Gloo's one-way latency between ranks 0 and 1 for one boundary tensor (ms): half the
    median and half the mean round trip of a ping-pong in which every receive is posted
    before the peer sends. Both ranks must call it; rank 1's figures are its own view of
    the same exchanges."""
    message = torch.randn(ROWS, HIDDEN)
    buffers = (torch.empty_like(message), torch.empty_like(message))
    peer = 1 - rank
    trips = []
    incoming = dist.irecv(buffers[0], peer) if rank == 1 else None
    dist.barrier()
    for i in range(exchanges):
        start = time.perf_counter()
        if rank == 0:
            incoming = dist.irecv(buffers[i % 2], peer)
            dist.isend(message, peer).wait()
            incoming.wait()
        else:
            assert incoming is not None
            incoming.wait()  # posted before rank 0 sent
            incoming = dist.irecv(buffers[(i + 1) % 2], peer) if i + 1 < exchanges else None
            dist.isend(message, peer).wait()
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2 * 1e3, statistics.mean(trips) / 2 * 1e3


def worker(rank: int, world: int, configs: list[Config]) -> dict[str, float]:
    """Every schedule's two runtimes stepped alternately; the median step of each (ms); then
    the floor of each schedule (its op times and the message latency, timed in rounds)."""
    torch.set_num_threads(1)
    schedules = [Schedule(config, rank) for config in configs]
    steps: Runners = {}
    for schedule in schedules:
        steps.update(schedule.runners)
    rounds = configs[0].steps
    times = alternate(steps, configs[0].warmup, rounds)
    result = {name: statistics.median(t) for name, t in times.items()}
    latencies = [one_way_ms(rank, EXCHANGES) for _ in range(rounds)]
    result["latency"] = statistics.median(median for median, _ in latencies)
    result["latency mean"] = statistics.median(mean for _, mean in latencies)
    for schedule in schedules:
        samples: Samples = {}
        for round_ in range(1 + rounds):  # one warm-up call, then one sample a round
            plain_ops(schedule.model, schedule.stages, rank, samples if round_ > 0 else {})
        floor = ideal_step(schedule.program, samples, schedule.model.count, result["latency"])
        result[f"{schedule.config.schedule} floor"] = floor
    return result


def report(names: list[str], medians: dict[str, float], rounds: int) -> list[str]:
    """The table's lines: per schedule torch, pipecc, their ratio, the floor and the lowest
    ratio it allows; then the latency behind the floor and the verdict."""
    lines = [
        f"medians of {rounds} alternating rounds (ms): 8 x (Linear(16, 16) + GELU), 2 rows a "
        f"microbatch, M={MICROBATCHES}, P={RANKS}, gloo, one thread a rank",
        f"{'schedule':17} {'torch':>7} {'pipecc':>7} {'ratio':>6} {'floor':>7} "
        f"{'floor/torch':>11} {'pipecc/floor':>12}",
    ]
    ratios = []
    for name in names:
        torch_ms, pipecc_ms = medians[f"{name} torch"], medians[f"{name} pipecc"]
        floor = medians.get(f"{name} floor", float("nan"))
        ratios.append(pipecc_ms / torch_ms)
        lines.append(
            f"{name:17} {torch_ms:7.1f} {pipecc_ms:7.1f} {ratios[-1]:6.2f} {floor:7.1f} "
            f"{floor / torch_ms:11.2f} {pipecc_ms / floor:12.2f}"
        )
    if "latency" in medians:
        mean = medians.get("latency mean", float("nan"))
        lines.append(
            f"floor: the program simulated (rendezvous) with plain-call op times and gloo's "
            f"one-way latency {medians['latency'] * 1e3:.0f} µs a message (ping-pong median; "
            f"mean {mean * 1e3:.0f} µs)"
        )
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
