"""The alignment pass against the default comm policy, on every bundled schedule.

    .venv/bin/python benchmarks/align.py                 # P=4 and 8, M=2P, nccl
    .venv/bin/python benchmarks/align.py --comm rendezvous --ranks 8

Costs F=1, B=2, I=1, W=1 with comm latency 0, 0.1 and 0.5. For each schedule it prints the
total placement-bound wait (docs/align.md) and the makespan of the default lowering and of
`pipecc compile --align`, and the time the pass took.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipecc.api import bundled_schedules, compile_schedule
from pipecc.passes.align_comms import align_comms
from pipecc.semantics import CommModel
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import simulate

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--comm", default="nccl", choices=[m.value for m in CommModel])
    args = parser.parse_args()
    model = CommModel(args.comm)
    print(
        f"comm model {model.value}; costs F=1,B=2,I=1,W=1; M = 2P; placement-bound wait "
        "summed over ranks"
    )
    print(
        f"{'schedule':17s} {'P':>2s} {'comm':>4s}  {'default: wait':>14s} {'makespan':>9s}"
        f"  {'aligned: wait':>14s} {'makespan':>9s}  {'align time':>10s}"
    )
    for name in bundled_schedules():
        for ranks in args.ranks:
            program = compile_schedule(name, ranks=ranks, microbatches=2 * ranks)
            for comm in (0, 0.1, 0.5):
                costs = parse_cost_flag(f"F=1,B=2,I=1,W=1,comm={comm}")
                before = simulate(program, costs, model=model)
                start = time.perf_counter()
                aligned = align_comms(program, costs=costs, model=model)
                took = time.perf_counter() - start
                after = simulate(aligned, costs, model=model)
                print(
                    f"{name:17s} {ranks:>2d} {comm:>4g}  "
                    f"{sum(r.placement_bound for r in before.ranks):>14.2f} "
                    f"{before.makespan:>9.2f}  "
                    f"{sum(r.placement_bound for r in after.ranks):>14.2f} "
                    f"{after.makespan:>9.2f}  {took:>9.3f}s"
                )


if __name__ == "__main__":
    main()
