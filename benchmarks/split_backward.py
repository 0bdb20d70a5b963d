"""Split backward: is I + W as cheap as B? (target: I + W ≤ 1.15 × B for the MLP stage)

    .venv/bin/python benchmarks/split_backward.py [--device cuda] [--rounds 15]

The stage is 4 blocks of Linear(H, H)+GELU on 32 rows (a middle stage: its input needs a
gradient), one thread. A round is two steps of 4 microbatches each, gradients zeroed first
as in training, all forwards first (untimed): one step with a full backward per microbatch
(B = `full_backward`), one with the backward split (every I = `input_backward`: graph walk,
anchor hooks, the input-gradient pass; then every W = `WeightGrad.run()`: the
weight-gradient pass). Figures per microbatch: medians over the rounds, and the
smallest per-round ratio (the least disturbed by other load on the machine). H=16 shows the
fixed cost of the split (graph walk, one engine call per Linear in W). The aten matmul counts
show that W does not recompute the input-gradient path: I runs one matmul per Linear, W
one, B two.

The table is printed twice on CPU: with glibc malloc as it is, and with its mmap and trim
thresholds raised (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), as `pipecc run` starts
its ranks (docs/performance.md): without it, every weight-gradient block of MBs is unmapped
when freed and faulted in again at the next allocation, which costs the split (one engine
call per Linear in W) more than the single call of B.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipecc.runtime.split_backward import full_backward, input_backward  # noqa: E402

ROWS = 32
BLOCKS = 4
MICROBATCHES = 4
# glibc malloc returns blocks of MBs to the OS at once and faults them in again at the next
# allocation; W allocates one weight-gradient block per Linear per engine call.
TUNED = "MALLOC_MMAP_THRESHOLD_"
MALLOC_TUNING = {TUNED: str(1 << 28), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def stage(hidden: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(BLOCKS) for m in (nn.Linear(hidden, hidden), nn.GELU())]
    return nn.Sequential(*layers).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forwards(module: nn.Module, xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every microbatch's forward first, as in a pipeline (the backward of a microbatch
    never runs right after its own forward, so no variant finds its data hot in cache)."""
    module.zero_grad(set_to_none=True)
    leaves = [x.detach().requires_grad_(True) for x in xs]
    return [(leaf, module(leaf)) for leaf in leaves]


def step_b(module: nn.Module, xs: list[torch.Tensor], g: torch.Tensor) -> float:
    """One step with a full backward (B) per microbatch; ms spent in the backwards."""
    graphs = forwards(module, xs)
    sync(g.device)
    start = time.perf_counter()
    for leaf, out in graphs:
        full_backward((out,), (g,), (leaf,))
    sync(g.device)
    return (time.perf_counter() - start) * 1e3


def step_iw(module: nn.Module, xs: list[torch.Tensor], g: torch.Tensor, ids: set[int]) -> float:
    """The same step split: every microbatch's I, then every W (as a zero-bubble schedule)."""
    graphs = forwards(module, xs)
    sync(g.device)
    start = time.perf_counter()
    pending = [input_backward((out,), (g,), (leaf,), ids)[1] for leaf, out in graphs]
    for weight in pending:
        weight.run()
    sync(g.device)
    return (time.perf_counter() - start) * 1e3


def measure(hidden: int, device: torch.device, rounds: int) -> tuple[float, float, float]:
    """Medians of B and I + W per microbatch, and the smallest per-round ratio."""
    module = stage(hidden, device)
    ids = {id(p) for p in module.parameters()}
    xs = [torch.randn(ROWS, hidden, device=device) for _ in range(MICROBATCHES)]
    g = torch.randn(ROWS, hidden, device=device)
    b_times, iw_times = [], []
    for round_ in range(rounds + 2):
        b, iw = step_b(module, xs, g), step_iw(module, xs, g, ids)
        if round_ >= 2:  # warm-up
            b_times.append(b / MICROBATCHES)
            iw_times.append(iw / MICROBATCHES)
    best = min(iw / b for b, iw in zip(b_times, iw_times, strict=True))
    return statistics.median(b_times), statistics.median(iw_times), best


def matmul_counts(device: torch.device) -> tuple[int, int, int]:
    module = stage(64, device)
    ids = {id(p) for p in module.parameters()}
    x = torch.randn(ROWS, 64, device=device, requires_grad=True)
    counts = [CountOps() for _ in range(3)]
    out = module(x)
    with counts[0]:
        full_backward((out,), (torch.ones_like(out),), (x,))
    out = module(x)
    with counts[1]:
        _, weight = input_backward((out,), (torch.ones_like(out),), (x,), ids)
    with counts[2]:
        weight.run()
    return counts[0].ops["mm"], counts[1].ops["mm"], counts[2].ops["mm"]


def table(device: torch.device, rounds: int) -> None:
    allocator = "tuned" if TUNED in os.environ else "default"
    for hidden in (16, 512, 1024, 2048):
        full, split, best = measure(hidden, device, rounds)
        print(f"{device.type:6} {allocator:9} {hidden:5} {full:8.3f} {split:8.3f} "
              f"{split / full:8.3f} {best:10.3f}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--table-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    if args.table_only:
        table(device, args.rounds)
        return
    b, i, w = matmul_counts(device)
    print(f"matmuls for {BLOCKS} Linear layers: B {b}, I {i}, W {w} (I + W = {i + w})")
    print(f"{'device':6} {'allocator':9} {'H':>5} {'B ms':>8} {'I+W ms':>8} {'(I+W)/B':>8} "
          f"{'best round':>10}", flush=True)  # fmt: skip
    table(device, args.rounds)
    if device.type == "cpu" and TUNED not in os.environ:  # again, with glibc malloc tuned
        env = dict(os.environ, **MALLOC_TUNING)
        command = [sys.executable, __file__, "--table-only", "--rounds", str(args.rounds)]
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
