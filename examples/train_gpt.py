"""Train the GPT of examples/gpt.py with any schedule, under torchrun, with pipecc's runtime.

    torchrun --nproc-per-node 2 examples/train_gpt.py --schedule zbv --microbatches 4 --tied

Every rank compiles the same program and builds the whole model (deterministic weights), keeps
the stages of its chunks, and declares the parameters that are one object in two stages (the
tied embedding) as shared, so their gradients are summed across the ranks that hold them.
The runtime finds the boundary shapes itself, on the first step's real data (and again when
the shapes change); every rank is given the batch (only its shapes are read where a rank
holds neither the first nor the last stage). Each step:
zero the gradients, `runtime.step(tokens, next_tokens)`, clip the global gradient norm (each
parameter counted once over the pipeline), an AdamW step on `runtime.parameters()` (each
parameter once), and rank 0 logs the step's loss (`runtime.global_loss()`, the mean over all
microbatches on every rank).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from gpt import GPTConfig, build_stages, loss_fn, make_batch  # examples/gpt.py, beside this
from pipecc.runtime import PipelineRuntime, RuntimeConfig, shared_parameters
from train_mlp import compile_for_world, setup  # examples/train_mlp.py, beside this


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help=".sched file or bundled name")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, help="rows per step (default: 8·M)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--layers", type=int, default=0, help="blocks (0: one per stage)")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = setup()
    rank = dist.get_rank()
    program = compile_for_world(args.schedule, args.microbatches, args.defines)
    config = GPTConfig(tied=args.tied, dropout=args.dropout, layers=args.layers)
    stages = [s.to(device) for s in build_stages(program.placement.num_stages(0), config)]
    modules = {slot.chunk: stages[slot.stage] for slot in program.placement.chunks(rank)}
    runtime = PipelineRuntime(
        program,
        modules,  # the boundaries: found along the pipeline for each new shape signature
        loss_fn=loss_fn,
        config=RuntimeConfig(device=device, shared=shared_parameters(stages), seed=0),
    )
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=args.lr)
    rows = args.batch_size or 8 * args.microbatches
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        tokens, targets = make_batch(rows, seed=step, config=config)
        start = time.perf_counter()
        runtime.step(tokens.to(device), targets.to(device))
        norm = runtime.clip_grad_norm_(args.clip)
        optimizer.step()
        loss = runtime.global_loss()  # the same on every rank
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(
                f"step {step:3d}  loss {float(loss):.5f}  grad norm {float(norm):.4f}  "
                f"{elapsed * 1e3:7.1f} ms",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
