"""Train the GPT of examples/gpt.py with any schedule, under torchrun, with pipecc's runtime.

    torchrun --nproc-per-node 2 examples/train_gpt.py --schedule zbv --microbatches 4 --tied

Every rank compiles the same program and builds the whole model (deterministic weights), keeps
the stages of its chunks, and declares the parameters that are one object in two stages (the
tied embedding) as shared, so their gradients are summed across the ranks that hold them, by
an all_reduce the program places (`sum_shared`, as `pipecc compile --shared 0+S`).
The runtime finds the boundary shapes itself, on the first step's real data (and again when
the shapes change); every rank is given the batch (only its shapes are read where a rank
holds neither the first nor the last stage). Each step:
zero the gradients, `runtime.step(tokens, next_tokens)`, clip the global gradient norm (each
parameter counted once over the pipeline), an AdamW step on `runtime.parameters()` (each
parameter once), and rank 0 logs the step's loss (`runtime.global_loss()`, the mean over all
microbatches on every rank).

The stages carry the whole model's parameter names (examples/gpt.py numbers the blocks as
in the whole model), so `--save-every N` writes a checkpoint (stages, AdamW, the runtime's
step count, the next step) with `pipecc.runtime.save_checkpoint` every N steps into
`--save-dir/step_K`, and `--resume DIR` continues from one, on the same program bitwise or
on another schedule, P or cut by parameter name (docs/runtime.md, "Checkpoints").

On a device mesh (docs/parallelism.md), `--pp P --dp-replicate D` with P·D processes:

    torchrun --nproc-per-node 4 examples/train_gpt.py --schedule zbv --pp 2 --dp-replicate 2

builds `init_device_mesh(device, (P, D), mesh_dim_names=("pp", "dp_replicate"))`, compiles the
schedule for P ranks with each stage's data-parallel all_reduce (`--mesh dp_replicate=D`),
and gives each replica its contiguous share of the global batch. `--tp T` adds a tp
dimension (innermost) and splits every block's MLP over it (`parallelize` of
examples/gpt.py); `--dp-shard S` wraps the stages each process holds with FSDP2, on any
schedule (split backwards too) and with `--tied` (docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt import (  # examples/gpt.py, beside this
    GPTConfig,
    build_stages,
    loss_fn,
    make_batch,
    parallelize,
)
from pipecc.runtime import (
    PipelineRuntime,
    RuntimeConfig,
    load_checkpoint,
    save_checkpoint,
    shared_parameters,
)
from pipecc.runtime.comm.shared import shared_stages
from pipecc.runtime.tools.reference import Options, reference_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from train_mlp import setup  # examples/train_mlp.py, beside this

from pipecc.api import compile_schedule
from pipecc.driver.mesh import MeshOptions, place_mesh
from pipecc.ir.program import Program
from pipecc.passes.sum_shared import sum_shared


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help=".sched file or bundled name")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, help="rows per step (default: 8·M)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--log-every", type=int, default=1, help="steps between log lines")
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--layers", type=int, default=0, help="blocks (0: one per stage)")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--pp", type=int, help="pipeline ranks (default: the world size)")
    parser.add_argument("--dp-replicate", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--dp-shard", type=int, default=1, help="FSDP2 shards of each stage")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel (each block's MLP)")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="save a checkpoint every N steps, into --save-dir/step_K")  # fmt: skip
    parser.add_argument("--save-dir", default="checkpoints", help="where --save-every writes")
    parser.add_argument("--resume", metavar="DIR", help="continue from a checkpoint folder")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare the first step's loss with one process on the whole batch",
    )
    return parser.parse_args()


def on_mesh(args: argparse.Namespace, device: torch.device) -> tuple[Program, Any, int]:
    """The program, the DeviceMesh (None without --dp-replicate or --tp) and this process's
    replica index."""
    world = dist.get_world_size()
    others = args.dp_replicate * args.dp_shard * args.tp
    pp = args.pp or world // others
    if pp * others != world:
        raise SystemExit(
            f"--pp {pp} x --dp-replicate {args.dp_replicate} x --dp-shard {args.dp_shard} "
            f"x --tp {args.tp} is not the world size {world}"
        )
    values = {k: int(v) for k, v in (d.split("=", 1) for d in args.defines)}
    program = compile_schedule(args.schedule, ranks=pp, microbatches=args.microbatches,
                               defines=values)  # fmt: skip
    sizes = {"pp": pp, "dp_replicate": args.dp_replicate, "dp_shard": args.dp_shard,
             "tp": args.tp}  # fmt: skip
    names = tuple(d for d, n in sizes.items() if n > 1 or d == "pp")
    if names == ("pp",):
        return program, None, 0
    mesh = init_device_mesh(device.type, tuple(sizes[d] for d in names), mesh_dim_names=names)
    program = place_mesh(program, MeshOptions(",".join(f"{d}={sizes[d]}" for d in names)))
    at = dict(zip(names, mesh.get_coordinate(), strict=True))
    replica = at.get("dp_replicate", 0) * args.dp_shard + at.get("dp_shard", 0)
    return program, mesh, replica


def whole_batch_loss(
    config: GPTConfig, num_stages: int, batch: tuple[torch.Tensor, ...], microbatches: int,
    device: torch.device,
) -> float:  # fmt: skip
    """--check: the loss of one process on the whole global batch, microbatch by microbatch,
    with a fresh copy of the model (the same deterministic weights the step started from)."""
    reference = [s.to(device) for s in build_stages(num_stages, config)]
    loss, _ = reference_step(reference, batch, microbatches, loss_fn, Options(device=device))
    return loss


def main() -> None:
    args = parse_args()
    device = setup()
    rank = dist.get_rank()
    program, mesh, replica = on_mesh(args, device)
    pp_rank = rank if mesh is None else mesh.get_coordinate()[0]
    config = GPTConfig(tied=args.tied, dropout=args.dropout, layers=args.layers)
    stages = [s.to(device) for s in build_stages(program.placement.num_stages(0), config)]
    if args.tp > 1:  # every block's MLP split over the tp group (examples/gpt.py)
        for stage, module in enumerate(stages):
            parallelize(module, stage, mesh["tp"])
    shared = shared_parameters(stages)  # by identity: before FSDP2 copies the held stages'
    # the tie's gradient sum as an instruction of the program (`pipecc compile --shared 0+S`),
    # checked by the verifier with the rest; sums_in_program refuses a program without it
    program = sum_shared(program, shared=tuple(tuple(g) for g in shared_stages(shared)))
    if args.dp_shard > 1:  # FSDP2 on the stages held here (the runtime reduces at REDUCE_GRAD)
        for slot in program.placement.chunks(pp_rank):
            fully_shard(stages[slot.stage], mesh=mesh["dp_shard"], reshard_after_forward=False)
    modules = {slot.chunk: stages[slot.stage] for slot in program.placement.chunks(pp_rank)}
    runtime = PipelineRuntime(
        program,
        modules,  # the boundaries: found along the pipeline for each new shape signature
        loss_fn=loss_fn,
        config=RuntimeConfig(device=device, shared=shared, seed=0, mesh=mesh, sums_in_program=True),
    )
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=args.lr)
    replicas = args.dp_replicate * args.dp_shard
    rows = args.batch_size or 8 * args.microbatches * replicas  # the global batch
    share = rows // replicas
    want = None
    if args.check:  # before any step changes the weights
        batch = make_batch(rows, seed=0, config=config)
        want = whole_batch_loss(config, len(stages), batch, args.microbatches * replicas, device)
    first = resume(args.resume, runtime, optimizer, rank)
    for step in range(first, args.steps):
        optimizer.zero_grad(set_to_none=True)
        tokens, targets = make_batch(rows, seed=step, config=config)
        tokens, targets = (t[replica * share : (replica + 1) * share] for t in (tokens, targets))
        start = time.perf_counter()
        runtime.step(tokens.to(device), targets.to(device))
        norm = runtime.clip_grad_norm_(args.clip)
        optimizer.step()
        loss = runtime.global_loss()  # the same on every rank
        elapsed = time.perf_counter() - start
        if rank == 0 and step % args.log_every == 0:  # the step's time: runtime.last_step
            print(
                f"step {step:3d}  loss {float(loss):.5f}  grad norm {float(norm):.4f}  "
                f"{elapsed * 1e3:7.1f} ms  {tokens.numel() * replicas / elapsed:8.0f} tokens/s  "
                f"peak {peak_memory(device) / 2**20:.0f} MiB",
                flush=True,
            )
        if step == 0 and want is not None:
            check(float(loss), want, rank)
        save(args, step, runtime, optimizer, rank)
    dist.destroy_process_group()


def peak_memory(device: torch.device) -> int:
    """Bytes: the peak of the GPU's allocator, or on a CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def save(
    args: argparse.Namespace, step: int, runtime: PipelineRuntime, optimizer: Any, rank: int
) -> None:
    """--save-every: after every N-th step, a checkpoint whose `extra` is the next step."""
    if not args.save_every or (step + 1) % args.save_every:
        return
    path = Path(args.save_dir) / f"step_{step + 1}"
    save_checkpoint(path, runtime, optimizer, extra={"step": step + 1})
    if rank == 0:
        print(f"saved {path}", flush=True)


def resume(folder: str | None, runtime: PipelineRuntime, optimizer: Any, rank: int) -> int:
    """--resume: the stages, AdamW's state and the runtime's step count (the dropout masks)
    from a checkpoint, in any schedule, P or cut (the names are the whole model's); returns
    the step to continue at (the batches are a function of the step)."""
    if folder is None:
        return 0
    step = int(load_checkpoint(folder, runtime, optimizer)["step"])
    if rank == 0:
        print(f"resumed from {folder} at step {step}", flush=True)
    return step


def check(loss: float, want: float, rank: int) -> None:
    """--check: the first step's loss against one process on the whole batch (within 1e-5,
    relative); every rank stops with exit code 1 when they differ."""
    same = abs(loss - want) <= 1e-5 * abs(want)
    if rank == 0:
        verdict = "ok" if same else "DIFFERENT"
        print(f"check: step 0 loss {loss:.6f}, one process on the whole batch {want:.6f}: "
              f"{verdict}", flush=True)  # fmt: skip
    if not same:
        dist.destroy_process_group()
        raise SystemExit(1)


if __name__ == "__main__":
    main()
