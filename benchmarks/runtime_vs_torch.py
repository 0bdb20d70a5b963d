"""pipecc's runtime against torch.distributed.pipelining, on the same model and schedule.

    .venv/bin/python benchmarks/runtime_vs_torch.py            # the full table (~5 min)
    .venv/bin/python benchmarks/runtime_vs_torch.py --quick    # one configuration per schedule

P=2 ranks on gloo, one thread per rank; the model is L=8 blocks of Linear(H, H)+GELU cut
into equal stages (2 for GPipe/1F1B, 4 for interleaved 1F1B (V=2), ZB-V and DualPipeV), MSE
loss, 32 rows per microbatch. For every (schedule, H, M) both runtimes are built on copies of
the same weights and stepped alternately, torch first then pipecc, in the same processes; a
step is timed on rank 0 between a barrier before and a barrier after; the figure is the
median of the timed steps after the warm-up. `ratio` = pipecc / torch (target ≤ 0.9).
`pipecc` runs the default program (valid on every backend); `early` the same schedule
compiled with `--comm-policy early-recv` (every receive posted at the start of the step: the
policy for gloo, docs/compile.md); `aligned` the default compiled with `--align` for costs the
runtime profiled.
`bound` is the compute bound, timed in the same rounds: every rank runs the forward and
backward of its own stages for all M microbatches with plain autograd and no messages,
between the same barriers (so the slowest rank counts); `eff` = bound / step time, and `eff
best` uses the fastest of the pipecc programs (pipecc, early, aligned) — one figure picked
from three, so compare it with `eff torch` knowing that.

The second table is the per-op overhead with a tiny model (H=16, L=8, 1F1B, M=16): (step
time − the rank's plain-autograd time for the same ops) / compute ops per rank, on one
process (P=1) and at P=2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipecc.runtime import PipelineRuntime, Recorder, RuntimeConfig, infer_boundaries  # noqa: E402
from pipecc.runtime.profile import comm_costs, compute_costs  # noqa: E402
from pipecc.runtime.spawn import spawn  # noqa: E402

from pipecc.api import compile_schedule  # noqa: E402
from pipecc.ir.ops import Compute, Fused  # noqa: E402
from pipecc.passes.align_comms import align_comms  # noqa: E402
from pipecc.passes.insert_comms import (  # noqa: E402
    EARLY_RECV,
    POLICIES,
    POLICY,
    insert_comms,
    strip_comms,
)
from pipecc.semantics import CommModel  # noqa: E402
from pipecc.semantics.costs import parse_cost_flag  # noqa: E402

ROWS = 32
BLOCKS = 8
# schedule name -> (torch class, stages per rank, placement style)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


@dataclass(frozen=True)
class Config:
    schedule: str
    hidden: int
    microbatches: int
    steps: int
    warmup: int
    ranks: int = 2
    align: bool = True


def build(hidden: int, stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    per = BLOCKS // stages
    return [
        nn.Sequential(*(m for _ in range(per) for m in (nn.Linear(hidden, hidden), nn.GELU())))
        for _ in range(stages)
    ]


def stage_ids(name: str, rank: int, ranks: int) -> list[int]:
    _, per_rank, style = SCHEDULES[name]
    if per_rank == 1:
        return [rank]
    if style == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + c * ranks for c in range(per_rank)]


def make_torch(config: Config, stages: list[nn.Module], rank: int) -> Any:
    from torch.distributed.pipelining import PipelineStage, schedules

    cls_name, per_rank, _ = SCHEDULES[config.schedule]
    count = len(stages)
    # Static shapes: torch's dynamic inference exchanges pickled objects (needs numpy).
    data = torch.empty(ROWS, config.hidden)
    activation = torch.empty(ROWS, config.hidden, requires_grad=True)
    mine = [
        PipelineStage(
            stages[s],
            s,
            count,
            torch.device("cpu"),
            input_args=data if s == 0 else activation,
            output_args=activation,
        )
        for s in stage_ids(config.schedule, rank, config.ranks)
    ]
    cls = getattr(schedules, cls_name)
    loss = nn.functional.mse_loss
    if per_rank == 1:
        return cls(mine[0], config.microbatches, loss_fn=loss)
    return cls(mine, config.microbatches, loss_fn=loss)


def make_pipecc(
    config: Config, stages: list[nn.Module], rank: int, policy: str = POLICY
) -> PipelineRuntime:
    program = compile_schedule(
        config.schedule, ranks=config.ranks, microbatches=config.microbatches
    )
    if policy != POLICY:
        program = insert_comms(strip_comms(program), placement=POLICIES[policy])
    modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
    sample = torch.zeros(ROWS, config.hidden)
    return PipelineRuntime(
        program, modules, infer_boundaries(stages, sample), config=RuntimeConfig()
    )


def torch_step(
    schedule: Any, rank: int, ranks: int, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    x, y = batch
    first, last = stage_ids_first_last(schedule, rank, ranks)
    kwargs: dict[str, Any] = {}
    if last:
        kwargs["target"] = y
        kwargs["losses"] = []
    if first:
        schedule.step(x, **kwargs)
    else:
        schedule.step(**kwargs)


def stage_ids_first_last(schedule: Any, rank: int, ranks: int) -> tuple[bool, bool]:
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return any(s.is_first for s in stages), any(s.is_last for s in stages)


def timed(fn: Any, modules: list[nn.Module]) -> float:
    for module in modules:
        module.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return (time.perf_counter() - start) * 1e3


def compute_only(config: Config, stages: list[nn.Module], rank: int) -> Any:
    """This rank's arithmetic of one step without the pipeline: forward and backward of each
    of its stages for every microbatch, plain autograd, no messages. Timed between the same
    barriers as a step, it is the compute bound measured under the same load."""
    mine = [stages[s] for s in stage_ids(config.schedule, rank, config.ranks)]
    x = torch.randn(ROWS, config.hidden)

    def run() -> None:
        for module in mine:
            for _ in range(config.microbatches):
                out = module(x.detach().requires_grad_(True))
                out.backward(torch.ones_like(out))

    return run


def aligned(runtime: PipelineRuntime, stages: list[nn.Module], batch: Any) -> PipelineRuntime:
    """The same schedule with its comm ops placed for measured costs (`compile --align`
    under the rendezvous model, gloo's): two profiled steps of the default program give the
    median F, B, I, W, FB and message latency; the ranks average them with an all-reduce, so
    every rank aligns with the same costs and gets the same program."""
    recorder = Recorder()
    for step in range(2):
        recorder.step = step
        for module in runtime.modules.values():
            module.zero_grad(set_to_none=True)
        runtime.step(*batch, recorder=recorder)
    top, _ = compute_costs([recorder])
    top.update(comm_costs([recorder]))
    keys = ("F", "B", "I", "W", "FB", "FI", "comm")
    values = torch.tensor([top.get(k, -1.0) for k in keys], dtype=torch.float64)
    present = (values >= 0).to(torch.float64)
    values = values.clamp(min=0)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    dist.all_reduce(present, op=dist.ReduceOp.SUM)
    pairs = zip(keys, values.tolist(), present.tolist(), strict=True)
    costs = ",".join(f"{k}={v / n:.4f}" for k, v, n in pairs if n > 0)
    program = align_comms(runtime.program, costs=parse_cost_flag(costs), model=CommModel.RENDEZVOUS)
    sample = torch.zeros(ROWS, stages[0][0].in_features)
    return PipelineRuntime(program, runtime.modules, infer_boundaries(stages, sample))


def run_config(config: Config, rank: int) -> dict[str, Any]:
    _, per_rank, _ = SCHEDULES[config.schedule]
    count = config.ranks * per_rank
    torch_stages, pipecc_stages = build(config.hidden, count), build(config.hidden, count)
    mine = stage_ids(config.schedule, rank, config.ranks)
    mine_t, mine_p = [torch_stages[s] for s in mine], [pipecc_stages[s] for s in mine]
    generator = torch.Generator().manual_seed(1)
    rows = ROWS * config.microbatches
    batch = (
        torch.randn(rows, config.hidden, generator=generator),
        torch.randn(rows, config.hidden, generator=generator),
    )
    baseline = make_torch(config, torch_stages, rank)
    runtime = make_pipecc(config, pipecc_stages, rank)
    early = make_pipecc(config, pipecc_stages, rank, EARLY_RECV.policy)
    runners = {
        "torch": (lambda: torch_step(baseline, rank, config.ranks, batch), mine_t),
        "pipecc": (lambda: runtime.step(*batch), mine_p),
        "early": (lambda: early.step(*batch), mine_p),
    }
    if config.align:
        tuned = aligned(runtime, pipecc_stages, batch)
        runners["aligned"] = (lambda: tuned.step(*batch), mine_p)
    runners["bound"] = (compute_only(config, pipecc_stages, rank), mine_p)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(config.warmup + config.steps):
        for name, (run, modules) in runners.items():  # alternately, in the same processes
            elapsed = timed(run, modules)
            if step >= config.warmup:
                times[name].append(elapsed)
    result: dict[str, Any] = {name: statistics.median(t) for name, t in times.items()}
    result["ops"] = sum(1 for _, instr, _ in runtime.plan if type(instr) in (Compute, Fused))
    return result


def worker(rank: int, world: int, configs: list[Config]) -> list[dict[str, Any]]:
    return [run_config(config, rank) for config in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=1024, M=8 only, 5 steps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=list(SCHEDULES), help="schedule names")
    args = parser.parse_args()
    hiddens, counts = ((1024,), (8,)) if args.quick else ((512, 1024), (8, 16))
    steps = 5 if args.quick else args.steps
    configs = [Config(name, h, m, steps, 3) for name in args.only for h in hiddens for m in counts]
    results = spawn(worker, 2, configs, timeout=1200)
    print(
        f"{'schedule':17} {'H':>5} {'M':>3} {'torch':>7} {'pipecc':>7} {'ratio':>6} "
        f"{'early':>7} {'ratio':>6} {'aligned':>7} {'ratio':>6} {'bound':>7} {'eff torch':>9} "
        f"{'eff best':>10}"
    )
    for index, config in enumerate(configs):
        r0 = results[0][index]
        bound = r0["bound"]
        best = min(r0["pipecc"], r0["early"], r0.get("aligned", r0["pipecc"]))
        print(
            f"{config.schedule:17} {config.hidden:5} {config.microbatches:3} "
            f"{r0['torch']:7.1f} {r0['pipecc']:7.1f} {r0['pipecc'] / r0['torch']:6.2f} "
            f"{r0['early']:7.1f} {r0['early'] / r0['torch']:6.2f} "
            f"{r0['aligned']:7.1f} {r0['aligned'] / r0['torch']:6.2f} "
            f"{bound:7.1f} {bound / r0['torch']:9.2f} {bound / best:10.2f}",
            flush=True,
        )
    overhead()


def overhead() -> None:
    """Per compute op, beyond the math: tiny model, one process and two."""
    for ranks in (1, 2):
        config = Config("1f1b", 16, 16, 20, 5, ranks=ranks, align=False)
        results = spawn(worker, ranks, [config], timeout=600)
        r0 = results[0][0]
        ops = r0["ops"]
        math = r0["bound"]
        per_torch = (r0["torch"] - math) / ops * 1e3
        per_pipecc = (r0["pipecc"] - math) / ops * 1e3
        per_early = (r0["early"] - math) / ops * 1e3
        print(
            f"per-op overhead, H=16, P={ranks}, 1F1B M=16 ({ops} compute ops per rank): "
            f"torch {per_torch:.0f} µs, pipecc {per_pipecc:.0f} µs, "
            f"ratio {per_pipecc / per_torch:.2f}; early-recv {per_early:.0f} µs, "
            f"ratio {per_early / per_torch:.2f}"
        )


if __name__ == "__main__":
    main()
