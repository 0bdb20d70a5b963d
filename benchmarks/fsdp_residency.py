"""FSDP's residency policy: memory against gathers and time, per bundled schedule.

    .venv/bin/python benchmarks/fsdp_residency.py [-P 4] [-M 8] [--mesh dp_shard=8]
        [--cost F=1,B=2,param_bytes=100,bandwidth=400,collective=0.05]

For each schedule and each residency (`--max-active-stages` K: none, then the chunks a rank
holds down to the least its fused instructions allow), with a prefetch of one computation:
the most stages unsharded at once on a rank (the full parameters a rank holds: the memory
the policy bounds), the gathers (UNSHARDs) per step over all ranks of one pipeline, and the
simulated makespan of the whole mesh under the cost model, as a ratio to the unbounded
policy's measured in the same run.
"""

from __future__ import annotations

import argparse

from pipecc.api import compile_schedule
from pipecc.diagnostics import InputError
from pipecc.driver.mesh import MeshOptions, place_mesh, whole_mesh
from pipecc.ir.ops import Instr, StageAction, StageOp, computations
from pipecc.ir.program import Program
from pipecc.passes.insert_fsdp_actions import FsdpPolicy
from pipecc.semantics.costs import CostModel, parse_cost_flag
from pipecc.simulate import simulate

SCHEDULES = ("1f1b", "zb_h1", "interleaved_1f1b", "zbv", "dualpipev", "dualpipe")


def _resident(instrs: tuple[Instr, ...]) -> int:
    now: set[int] = set()
    most = 0
    for x in instrs:
        if type(x) is StageOp and x.kind is not StageAction.REDUCE_GRAD:
            (now.add if x.kind is StageAction.UNSHARD else now.discard)(x.stage)
            most = max(most, len(now))
    return most


def _row(program: Program, costs: CostModel) -> tuple[int, int, float]:
    resident = max(_resident(instrs) for instrs in program.ranks)
    gathers = sum(
        type(x) is StageOp and x.kind is StageAction.UNSHARD for i in program.ranks for x in i
    )
    whole, _ = whole_mesh(program)
    makespan = simulate(whole, costs.for_program(whole)).makespan
    return resident, gathers, makespan


def _limits(base: Program) -> list[int | None]:
    chunks = max(base.placement.num_chunks(r) for r in range(base.num_ranks))
    fused = max(
        (len({op.chunk for op in computations(x)}) for i in base.ranks for x in i), default=1
    )
    return [None, *range(chunks, max(fused, 1) - 1, -1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-P", type=int, default=4)
    parser.add_argument("-M", type=int, default=8)
    parser.add_argument("--mesh", default="dp_shard=8")
    parser.add_argument("--cost", default="F=1,B=2,param_bytes=100,bandwidth=400,collective=0.05")
    args = parser.parse_args()
    costs = parse_cost_flag(args.cost)
    print(f"P={args.P} M={args.M} mesh {args.mesh} costs {args.cost}; prefetch 1")
    print(f"{'schedule':18} {'K':>4} {'resident':>8} {'gathers':>8} {'makespan':>9} {'ratio':>6}")
    for name in SCHEDULES:
        try:
            base = compile_schedule(name, ranks=args.P, microbatches=args.M)
        except InputError as err:
            print(f"{name:18} skipped: {err.message}")
            continue
        first = None
        for limit in _limits(base):
            program = place_mesh(base, MeshOptions(args.mesh, policy=FsdpPolicy(limit, 1)))
            resident, gathers, makespan = _row(program, costs)
            first = first or makespan
            k = "none" if limit is None else str(limit)
            print(
                f"{name:18} {k:>4} {resident:>8} {gathers:>8} {makespan:>9.2f} "
                f"{makespan / first:>6.3f}"
            )


if __name__ == "__main__":
    main()
