"""Train the MLP of examples/mlp.py with any schedule, under torchrun, with pipecc's runtime.

    torchrun --nproc-per-node 4 examples/train_mlp.py --schedule schedules/dualpipe.sched \\
        --microbatches 16

Every rank compiles the same program, builds the whole model (deterministic weights) and
keeps the stages of its chunks; the runtime finds the boundary shapes on the first step's
real data, each stage run by the rank holding it (every rank is given the batch).
Each step: zero the gradients, `runtime.step(inputs, targets)` (gradients accumulate as the
mean over microbatches; the two copies of a DualPipe stage are summed at the end of the
step), then an Adam step on this rank's parameters. The loss is printed on rank 0 as
the mean over all microbatches of the step (an all-reduce of the ranks' shares).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from mlp import build_stages, loss_fn, make_batch  # examples/mlp.py, beside this script
from pipecc.runtime import PipelineRuntime, RuntimeConfig

from pipecc.api import compile_schedule
from pipecc.ir.program import Program


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="schedules/1f1b.sched", help=".sched or name")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, help="rows per step (default: 8·M)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    return parser.parse_args()


def setup() -> torch.device:
    """The process group torchrun describes: NCCL on a GPU per rank, else gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        return device
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def compile_for_world(schedule: str, microbatches: int, defines: list[str]) -> Program:
    """The program every rank compiles alike, for the world's size (-D NAME=VALUE defines)."""
    values = {k: int(v) for k, v in (d.split("=", 1) for d in defines)}
    return compile_schedule(
        schedule, ranks=dist.get_world_size(), microbatches=microbatches, defines=values
    )


def main() -> None:
    args = parse_args()
    device = setup()
    rank = dist.get_rank()
    program = compile_for_world(args.schedule, args.microbatches, args.defines)
    stages = [s.to(device) for s in build_stages(program.placement.num_stages(0))]
    modules = {slot.chunk: stages[slot.stage] for slot in program.placement.chunks(rank)}
    rows = args.batch_size or 8 * args.microbatches
    runtime = PipelineRuntime(
        program, modules, loss_fn=loss_fn, config=RuntimeConfig(device=device)
    )
    optimizer = torch.optim.Adam(runtime.parameters(), lr=args.lr)  # each parameter once
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = make_batch(rows, seed=step)
        start = time.perf_counter()
        runtime.step(inputs.to(device), targets.to(device))
        optimizer.step()
        if device.type == "cuda":  # the GPU work was only queued: wait for it before timing
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        share = sum((float(v) for v in runtime.losses.values()), 0.0)  # 0.0 where no loss
        share = torch.tensor([share], dtype=torch.float64, device=device)
        dist.all_reduce(share)
        if rank == 0:
            loss = float(share) / program.num_microbatches
            print(f"step {step:3d}  loss {loss:.5f}  {elapsed * 1e3:7.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
