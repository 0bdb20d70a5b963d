"""The search's quality on the issue's grid, against the bundled schedules and sail-sg's heuristic.

    .venv/bin/python benchmarks/search_quality.py [--quick] [--out docs/search-quality.md]

Profiles (per share: F, I, W, comm): balanced (5.478, 5.806, 3.534, 0.2: the costs sail-sg's
scheduler ships as its example), small W (1, 1.5, 0.5, 0.5), random (each duration 1 × a
uniform 0.8–1.2 per share, the last share ×2, comm 0.1, seed 0) and costly messages (1, 1, 1,
1); caps P/2, P and 2P activations per rank (one share's activations: F +1, I 0, W −1);
P ∈ {4, 8}, M ∈ {8, 16, 32}. In each cell, the makespan in the latency model (every rank
starting at 0, a message arriving `comm` after its producer ends) of: the search
(`--placement auto`: the better of loop and V, with the bundled schedules that fit as
candidates, as `pipecc search` runs it), 1F1B, ZB-H1, ZB-H2 and ZB-V where they compile and
fit the cap (– otherwise), sail-sg's heuristic (benchmarks/sailsg_baseline.py, loop
placement), and the lower bound with the search's gap to it.

The checks of the issue's requirement 3: the search is never worse than the best bundled
schedule that fits nor than sail-sg's heuristic; under caps below P, in every cell where
sail-sg is at least 25% above the best known schedule (the search's), the search is at least
20% faster (sail-sg / search − 1 ≥ 0.20), and at least 15% as the median over those cells.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "search"))

from bundled import bundled_order  # noqa: E402
from pipecc.search.engine import default_time_limit, search  # noqa: E402
from sailsg_baseline import Profile, grid_problem, grid_profiles, sailsg_schedule  # noqa: E402

from pipecc.search.bounds import lower_bound  # noqa: E402
from pipecc.search.problem import Order, Placement, Problem, evaluate, fits  # noqa: E402

SCHEDULES = (
    ("1F1B", "1f1b", Placement.LOOP),
    ("ZB-H1", "zb_h1", Placement.LOOP),
    ("ZB-H2", "zb_h2", Placement.LOOP),
    ("ZB-V", "zbv", Placement.VSHAPE),
)


class Cell(NamedTuple):
    """One grid cell's figures (None: does not compile or does not fit the cap)."""

    ranks: int
    mbs: int
    profile: str
    cap: float
    search: float
    placement: str
    bundled: tuple[float | None, ...]
    sailsg: float | None
    bound: float


def _fitting(problem: Problem, name: str) -> float | None:
    order = bundled_order(name, problem)
    if order is None:
        return None
    evaluation = evaluate(problem, order)
    if evaluation is None or not fits(problem, evaluation):
        return None
    return evaluation.makespan


def _searched(problems: dict[Placement, Problem]) -> tuple[float, str]:
    best: tuple[float, str] | None = None
    for placement, problem in problems.items():
        names = [name for _, name, where in SCHEDULES if where is placement]
        candidates = [bundled_order(name, problem) for name in names]
        fitting = [o for o in candidates if o is not None and _fits(problem, o)]
        limit = default_time_limit(problem.ranks, problem.microbatches)
        result = search(problem, time_limit=limit, candidates=fitting)
        if result is None:
            continue
        value = evaluate(problem, result.order)
        assert value is not None and fits(problem, value)
        if best is None or value.makespan < best[0]:
            best = (value.makespan, placement.value)
    assert best is not None, "no placement has a schedule"
    return best


def _fits(problem: Problem, order: Order) -> bool:
    evaluation = evaluate(problem, order)
    return evaluation is not None and fits(problem, evaluation)


def measure(profile: Profile, mbs: int, cap: float) -> Cell:
    """Every figure of one cell."""
    problems = {p: grid_problem(profile, mbs, cap, placement=p) for p in Placement}
    search_value, placement = _searched(problems)
    bundled = tuple(_fitting(problems[where], name) for _, name, where in SCHEDULES)
    sail = sailsg_schedule(problems[Placement.LOOP])
    sail_value = None
    if sail is not None:
        evaluation = evaluate(problems[Placement.LOOP], sail.order)
        assert evaluation is not None and fits(problems[Placement.LOOP], evaluation)
        sail_value = evaluation.makespan
    bound = min(lower_bound(problem) for problem in problems.values())
    ranks = len(profile.f)
    return Cell(ranks, mbs, profile.name, cap, search_value, placement, bundled, sail_value, bound)


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def table(cells: list[Cell]) -> str:
    """The grid as a markdown table."""
    names = " | ".join(label for label, _, _ in SCHEDULES)
    lines = [
        f"| P | M | profile | cap | search | {names} | sail-sg | bound | gap |",
        "|" + "---|" * (9 + len(SCHEDULES)),
    ]
    for c in cells:
        bundled = " | ".join(_fmt(v) for v in c.bundled)
        lines.append(
            f"| {c.ranks} | {c.mbs} | {c.profile} | {c.cap:g} | {_fmt(c.search)} ({c.placement})"
            f" | {bundled} | {_fmt(c.sailsg)} | {_fmt(c.bound)} | {c.search / c.bound - 1:.1%} |"
        )
    return "\n".join(lines)


def checks(cells: list[Cell]) -> list[tuple[str, bool, str]]:
    """Requirement 3's checks: (what, passed, detail)."""
    tol = 1e-9
    worse_bundled = [
        c for c in cells if any(v is not None and c.search > v + tol for v in c.bundled)
    ]
    worse_sail = [c for c in cells if c.sailsg is not None and c.search > c.sailsg + tol]
    tight = [c for c in cells if c.cap < c.ranks and c.sailsg is not None]
    far = [c for c in tight if c.sailsg is not None and c.sailsg / c.search - 1 >= 0.25]
    gains = [c.sailsg / c.search - 1 for c in far if c.sailsg is not None]
    short = [c for c, g in zip(far, gains, strict=True) if g < 0.20]
    median = statistics.median(gains) if gains else 0.0
    return [
        ("never worse than the best bundled that fits", not worse_bundled, _where(worse_bundled)),
        ("never worse than sail-sg's heuristic", not worse_sail, _where(worse_sail)),
        (
            f"caps < P: ≥ 20% faster where sail-sg ≥ 25% above the best known ({len(far)} cells)",
            not short,
            _where(short),
        ),
        ("caps < P: median gain over those cells ≥ 15%", median >= 0.15, f"median {median:.1%}"),
    ]


def _where(cells: list[Cell]) -> str:
    return ", ".join(f"P={c.ranks} M={c.mbs} {c.profile} cap={c.cap:g}" for c in cells) or "–"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P=4, M ∈ {8, 16} only")
    parser.add_argument("--out", type=Path, help="also write the table and checks here")
    args = parser.parse_args(argv)
    sizes = list(itertools.product((4, 8), (8, 16, 32)))
    if args.quick:
        sizes = [(4, 8), (4, 16)]
    cells = []
    for ranks, mbs in sizes:
        for profile in grid_profiles(ranks):
            for cap in (ranks / 2, ranks, 2 * ranks):
                cells.append(measure(profile, mbs, cap))
                print(f"P={ranks} M={mbs} {profile.name} cap={cap:g}", file=sys.stderr)
    text = (
        table(cells)
        + "\n\n"
        + "\n".join(
            f"- {'PASS' if ok else 'FAIL'}: {what} ({detail})" for what, ok, detail in checks(cells)
        )
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(ok for _, ok, _ in checks(cells)) else 1


if __name__ == "__main__":
    sys.exit(main())
