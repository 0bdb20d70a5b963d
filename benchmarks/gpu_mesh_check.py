"""FSDP2 stages on one device: what benchmarks/gpu_check.sh runs of the mesh on a single GPU.

A mesh of one process, `("pp", "dp_shard")` of sizes (1, 1): every stage of the tied GPT of
examples/gpt.py wrapped with `fully_shard` over the dp_shard dimension, the schedule
compiled with FSDP's stage actions (`--fsdp`), one step through `PipelineRuntime` against one
process without FSDP on the same batch. The shard group has one member, so FSDP moves no
data (it issues no all-gather or reduce-scatter at all: the count is checked to be at most
the program's UNSHARDs and REDUCE_GRADs), but its parameter swaps, its post-backward at the
program's REDUCE_GRAD and its end-of-backward callback (runtime/engine/stage_actions.py) run
on the GPU, under split backward (ZB-H1, DualPipeV's fused F&B on two CUDA streams) and with
the tied embedding's two sharded copies summed as DTensors. Meshes of several GPUs, with
NCCL between them, run through `pipecc run --mesh` in the shell script.

    python benchmarks/gpu_mesh_check.py [--device cpu]    # exit 1 when a case fails
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pipecc.runtime import PipelineRuntime, RuntimeConfig, shared_parameters
from pipecc.runtime.tools.reference import Options, gradients, reference_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from pipecc.api import compile_schedule
from pipecc.driver.mesh import MeshOptions, place_mesh
from pipecc.ir.ops import StageAction, StageOp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))  # the tests' call counter and FSDP's names
from discovery_cases import Counts, counting  # noqa: E402
from mesh_cases import FSDP_COLLECTIVES  # noqa: E402

CASES = (("zb_h1", 4), ("dualpipev", 4), ("1f1b", 4))  # schedule, M (P = 1)
TOLERANCE = 1e-5  # max relative gradient difference
ROWS = 2  # rows per microbatch


def _gpt() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_mesh_gpt", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_case(schedule: str, microbatches: int, device: torch.device) -> dict[str, Any]:
    """One step of `schedule` (P=1) on FSDP2 stages against one process without FSDP."""
    gpt = _gpt()
    config = gpt.GPTConfig(vocab=64, dim=32, heads=2, seq=16, layers=0, tied=True)
    program = compile_schedule(schedule, ranks=1, microbatches=microbatches)
    program = place_mesh(program, MeshOptions("dp_shard=1", fsdp=True))
    num_stages = program.placement.num_stages(0)
    stages = [s.to(device) for s in gpt.build_stages(num_stages, config)]
    reference = [s.to(device) for s in gpt.build_stages(num_stages, config)]
    runtime = _runtime(program, stages, gpt.loss_fn, device)
    batch = gpt.make_batch(ROWS * microbatches, seed=0, config=config)
    counted = Counts()
    with counting(counted, ((dist, FSDP_COLLECTIVES),)):
        runtime.step(*(t.to(device) for t in batch))
    counts = [counted.calls.get(name, 0) for name in FSDP_COLLECTIVES]
    loss = float(runtime.global_loss())
    want_loss, want = reference_step(
        reference, batch, microbatches, gpt.loss_fn, Options(device=device)
    )
    got = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in gradients(stages).items()
    }
    worst = max(
        float((got[k].float() - w.float()).abs().max()) / (float(w.abs().max()) or 1.0)
        for k, w in want.items()
    )
    ops = [op for op in program.ranks[0] if isinstance(op, StageOp)]
    actions = [sum(op.kind is kind for op in ops)
               for kind in (StageAction.UNSHARD, StageAction.REDUCE_GRAD)]  # fmt: skip
    return {"case": (schedule, microbatches), "loss": (loss, want_loss), "grad_rel": worst,
            "collectives": counts, "actions": actions, "device": str(device)}  # fmt: skip


def _runtime(program: Any, stages: list[Any], loss_fn: Any, device: torch.device) -> Any:
    """Every stage FSDP2 over a dp_shard dimension of one, the tie found before."""
    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("pp", "dp_shard"))
    shared = shared_parameters(stages)  # before FSDP gives each stage its own copy
    for stage in stages:
        fully_shard(stage, mesh=mesh["dp_shard"], reshard_after_forward=False)
    modules = {slot.chunk: stages[slot.stage] for slot in program.placement.chunks(0)}
    settings = RuntimeConfig(device=device, shared=shared, mesh=mesh)
    return PipelineRuntime(program, modules, loss_fn=loss_fn, config=settings)


def verdict(result: dict[str, Any]) -> tuple[bool, str]:
    """Whether a case passed, and its line."""
    schedule, microbatches = result["case"]
    loss, want = result["loss"]
    gathers, reduces = result["collectives"]
    unshards, reduce_grads = result["actions"]
    ok = (
        result["grad_rel"] <= TOLERANCE
        and abs(loss - want) <= TOLERANCE * abs(want)
        and gathers <= unshards
        and reduces <= reduce_grads
    )
    return ok, (
        f"{schedule} P=1 M={microbatches} FSDP2 (dp_shard=1, tied) on {result['device']}: "
        f"loss {loss:.6f} (reference {want:.6f}), max rel grad diff {result['grad_rel']:.2e}, "
        f"all-gathers {gathers} (UNSHARDs {unshards}), reduce-scatters {reduces} "
        f"(REDUCE_GRADs {reduce_grads}): {'ok' if ok else 'FAILED'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    failed = 0
    try:
        for schedule, microbatches in CASES:
            ok, line = verdict(run_case(schedule, microbatches, device))
            print(line, flush=True)
            failed += not ok
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
