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
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from pipecc.api import compile_schedule  # noqa: E402

CASES = (
    ("dualpipev", {}, "ScheduleDualPipeV", 2, "v"),
    ("interleaved_1f1b", {"V": 2}, "ScheduleInterleaved1F1B", 2, "loop"),
)


def _best_of(repeat: int, work: Callable[[], object]) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _pipecc(name: str, defines: dict[str, int], ranks: int, microbatches: int, repeat: int
            ) -> tuple[float, int]:
    path = ROOT / "schedules" / f"{name}.sched"
    seconds, program = _best_of(
        repeat,
        lambda: compile_schedule(path, ranks=ranks, microbatches=microbatches, defines=defines),
    )
    return seconds, program.num_instructions()  # type: ignore[attr-defined]


def _torch(torch_name: str, chunks: int, style: str, ranks: int, microbatches: int
           ) -> tuple[float, int]:
    from torch.distributed.pipelining import schedules  # noqa: PLC0415  (optional, heavy)
    from torch.distributed.pipelining._utils import (  # noqa: PLC0415
        generate_stage_to_rank_mapping,
    )
    from torch_oracle import bare_schedule  # noqa: PLC0415

    start = time.perf_counter()
    obj = bare_schedule(torch_name, ranks, microbatches, chunks)
    order = {}
    for rank in range(ranks):
        obj.rank = rank
        order[rank] = obj._calculate_single_rank_operations(rank)
    mapping = generate_stage_to_rank_mapping(ranks, ranks * chunks, style=style)
    lowered = {
        rank: schedules._add_reduce_grad(schedules._add_unshard_reshard(actions), microbatches)
        for rank, actions in order.items()
    }
    lowered = schedules._add_send_recv(
        lowered, stage_to_rank=lambda s: mapping[s], num_stages=ranks * chunks
    )
    seconds = time.perf_counter() - start
    return seconds, sum(len(actions) for actions in lowered.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--torch-microbatches", type=int, default=None,
                        help="run torch at this M instead (it is quadratic in M)")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    P, M = args.ranks, args.microbatches
    print(f"compile at P={P}, M={M} (median of {args.repeat})")
    for name, defines, torch_name, chunks, style in CASES:
        seconds, count = _pipecc(name, defines, P, M, args.repeat)
        print(f"  {name:18s} pipecc {seconds:7.2f} s  {count:>9,} instructions  "
              f"{count / seconds / 1e6:5.2f} M instr/s")
        quarter, _ = _pipecc(name, defines, P, M // 4, args.repeat)
        print(f"  {'':18s} scaling M/4 → M: ×{seconds / quarter:.2f} time (linear: ×4)")
        if args.skip_torch:
            continue
        tm = args.torch_microbatches or M
        torch_seconds, torch_count = _torch(torch_name, chunks, style, P, tm)
        ours = seconds if tm == M else _pipecc(name, defines, P, tm, args.repeat)[0]
        print(f"  {'':18s} torch  {torch_seconds:7.2f} s  {torch_count:>9,} actions at M={tm}"
              f"  → torch / pipecc = {torch_seconds / ours:.1f}×")


if __name__ == "__main__":
    main()
