"""Train the MoE of examples/moe.py under torchrun, its balancing losses added in the stages.

    torchrun --nproc-per-node 2 examples/train_moe.py --schedule zb_h1 --microbatches 4

Each rank builds only its own stages (`build_stage`: cut from the meta model, parameter
names kept); the runtime finds the boundaries along the pipeline, and every rank is given
the batch. Every MoE layer adds its router's
balancing loss with `add_loss` where it is computed, so each step's gradient is that of
mean over microbatches of (cross-entropy + balancing losses), and rank 0 logs both parts
(`runtime.global_loss(breakdown=True)`, the same on every rank). Every rank also holds the
whole model (`build_model()`) for `check_against`, but trains only its stages: at the first
and the last step the step is taken by `check_against`, which compares it with the whole
model by parameter name after giving that model the stages' current weights (the whole
model's other layers are stale on every rank, which would make a direct comparison wrong).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from moe import build_model, build_stage, loss_fn, make_batch  # examples/moe.py, beside this
from pipecc.runtime import PipelineRuntime, RuntimeConfig, check_against
from train_mlp import compile_for_world, setup  # examples/train_mlp.py, beside this


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help=".sched file or bundled name")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = setup()
    rank = dist.get_rank()
    program = compile_for_world(args.schedule, args.microbatches, args.defines)
    num_stages = program.placement.num_stages(0)
    modules = {
        slot.chunk: build_stage(slot.stage, num_stages).to(device)
        for slot in program.placement.chunks(rank)
    }
    runtime = PipelineRuntime(
        program, modules, loss_fn=loss_fn, config=RuntimeConfig(device=device)
    )
    whole = build_model().to(device)  # for check_against only: never trained here
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=args.lr)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        tokens, targets = (t.to(device) for t in make_batch(8 * args.microbatches, seed=step))
        if step in (0, args.steps - 1):  # this step, checked against the unsplit model
            found = check_against(whole, runtime, tokens, targets)
            verdict = "ok" if found.ok else "FAILED: " + "; ".join(found.failures)
            if rank == 0:
                print(f"check against the whole model: {verdict} (max rel grad diff "
                      f"{found.max_rel_grad_diff:.3g})", flush=True)  # fmt: skip
        else:
            runtime.step(tokens, targets)
        optimizer.step()
        loss = runtime.global_loss(breakdown=True)
        if rank == 0:
            stages = "  ".join(f"stage {s} {v:.4f}" for s, v in loss.by_stage.items())
            print(f"step {step:3d}  loss {loss.total:.5f} = cross-entropy {loss.main:.5f} + "
                  f"balancing {loss.added:.5f} ({stages})", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
