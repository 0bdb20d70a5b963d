"""How `pipecc search` scales: search time and whole-command time at the issue's sizes.

    .venv/bin/python benchmarks/search_scale.py [--runs 5] [--sizes 8x32,16x64,32x128]

Each size runs the real command, `pipecc search -P P -M M --cost F=1,I=1,W=1,comm=1 --memory P
-o OUT.json --sched OUT.sched --json` (costly messages at 1F1B's memory: the search does not
reach its bound and runs its whole budget; `--cost` and `--cap` change them), with the
default `--time-limit`, `--runs` times, in a fresh process. Reported per size, as medians
over the runs: `seconds` from the command's JSON (the search: from the parsed input to the
chosen order) and the command's wall time (start-up, search, lowering, alignment,
verification under every comm model, simulation of the baselines, writing), each against
the issue's target (search ≤ 1 s at P=8, M=32; ≤ 5 s at P=16, M=64; ≤ 30 s at P=32,
M=128; the whole command within 2× of that), and the growth ratio of each time to the
previous size's beside the growth of the op count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

PIPECC = str(Path(sys.executable).parent / "pipecc")
COSTS = "F=1,I=1,W=1,comm=1"  # costly messages: the search runs its whole budget
TARGETS = {(8, 32): 1.0, (16, 64): 5.0, (32, 128): 30.0}


class Row(NamedTuple):
    ranks: int
    mbs: int
    seconds: float  # median search time
    wall: float  # median whole-command time
    makespan: float
    gap: float


def run_once(
    ranks: int, mbs: int, folder: Path, costs: str, cap: float
) -> tuple[float, float, dict[str, Any]]:
    """One command: (search seconds, wall seconds, its JSON)."""
    out = folder / f"p{ranks}m{mbs}.json"
    command = [PIPECC, "search", "-P", str(ranks), "-M", str(mbs), "--cost", costs,
               "--memory", f"{cap:g}", "-o", str(out), "--sched", str(out.with_suffix(".sched")),
               "--json"]  # fmt: skip
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {result.stderr}")
    report = json.loads(result.stdout)
    return float(report["seconds"]), wall, report


def measure(ranks: int, mbs: int, runs: int, costs: str, cap: float) -> Row:
    """Medians over `runs` commands."""
    with tempfile.TemporaryDirectory() as tmp:
        samples = [run_once(ranks, mbs, Path(tmp), costs, cap) for _ in range(runs)]
    report = samples[-1][2]
    return Row(
        ranks,
        mbs,
        statistics.median(s[0] for s in samples),
        statistics.median(s[1] for s in samples),
        float(report["makespan"]),
        float(report["gap"]),
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| P | M | ops | search s | target | wall s | target | growth (ops, search, wall) "
        "| makespan | gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    previous: Row | None = None
    for row in rows:
        ops = 3 * row.ranks * row.mbs
        target = TARGETS.get((row.ranks, row.mbs))
        growth = "–"
        if previous is not None:
            before = 3 * previous.ranks * previous.mbs
            growth = (
                f"×{ops / before:.0f}, ×{row.seconds / previous.seconds:.1f}, "
                f"×{row.wall / previous.wall:.1f}"
            )
        goal = f"≤ {target:g}" if target else "–"
        wall_goal = f"≤ {2 * target:g}" if target else "–"
        lines.append(
            f"| {row.ranks} | {row.mbs} | {ops} | {row.seconds:.2f} | {goal} | {row.wall:.2f} "
            f"| {wall_goal} | {growth} | {row.makespan:.6g} | {row.gap:.1%} |"
        )
        previous = row
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per size (default 5)")
    parser.add_argument("--sizes", default="8x32,16x64,32x128", help="PxM,... (default: issue)")
    parser.add_argument("--cost", default=COSTS, help=f"per-share costs (default {COSTS})")
    parser.add_argument(
        "--cap", type=float, default=1.0, help="the cap, in activations per rank, × P (default 1)"
    )
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes.split(","):
        ranks, mbs = (int(v) for v in size.split("x"))
        rows.append(measure(ranks, mbs, args.runs, args.cost, args.cap * ranks))
        print(f"P={ranks} M={mbs}: done", file=sys.stderr)
    print(table(rows), end="")
    failed = [
        r for r in rows
        if (t := TARGETS.get((r.ranks, r.mbs))) is not None and (r.seconds > t or r.wall > 2 * t)
    ]  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
