"""Compile time at scale: pipecc vs torch.distributed.pipelining's generator + lowering.

    .venv/bin/python benchmarks/compile_scale.py                 # P=64, M=1024, V=2
    .venv/bin/python benchmarks/compile_scale.py --torch-microbatches 256   # quicker torch

For DualPipeV and interleaved 1F1B it prints pipecc's compile time (.sched → lowered
program with every send, recv and wait), its instructions per second, the time torch takes
to build `pipeline_order_with_comms` for the same schedule (its generator, then the lowering
`_PipelineScheduleRuntime` runs: `_add_unshard_reshard`, `_add_reduce_grad`,
`_add_send_recv`), and the ratio; then pipecc's scaling from M/4 to M microbatches (linear
means ×4; the target is ≤ ×4.5). Machines are noisy: compare the ratios, measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from torch_baseline import torch_lowered

from pipecc.api import compile_schedule

ROOT = Path(__file__).resolve().parent.parent
CASES = (("dualpipev", {}), ("interleaved_1f1b", {"V": 2}))


def _best_of(repeat: int, work: Callable[[], object]) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _pipecc(
    name: str, defines: dict[str, int], ranks: int, microbatches: int, repeat: int
) -> tuple[float, int]:
    path = ROOT / "schedules" / f"{name}.sched"
    seconds, program = _best_of(
        repeat,
        lambda: compile_schedule(path, ranks=ranks, microbatches=microbatches, defines=defines),
    )
    return seconds, program.num_instructions()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument(
        "--torch-microbatches",
        type=int,
        default=None,
        help="run torch at this M instead (it is quadratic in M)",
    )
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    P, M = args.ranks, args.microbatches
    compile_schedule(ROOT / "schedules" / "1f1b.sched", ranks=2, microbatches=2)  # warm-up
    print(f"compile at P={P}, M={M} (median of {args.repeat})")
    for name, defines in CASES:
        seconds, count = _pipecc(name, defines, P, M, args.repeat)
        print(
            f"  {name:18s} pipecc {seconds:7.2f} s  {count:>9,} instructions  "
            f"{count / seconds / 1e6:5.2f} M instr/s"
        )
        quarter, _ = _pipecc(name, defines, P, M // 4, args.repeat)
        print(f"  {'':18s} scaling M/4 → M: ×{seconds / quarter:.2f} time (linear: ×4)")
        if args.skip_torch:
            continue
        tm = args.torch_microbatches or M
        torch_seconds, lowered, _, _ = torch_lowered(name, P, tm)
        torch_count = sum(len(actions) for actions in lowered.values())
        ours = seconds if tm == M else _pipecc(name, defines, P, tm, args.repeat)[0]
        print(
            f"  {'':18s} torch  {torch_seconds:7.2f} s  {torch_count:>9,} actions at M={tm}"
            f"  → torch / pipecc = {torch_seconds / ours:.1f}×"
        )


if __name__ == "__main__":
    main()
