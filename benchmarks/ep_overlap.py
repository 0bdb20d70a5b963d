"""Expert-parallel overlap: how much all-to-all time does DualPipe's interleave hide?
(target: exposed a2a overlapped / sequential <= 0.3)

    .venv/bin/python benchmarks/ep_overlap.py [--rounds 7] [--microbatches 16]

PP=2 x EP=2 on 4 CPU processes (gloo), `init_device_mesh("cpu", (2, 2), ("pp", "ep"))`.
Every stage is a `MoEStage` of two `MoEBlock`s (a dense Linear+GELU sublayer standing in
for attention, a top-2 router over 4 experts, experts dim -> hidden -> dim); stage 0 takes
float rows, the last stage's loss is the mean squared error. For DualPipeV and DualPipe
(P=2, M microbatches) the pipeline's program is split into MoE phases twice
(runtime/tools/moe_program.py): *overlapped* (each fused F&B as DualPipe's interleave, each
all-to-all posted async while the other half computes) and *sequential* (the fused op's
halves one after the other, every all-to-all blocking). One process group runs both
runtimes, alternating: a round is one step of each, in turn, after a warm-up step each.

Measured per rank and step: the seconds its compute thread blocked on all-to-alls
(`MoEOps.waited`: the waits of the async ones, the blocking ones whole) and the step's wall
time; beside them the seconds the poster thread spent exchanging the dispatches' token
counts (`MoEOps.counted`: not exposed to the compute thread unless a wait covers it).
The sizes: the script first steps the sequential program of DualPipeV once at each
candidate size and keeps the one where the all-to-all is the largest part of the step
(printed), so that there is something to hide on this machine. Statistic: per schedule and
form, the median over rounds of the mean over ranks; the ratio is the median over rounds of
that round's overlapped / sequential exposed time (beside it the part of the all-to-alls
that are blocking in both forms, those of the ops that are not fused: the least it can be),
and the last line gives the median of all rounds of both schedules.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, NamedTuple

import torch
from pipecc.runtime import MoEBlock, MoEStage, PipelineRuntime, RuntimeConfig
from pipecc.runtime.tools.spawn import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipecc.api import compile_schedule
from pipecc.driver.mesh import MeshOptions, MoeOptions, place_mesh, place_moe
from pipecc.ir.ops import Collective, CollectiveKind
from pipecc.ir.program import Program

SCHEDULES = ("dualpipev", "dualpipe")
# (dim, hidden, tokens per microbatch): candidates for the size at which the all-to-all
# weighs most in the step here
SIZES = ((256, 64, 512), (512, 64, 512), (512, 128, 1024))
EXPERTS, TOP, LAYERS = 4, 2, 2


class Size(NamedTuple):
    dim: int
    hidden: int
    tokens: int


class Job(NamedTuple):
    rounds: int
    microbatches: int
    sizes: tuple[Size, ...]


def stages(size: Size, count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    found: list[nn.Module] = []
    for stage in range(count):
        blocks = [
            MoEBlock(
                size.dim,
                size.hidden,
                EXPERTS,
                TOP,
                mixer=nn.Sequential(nn.Linear(size.dim, size.dim), nn.GELU()),
            )  # fmt: skip
            for _ in range(LAYERS)
        ]
        tail = nn.Linear(size.dim, size.dim) if stage == count - 1 else None
        found.append(MoEStage(None, blocks, tail))
    return found


def program(name: str, microbatches: int, overlap: bool) -> Program:
    options = MeshOptions("ep=2", moe=MoeOptions(LAYERS, overlap=overlap))  # as pipecc run --moe
    placed = place_mesh(compile_schedule(name, ranks=2, microbatches=microbatches), options)
    return place_moe(placed, options)


def floor(name: str, microbatches: int) -> float:
    """The part of the overlapped program's all-to-alls that are blocking (those of the ops
    that are not fused): exposed in both forms, the least the ratio can be."""
    instrs = program(name, microbatches, True).ranks[0]
    a2a = [x for x in instrs if type(x) is Collective and x.kind is CollectiveKind.ALL_TO_ALL]
    return sum(not x.asynchronous for x in a2a) / len(a2a)


def runtime(mesh: Any, prog: Program, size: Size) -> PipelineRuntime:
    built = stages(size, prog.placement.num_stages(0))
    chunks = prog.placement.chunks(mesh.get_coordinate()[0])
    modules = {slot.chunk: built[slot.stage] for slot in chunks}
    return PipelineRuntime(prog, modules, config=RuntimeConfig(mesh=mesh))


def batch(size: Size, microbatches: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    rows = torch.randn(microbatches * size.tokens, size.dim, generator=generator)
    return rows, torch.tanh(rows)


def timed(
    run: PipelineRuntime, data: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, float, float]:
    """(exposed all-to-all seconds, step seconds, of the first the count exchanges') of one
    step on this rank."""
    moe = run.interpreter.moe
    assert moe is not None
    for param in run.parameters():
        param.grad = None
    torch.distributed.barrier()
    before, counted, start = moe.waited, moe.counted, time.perf_counter()
    run.step(*data)
    return moe.waited - before, time.perf_counter() - start, moe.counted - counted


def pick(mesh: Any, job: Job) -> tuple[Size, list[tuple[Size, float]]]:
    """The candidate size where the sequential DualPipeV step is most all-to-all."""
    shares = []
    for size in job.sizes:
        run = runtime(mesh, program("dualpipev", job.microbatches, False), size)
        data = batch(size, job.microbatches, 0)
        timed(run, data)
        exposed, step, _ = timed(run, data)
        share = torch.tensor([exposed / step])
        torch.distributed.all_reduce(share)
        shares.append((size, float(share) / 4))
    return max(shares, key=lambda s: s[1])[0], shares


def worker(rank: int, world: int, job: Job) -> dict[str, Any]:
    del rank, world
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    size, shares = pick(mesh, job)
    found: dict[str, Any] = {"size": size, "shares": shares}
    for name in SCHEDULES:
        runs = {
            form: runtime(mesh, program(name, job.microbatches, form == "overlapped"), size)
            for form in ("overlapped", "sequential")
        }
        data = batch(size, job.microbatches, 1)
        for run in runs.values():
            timed(run, data)  # warm-up: the signature learned, the plans bound
        for form in runs:
            found[(name, form)] = []
        for _ in range(job.rounds):
            for form, run in runs.items():
                found[(name, form)].append(timed(run, data))
    return found


def report(results: list[dict[str, Any]], job: Job) -> float:
    size = results[0]["size"]
    for candidate, share in results[0]["shares"]:
        print(f"size dim={candidate.dim} hidden={candidate.hidden} tokens/mb={candidate.tokens}: "
              f"a2a {100 * share:.0f}% of the sequential DualPipeV step")  # fmt: skip
    print(f"picked dim={size.dim} hidden={size.hidden} tokens/mb={size.tokens}, "
          f"M={job.microbatches}, {job.rounds} rounds; per rank: mean over ranks")  # fmt: skip
    ratios = []
    print(
        f"{'schedule':10} {'form':11} {'exposed a2a ms':>15} {'counts (poster)':>16} {'step ms':>9}"
    )
    for name in SCHEDULES:
        rounds = {
            form: [
                tuple(statistics.mean(r[(name, form)][i][k] for r in results) for k in range(3))
                for i in range(job.rounds)
            ]
            for form in ("overlapped", "sequential")
        }
        for form, values in rounds.items():
            exposed = statistics.median(v[0] for v in values) * 1e3
            step = statistics.median(v[1] for v in values) * 1e3
            counts = statistics.median(v[2] for v in values) * 1e3
            print(f"{name:10} {form:11} {exposed:15.1f} {counts:16.1f} {step:9.1f}")
        mine = [
            o[0] / s[0]
            for o, s in zip(rounds["overlapped"], rounds["sequential"], strict=True)
            if s[0]
        ]
        least = floor(name, job.microbatches)
        print(f"{name:10} exposed overlapped / sequential = {statistics.median(mine):.3f} "
              f"(blocking in both forms: {least:.3f} of the all-to-alls)")  # fmt: skip
        ratios += mine
    return statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--microbatches", type=int, default=16)
    args = parser.parse_args(argv)
    sizes = tuple(Size(*s) for s in SIZES)
    job = Job(args.rounds, args.microbatches, sizes)
    results = spawn(worker, 4, job, timeout=600.0, deadline=560.0)
    ratio = report(results, job)
    print(f"ep overlap: exposed a2a overlapped / sequential = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
