"""Train the GPT of examples/gpt.py from a DataLoader that only the ranks needing data load.

    torchrun --nproc-per-node 2 examples/train_loader.py --schedule zbv --microbatches 4
    torchrun --nproc-per-node 2 examples/train_loader.py --schedule zbv --microbatches 4 --vary

`runtime.needs_inputs` / `runtime.needs_targets` say, once the runtime is built, whether this
rank consumes the step's inputs (it holds a first stage) and targets (a last stage); only
those ranks build and iterate a `DataLoader` (`drop_last=True`: every batch splits into M
microbatches). The others pass `None`: with fixed shapes under
`RuntimeConfig(static_shapes=True)`; with `--vary` (each batch cut to its own sequence
length, as a bucketing loader does) they get the step's shapes from the loading rank,
`broadcast_shapes(runtime, tokens)`, one small message per step outside the program.
Rank 0 prints each step's loss; with `--vary` also the step's sequence length.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from gpt import GPTConfig, build_stages, loss_fn, make_batch  # examples/gpt.py, beside this
from pipecc.runtime import PipelineRuntime, RuntimeConfig, broadcast_shapes, shared_parameters
from torch.utils.data import DataLoader, TensorDataset
from train_mlp import compile_for_world, setup  # examples/train_mlp.py, beside this

LENGTHS = (16, 12, 8)  # --vary: the sequence length of batch k is LENGTHS[k % 3]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help=".sched file or bundled name")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per step")
    parser.add_argument("--rows", type=int, default=100, help="rows in the dataset")
    parser.add_argument("--vary", action="store_true", help="another sequence length per step")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    return parser.parse_args()


def loader(args: argparse.Namespace) -> DataLoader[Any]:
    """The dataset's rows in batches of --batch-size, the last short one dropped."""
    tokens, targets = make_batch(args.rows, seed=0, config=GPTConfig())
    return DataLoader(TensorDataset(tokens, targets), batch_size=args.batch_size, drop_last=True)


def main() -> None:
    args = parse_args()
    device = setup()
    program = compile_for_world(args.schedule, args.microbatches, args.defines)
    rank = dist.get_rank()
    stages = [s.to(device) for s in build_stages(program.placement.num_stages(0), GPTConfig())]
    modules = {slot.chunk: stages[slot.stage] for slot in program.placement.chunks(rank)}
    config = RuntimeConfig(device=device, shared=shared_parameters(stages),
                           static_shapes=not args.vary)  # fmt: skip
    runtime = PipelineRuntime(program, modules, loss_fn=loss_fn, config=config)
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=3e-3)
    loads = runtime.needs_inputs or runtime.needs_targets
    said = f"needs_inputs {runtime.needs_inputs}, needs_targets {runtime.needs_targets}"
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, f"{said}: {'loads' if loads else 'loads nothing'}")
    for other, line in enumerate(every if rank == 0 else []):
        print(f"rank {other}: {line}", flush=True)
    batches = iter(loader(args)) if loads else None
    for step in range(args.rows // args.batch_size):  # len(loader), known without loading
        tokens = targets = None
        if batches is not None:
            tokens, targets = next(batches)
            if args.vary:
                length = LENGTHS[step % len(LENGTHS)]
                tokens, targets = tokens[:, :length], targets[:, :length]
            tokens, targets = tokens.to(device), targets.to(device)
        if args.vary:  # the loading rank's shapes; a meta-tensor stand-in elsewhere
            tokens = broadcast_shapes(runtime, tokens)
        elif not runtime.needs_inputs:
            tokens = None
        optimizer.zero_grad(set_to_none=True)
        runtime.step(tokens, targets if runtime.needs_targets else None)
        optimizer.step()
        loss = runtime.global_loss()
        if rank == 0:
            seq = f"  seq {LENGTHS[step % len(LENGTHS)]}" if args.vary else ""
            print(f"step {step}  loss {float(loss):.5f}{seq}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
