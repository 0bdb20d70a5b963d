"""sail-sg's own scheduler code, run from a checkout outside this repository, as a check.

    .venv/bin/python benchmarks/sailsg_upstream.py PATH              # the cross-check
    .venv/bin/python benchmarks/sailsg_upstream.py PATH --v-figures  # V-Half and V-Min

PATH is a checkout of sail-sg/zero-bubble-pipeline-parallelism (its files are read, never
copied here). The cross-check runs upstream's `scheduler/zb.py` heuristic and the
reimplementation of benchmarks/sailsg_baseline.py on every switch combination of the
search_quality grid and of a wider one, and compares each stage's order and the span; the
V figures run upstream's `zbv_greedy` generators (V-Half, V-Min) at P=4, M=16, F=I=W=1 per
share, comm=0 and replay their orders with pipecc's latency model.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import types
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sailsg_baseline import (  # noqa: E402
    MemoryShort,
    Profile,
    Switches,
    greedy,
    grid_problem,
    grid_profiles,
)

from pipecc.ir.ops import Kind
from pipecc.search.problem import Order, Problem, SearchOp, evaluate  # noqa: E402

_KINDS = (Kind.F, Kind.I, Kind.W)


def load_upstream(repo: Path) -> types.ModuleType:
    """Upstream's `scheduler/zb.py` from a checkout at `repo` (outside this repository), with
    stand-ins for what the heuristic does not use (pulp: only its removed ILP)."""
    import importlib.util

    folder = repo / "megatron/core/pipeline_parallel/zerobubble/scheduler"
    package = "megatron.core.pipeline_parallel.zerobubble.scheduler"
    parts = package.split(".")
    for depth in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    sys.modules.setdefault("pulp", types.ModuleType("pulp"))
    for name in ("graph", "zb"):
        spec = importlib.util.spec_from_file_location(f"{package}.{name}", folder / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"{package}.{name}"] = module
        spec.loader.exec_module(module)
    return sys.modules[f"{package}.zb"]


def upstream_run(
    zb: types.ModuleType, problem: Problem, switches: Switches
) -> tuple[Order, float] | str:
    """Upstream's order and span for one switch combination, or its error's text."""
    stages, mbs = problem.num_stages, problem.microbatches
    graph_module = sys.modules["megatron.core.pipeline_parallel.zerobubble.scheduler.graph"]
    config = graph_module.GraphConfig(
        mem_f=list(problem.mem_f),
        mem_b=list(problem.mem_i),
        mem_w=list(problem.mem_w),
        max_mem=[problem.cap] * stages,
        cost_f=list(problem.f),
        cost_b=list(problem.i),
        cost_w=list(problem.w),
        cost_comm=problem.comm,
        n_stages=stages,
        n_micro=mbs,
    )
    graph = zb.Graph.build_graph(stages, mbs, config)
    try:
        position, _, span = graph.manual_order(*switches)
    except (ValueError, AssertionError) as err:
        return f"{type(err).__name__}: {err}"
    order = []
    for stage in range(stages):
        ops = [
            (position[graph.get_id(kind, stage, mb)], SearchOp(_KINDS[kind], stage, mb))
            for kind in range(3)
            for mb in range(mbs)
        ]
        order.append(tuple(op for _, op in sorted(ops)))
    return tuple(order), span


class VResult(NamedTuple):
    """One of upstream's V generators (V-Half, V-Min) on a V-shape problem."""

    name: str
    order: Order
    span: float  # as upstream reports it


def upstream_v(repo: Path, problem: Problem, pattern: str) -> VResult:
    """Upstream's `zbv_greedy` generator ("half" or "min") for a V-shape problem with one
    duration per op kind (per chunk: the problem's stage durations) and its latency."""
    import importlib.util

    load_upstream(repo)
    package = "megatron.core.pipeline_parallel.zerobubble.scheduler"
    path = repo / "megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py"
    spec = importlib.util.spec_from_file_location(f"{package}.zbv_greedy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ranks = problem.ranks
    graph = module.PipelineGraph(
        ranks, problem.microbatches, pattern, problem.f[0], problem.i[0], problem.w[0], problem.comm
    )
    blocks = {"half": graph.stable_pattern_v_half, "min": graph.stable_pattern_v_min}
    costs = [graph.fbw_cost[x // 2] for x in range(6)]
    span, _, stage_order = graph.schedule_from_pattern(
        blocks[pattern](ranks), problem.microbatches, costs
    )
    order = []
    for rank in range(ranks):
        ops = []
        for kind_chunk, mb in stage_order[rank]:
            kind, slot = divmod(kind_chunk, 2)
            chunk = slot if kind == 0 else 1 - slot  # upstream lists backwards chunk 1 first
            stage = rank if chunk == 0 else 2 * ranks - 1 - rank
            ops.append(SearchOp(_KINDS[kind], stage, mb))
        order.append(tuple(ops))
    return VResult(f"V-{pattern.capitalize()}", tuple(order), span)


def v_figures(repo: Path) -> None:
    """Upstream's V-Half and V-Min at P=4, M=16, F=I=W=1 per share, comm=0, replayed here."""
    problem = grid_problem(
        Profile("unit", (1.0,) * 4, (1.0,) * 4, (1.0,) * 4, 0.0),
        16,
        math.inf,
        placement="vshape",
    )
    for pattern in ("half", "min"):
        result = upstream_v(repo, problem, pattern)
        evaluation = evaluate(problem, result.order)
        assert evaluation is not None
        print(
            f"{result.name}: span {result.span:g} (upstream), here span {evaluation.span:g},"
            f" makespan {evaluation.makespan:g}, peak {max(evaluation.peak):g} activations per rank"
        )


def _cross_cells() -> list[tuple[Profile, int, float]]:
    """The search_quality grid, then a wider one (M < P, odd caps, caps below one forward's
    memory, another random seed)."""
    cells = [
        (profile, mbs, cap)
        for ranks, mbs in itertools.product((4, 8), (8, 16, 32))
        for profile in grid_profiles(ranks)
        for cap in (ranks / 2, ranks, 2 * ranks)
    ]
    cells += [
        (profile, mbs, cap)
        for ranks, mbs in itertools.product((2, 3, 4, 6, 8), (2, 4, 5, 8, 12))
        for profile in grid_profiles(ranks, seed=1)
        for cap in (1, 1.5, ranks / 4, ranks - 1, ranks + 1)
    ]
    return cells


def cross_check(repo: Path) -> int:
    """Run upstream's heuristic and this one on every switch combination of the cells of
    `_cross_cells`; print each difference and a summary; the number of differences."""
    zb = load_upstream(repo)
    runs = differences = failed = 0
    for profile, mbs, cap in _cross_cells():
        problem = grid_problem(profile, mbs, cap)
        for flags in itertools.product((True, False), repeat=3):
            runs += 1
            theirs = upstream_run(zb, problem, Switches(*flags))
            try:
                ours: tuple[Order, float] | str = greedy(problem, Switches(*flags))
            except MemoryShort as err:
                ours = f"ValueError: {err}"
            if _same(theirs, ours):
                failed += isinstance(ours, str)
                continue
            differences += 1
            print(
                f"P={len(profile.f)} M={mbs} {profile.name} cap={cap:g} {flags}:"
                f" {theirs!s:.60} vs {ours!s:.60}"
            )
    print(
        f"{runs} runs (cells × switch combinations): {differences} differences;"
        f" {failed} runs fail the cap in both, the others give the same order and span"
    )
    return differences


def _same(theirs: tuple[Order, float] | str, ours: tuple[Order, float] | str) -> bool:
    if isinstance(theirs, str) or isinstance(ours, str):
        return isinstance(theirs, str) and isinstance(ours, str)
    return theirs[0] == ours[0] and math.isclose(theirs[1], ours[1], rel_tol=1e-12, abs_tol=1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", type=Path, help="a checkout of sail-sg's repository")
    parser.add_argument("--v-figures", action="store_true", help="run its V-Half and V-Min")
    args = parser.parse_args(argv)
    if args.v_figures:
        v_figures(args.repo)
        return 0
    return 1 if cross_check(args.repo) else 0


if __name__ == "__main__":
    sys.exit(main())
