"""What compile_scale, simulate_scale and verify_scale share: their flags, the bundled
schedule they compile, and the median time of a repeated piece of work."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pipecc.api import compile_schedule
from pipecc.diagnostics import InputError
from pipecc.ir.program import Program

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")


def parse_args(
    doc: str, *, torch_help: str = "run torch at this M instead (its lowering is quadratic in M)"
) -> argparse.Namespace:
    """--ranks, --microbatches, --torch-microbatches, --skip-torch and --repeat, with the first
    line of the benchmark's docstring `doc` as the description."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--torch-microbatches", type=int, default=None, help=torch_help)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    return parser.parse_args()


def compile_case(name: str, defines: dict[str, int], ranks: int, microbatches: int) -> Program:
    """schedules/`name`.sched compiled for the given sizes (`name, defines` as in CASES)."""
    return compile_schedule(
        ROOT / "schedules" / f"{name}.sched",
        ranks=ranks,
        microbatches=microbatches,
        defines=defines,
    )


def median_time(repeat: int, work: Callable[[], T]) -> tuple[float, T]:
    """The median wall time of `repeat` calls of `work` (repeat >= 1), and the last result.

    Each call's result is freed before the next call's clock starts: freeing 10⁶ objects
    is the previous call's cost, not the next one's."""
    times = []
    result = None
    for _ in range(repeat):
        result = None
        start = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - start)
    assert result is not None
    return statistics.median(times), result


def run(main: Callable[[], None]) -> None:
    """Run a benchmark's `main`: sizes a schedule rejects (the M/4 scaling run included) are
    one line on stderr and exit code 2, not a traceback."""
    try:
        main()
    except InputError as err:
        print(f"{err}\n(every size the benchmark compiles, M/4 included, must be valid)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
