"""pipecc's default comm placement against torch's lowering and against `--align`.

    .venv/bin/python benchmarks/placement.py                  # the whole grid, a summary
    .venv/bin/python benchmarks/placement.py --rows           # and one row per case
    .venv/bin/python benchmarks/placement.py --ranks 4 --schedules zb_h1 zbv --rows

Unit costs (F=1, B=2, I=1, W=1) with comm latency 0, 0.1, 0.5 and 1, P in {2, 4, 8},
M in {P, 2P, 4P} where the schedule's `require` admits the sizes, under the nccl comm model,
for every bundled schedule torch's lowering can express (one pipe). Each case is simulated
with the durations per stage (as given) and per share of the model (scaled by P/S for a
schedule with S stages per pipe; the latency is not scaled). For each it prints the makespan
of the default placement, of `--lowering torch`, and of `--align` for those costs, and counts
the cases where the default is slower than torch's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pipecc.api import bundled_schedules, compile_schedule
from pipecc.diagnostics import InputError
from pipecc.ir.program import Program
from pipecc.passes.align_comms import align_comms
from pipecc.passes.insert_comms import strip_comms
from pipecc.passes.torch_program import lower_as_torch
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel, parse_cost_flag
from pipecc.simulate.timeline import simulate

COMMS = (0.0, 0.1, 0.5, 1.0)
RANKS = (2, 4, 8)
NOISE = 1e-9


@dataclass(frozen=True)
class Case:
    schedule: str
    ranks: int
    microbatches: int
    convention: str  # "stage" or "share"
    comm: float
    default: float
    torch: float
    aligned: float | None


def programs(names: list[str], ranks: tuple[int, ...]) -> Iterator[tuple[str, int, int, Program]]:
    """(name, P, M, default program) for every size the schedule's `require` admits."""
    for name in names:
        for p in ranks:
            for m in (p, 2 * p, 4 * p):
                try:
                    program = compile_schedule(name, ranks=p, microbatches=m)
                except InputError:
                    continue  # a `require` the sizes violate
                if program.placement.num_pipes == 1:
                    yield name, p, m, program


def cases(
    names: list[str], ranks: tuple[int, ...], *, align: bool, model: CommModel
) -> Iterator[Case]:
    for name, p, m, default in programs(names, ranks):
        torch = lower_as_torch(strip_comms(default), defer=False)
        for convention in ("stage", "share"):
            for comm in COMMS:
                costs: CostModel = parse_cost_flag(f"F=1,B=2,I=1,W=1,comm={comm:g}")
                if convention == "share":
                    costs = costs.for_program(default)  # docs/simulate.md's convention
                aligned = None
                if align:
                    program = align_comms(default, costs=costs, model=model)
                    aligned = simulate(program, costs, model=model).makespan
                yield Case(
                    name,
                    p,
                    m,
                    convention,
                    comm,
                    simulate(default, costs, model=model).makespan,
                    simulate(torch, costs, model=model).makespan,
                    aligned,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--schedules", nargs="+", default=None)
    parser.add_argument("--comm", default="nccl", choices=[m.value for m in CommModel])
    parser.add_argument("--rows", action="store_true", help="print one row per case")
    parser.add_argument("--no-align", action="store_true", help="skip the --align column")
    args = parser.parse_args()
    names = args.schedules or bundled_schedules()
    model = CommModel(args.comm)
    start = time.perf_counter()
    found = list(cases(names, tuple(args.ranks), align=not args.no_align, model=model))
    took = time.perf_counter() - start
    print(
        f"comm model {model.value}; costs F=1,B=2,I=1,W=1 per stage or per share (x P/S); "
        f"comm in {', '.join(f'{c:g}' for c in COMMS)}; P in {args.ranks}; M in P, 2P, 4P"
    )
    if args.rows:
        print(
            f"{'schedule':17s} {'P':>2s} {'M':>3s} {'costs':>5s} {'comm':>4s} "
            f"{'default':>8s} {'torch':>8s} {'aligned':>8s}  default/torch"
        )
        for c in found:
            aligned = "-" if c.aligned is None else f"{c.aligned:8.2f}"
            print(
                f"{c.schedule:17s} {c.ranks:>2d} {c.microbatches:>3d} {c.convention:>5s} "
                f"{c.comm:>4g} {c.default:>8.2f} {c.torch:>8.2f} {aligned:>8s}  "
                f"{c.default / c.torch:.4f}{'  SLOWER' if c.default > c.torch + NOISE else ''}"
            )
    print(
        f"{'schedule':17s} {'cases':>5s} {'slower':>6s} {'worst d/t':>9s} {'mean d/t':>8s} "
        f"{'mean a/t':>8s}"
    )
    for name in names:
        mine = [c for c in found if c.schedule == name]
        if not mine:
            print(f"{name:17s} (two pipes: torch cannot run it)")
            continue
        ratios = [c.default / c.torch for c in mine]
        slower = sum(c.default > c.torch + NOISE for c in mine)
        aligned = [c.aligned / c.torch for c in mine if c.aligned is not None]
        mean_aligned = f"{sum(aligned) / len(aligned):8.4f}" if aligned else f"{'-':>8s}"
        print(
            f"{name:17s} {len(mine):>5d} {slower:>6d} {max(ratios):>9.4f} "
            f"{sum(ratios) / len(ratios):>8.4f} {mean_aligned}"
        )
    total = sum(c.default > c.torch + NOISE for c in found)
    print(f"{len(found)} cases, default slower than torch in {total}; {took:.1f} s")


if __name__ == "__main__":
    main()
