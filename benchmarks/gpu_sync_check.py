"""No host synchronisation of any kind in a warm step on CUDA, and NCCL's coalesced posting.

    python3 -u benchmarks/gpu_sync_check.py     # benchmarks/gpu_check.sh runs it

On one GPU: programs compiled for P=1 (every stage on the one rank: V-shape hand-offs and
fused F&B on two CUDA streams; no messages); with two GPUs or more, P=2 over NCCL too, whose
grouped sends and receives go through `batch_isend_irecv`'s coalescing branch. Each case is
an MLP (8 blocks of Linear(64, 64) + GELU, 4 rows a microbatch) under the default comm
policy: two warm-up steps, then one step behind about two seconds of GPU work queued on the
current stream (`torch.cuda._sleep`) that must return while that work still runs (a CUDA
event recorded after it is not yet complete when the step returns). Any wait of the host for
the device in the step (`torch.cuda.synchronize()`, an event or stream synchronize, `.item()`,
`.cpu()`, a blocking copy, a distributed op that blocks) would have let the queued work
finish: this sees every kind, where `torch.cuda.set_sync_debug_mode` sees only some (not
`synchronize()`, event syncs or distributed ops). The step also runs under that mode, which
names the call for the kinds it sees. The warm step must run the plan bound on the first
step (one static plan per shape signature: one binding in all, the same receive buffers
before and after it). Prints one line per case; exits 1 if any case waited for the device,
failed, bound its plan again, or (P=2) posted no coalesced group.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipecc.runtime import PipelineRuntime, RuntimeConfig, infer_boundaries  # noqa: E402
from pipecc.runtime.engine.steps import PostStep  # noqa: E402
from pipecc.runtime.tools.spawn import spawn  # noqa: E402

from pipecc.api import compile_schedule  # noqa: E402
from pipecc.ir.ops import Fused  # noqa: E402

HIDDEN, ROWS, BLOCKS, WARM = 64, 4, 8, 2
Guard = Callable[[], AbstractContextManager[object]]


@dataclass(frozen=True)
class Case:
    schedule: str
    ranks: int
    microbatches: int


ONE_GPU = (Case("dualpipev", 1, 6), Case("zbv", 1, 4), Case("1f1b", 1, 3))
TWO_GPUS = (Case("1f1b", 2, 4), Case("zbv", 2, 4), Case("dualpipev", 2, 5))


BUSY_SECONDS = 2.0  # GPU work queued before the measured step


class HostSync(RuntimeError):
    """The host waited for the device during the measured step."""


def sleep_cycles(seconds: float) -> int:
    """How many cycles of `torch.cuda._sleep` keep the current GPU busy about `seconds`."""
    cycles = 20_000_000
    torch.cuda._sleep(1000)  # the kernel loaded
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1e3))


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """The block must return while about two seconds of GPU work queued before it still
    run (module docstring); the sync debug mode raises inside for the calls it sees."""
    cycles = sleep_cycles(BUSY_SECONDS)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    queued = torch.cuda.Event()
    queued.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    still_busy = not queued.query()  # a query does not wait
    torch.cuda.synchronize()
    if not still_busy:
        raise HostSync(
            f"the {BUSY_SECONDS:g} s of GPU work queued before the step had finished when "
            "it returned: the host waited for the device in the step (a synchronize, an "
            "event or stream sync, .item(), .cpu(), a blocking copy or a blocking collective)"
        )


@contextlib.contextmanager
def counted_groups() -> Iterator[list[int]]:
    """The size of every group posted through `batch_isend_irecv` meanwhile."""
    sizes: list[int] = []
    batch = dist.batch_isend_irecv

    def counted(ops: list[dist.P2POp]) -> list[dist.Work]:
        sizes.append(len(ops))
        return batch(ops)

    dist.batch_isend_irecv = counted
    try:
        yield sizes
    finally:
        dist.batch_isend_irecv = batch


def _stages(count: int, device: torch.device) -> list[nn.Module]:
    torch.manual_seed(0)
    per = BLOCKS // count
    blocks = [(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(count * per)]
    return [nn.Sequential(*(m for b in blocks[s * per : (s + 1) * per] for m in b)).to(device)
            for s in range(count)]  # fmt: skip


def run_case(case: Case, rank: int, device: torch.device, guard: Guard) -> dict[str, Any]:
    """Build the case on this rank, step it `WARM` times, then once inside `guard`; what
    happened (error: the exception's last frames, None when the step passed)."""
    program = compile_schedule(case.schedule, ranks=case.ranks, microbatches=case.microbatches)
    stages = _stages(program.placement.num_stages(0), device)
    modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
    generator = torch.Generator().manual_seed(1)
    shape = (ROWS * case.microbatches, HIDDEN)
    x, y = (torch.randn(shape, generator=generator).to(device) for _ in range(2))
    config = RuntimeConfig(device=device)
    runtime = PipelineRuntime(program, modules, infer_boundaries(stages, x[:ROWS]), config=config)
    fused = sum(1 for i in program.ranks[rank] if type(i) is Fused)
    error, buffers = None, []
    with counted_groups() as groups:
        try:
            for step in range(WARM + 1):
                for module in modules.values():
                    module.zero_grad(set_to_none=True)
                with guard() if step == WARM else contextlib.nullcontext():
                    runtime.step(x, y)
                buffers.append(receive_buffers(runtime))
        except Exception:  # noqa: BLE001  (reported per case, the others still run)
            error = "".join(traceback.format_exc(limit=-6).splitlines(keepends=True)[-14:])
    # plain values only: the result travels back from a spawned process
    case_fields = (case.schedule, case.ranks, case.microbatches)
    reused = len(buffers) == WARM + 1 and all(b == buffers[0] for b in buffers)
    plan = {"bindings": runtime.plans.binder.count, "reused": reused}
    return {"case": case_fields, "fused": fused, "groups": list(groups), "error": error, **plan}


def receive_buffers(runtime: PipelineRuntime) -> list[int]:
    """The id of every receive buffer of the training plan in use."""
    plan = runtime.plans.bound(training=True)
    steps = () if plan is None else plan.steps
    return [
        id(tensor)
        for step in steps
        if isinstance(step, PostStep) and step.buffers is not None
        for tensor in step.buffers
    ]


def worker(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    return [run_case(case, rank, device, no_host_sync) for case in cases]


def verdict(result: dict[str, Any]) -> tuple[bool, str]:
    """(passed, its line) for one rank's result."""
    case = Case(*result["case"])
    name = f"{case.schedule} P={case.ranks} M={case.microbatches}"
    coalesced = sum(1 for size in result["groups"] if size > 1)
    facts = f"{result['fused']} fused F&B, {coalesced} coalesced groups"
    if result["error"] is not None:
        return False, f"{name}: FAILED ({facts}):\n{result['error']}"
    if case.ranks > 1 and coalesced == 0:
        return False, f"{name}: FAILED: no group went through batch_isend_irecv ({facts})"
    if result["bindings"] != 1 or not result["reused"]:
        return False, (
            f"{name}: FAILED: the plan was bound {result['bindings']} times, receive buffers "
            f"{'kept' if result['reused'] else 'replaced'} ({facts})"
        )
    return True, f"{name}: no host sync of any kind in the warm step ({facts})"


def main() -> int:
    gpus = torch.cuda.device_count()
    if gpus < 1:
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    runs = [(1, ONE_GPU)] + ([(2, TWO_GPUS)] if gpus >= 2 else [])
    passed = True
    for ranks, cases in runs:
        found = spawn(worker, ranks, list(cases), backend="nccl", timeout=90.0)
        for rank, results in enumerate(found):
            for result in results:
                ok, line = verdict(result)
                passed = passed and ok
                print(f"rank {rank}: {line}", flush=True)
    print("sync check: " + ("ok" if passed else "FAILED"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
