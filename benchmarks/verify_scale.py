"""Verification time at scale: `pipecc verify` vs torch's `_simulate_comms_compute`.

    .venv/bin/python benchmarks/verify_scale.py                        # P=64, M=1024, V=2
    .venv/bin/python benchmarks/verify_scale.py --torch-microbatches 256

For DualPipeV and interleaved 1F1B (V=2) it compiles the schedule (not timed), then times
`pipecc.verify.verify` under the nccl model: every check (waits, matching, routes,
placement, coverage, data dependencies, the replay that decides deadlock, memory peaks). It
prints instructions, seconds and pipecc's scaling from M/4 to M, and at the end the peak
memory of the whole process.

torch's simulator decides only eager semantics (unit steps, sends never block) and rejects
fused OVERLAP_F_B actions, so it cannot check DualPipeV: the torch comparison runs on
interleaved 1F1B, on the schedule torch itself builds (its generator and lowering, not timed:
quadratic in M, a minute or more at M=1024). pipecc also verifies that very torch-built
schedule (read as action CSV) so that both tools check the same program. Ratios are
measured in the same run.
"""

from __future__ import annotations

import csv
import io
import resource
from typing import Any

from scale import compile_case, median_time, parse_args, run
from torch_baseline import TORCH_CANNOT, torch_lowered, torch_simulate

from pipecc.interop import torch_csv
from pipecc.ir.program import Program
from pipecc.verify import Options, Report, verify

CASES = (("dualpipev", {}), ("interleaved_1f1b", {"V": 2}))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _time_verify(program: Program, repeat: int) -> tuple[float, Report]:
    seconds, report = median_time(repeat, lambda: verify(program, Options()))
    assert report.ok, [str(v) for v in report.violations]
    return seconds, report


def _torch_program(lowered: Any) -> Program:
    """torch's lowered schedule as pipecc reads it from action CSV."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(
        [str(a) for a in lowered[r] if a is not None] for r in sorted(lowered)
    )
    return torch_csv.loads(out.getvalue(), "torch.csv").program


def _row(name: str, ranks: int, microbatches: int, defines: dict[str, int], repeat: int) -> float:
    program = compile_case(name, defines, ranks, microbatches)
    seconds, _ = _time_verify(program, repeat)
    count = program.num_instructions()
    print(
        f"  {name:18s} pipecc {seconds:6.2f} s  {count:>9,} instructions  "
        f"({seconds / count * 1e6:.2f} µs each)"
    )
    quarter = compile_case(name, defines, ranks, microbatches // 4)
    small, _ = _time_verify(quarter, repeat)
    print(
        f"  {'':18s} scaling M/4 → M: ×{seconds / small:.2f} time for "
        f"×{count / quarter.num_instructions():.2f} instructions"
    )
    return seconds


def _torch_row(name: str, ranks: int, microbatches: int, repeat: int) -> None:
    lowered_seconds, lowered, mapping, stages = torch_lowered(name, ranks, microbatches)
    torch_seconds, steps = torch_simulate(lowered, mapping, stages)
    program = _torch_program(lowered)
    ours, _ = _time_verify(program, repeat)
    print(
        f"  {'':18s} torch  {torch_seconds:6.2f} s  _simulate_comms_compute at M={microbatches} "
        f"({steps} unit steps; building its schedule took {lowered_seconds:.0f} s, not timed)"
    )
    print(
        f"  {'':18s} pipecc {ours:6.2f} s  verifying that torch-built schedule "
        f"({program.num_instructions():,} instructions) → torch / pipecc = "
        f"{torch_seconds / ours:.1f}×"
    )


def main() -> None:
    args = parse_args(__doc__)
    ranks, microbatches = args.ranks, args.microbatches
    print(
        f"verify at P={ranks}, M={microbatches}, V=2, nccl, every check (median of {args.repeat})"
    )
    for name, defines in CASES:
        seconds = _row(name, ranks, microbatches, defines, args.repeat)
        if args.skip_torch:
            continue
        if name in TORCH_CANNOT:
            print(f"  {'':18s} torch  -- ({TORCH_CANNOT[name]})")
            continue
        tm = args.torch_microbatches or microbatches
        if tm != microbatches:
            print(
                f"  {'':18s} (torch compared at M={tm}; pipecc at M={microbatches} took "
                f"{seconds:.2f} s)"
            )
        _torch_row(name, ranks, tm, args.repeat)
    print(f"peak memory of this process (compiler, programs, verifier, torch): {_rss_mb():.0f} MB")


if __name__ == "__main__":
    run(main)
