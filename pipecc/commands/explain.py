"""`pipecc explain`: why an instruction starts when it does (its critical path)."""

from __future__ import annotations

import argparse
import json

from pipecc.analysis.critical_path import critical_path
from pipecc.commands.common import (
    SubParsers,
    add_cost_args,
    add_input_args,
    load_costs,
    load_input,
    program_costs,
)
from pipecc.diagnostics import InputError
from pipecc.ir.printer import describe
from pipecc.semantics import CommModel
from pipecc.simulate.timeline import simulate

EPILOG = """\
RANK:INDEX names an instruction as `pipecc compile --format listing` numbers it.

example:
  pipecc explain dualpipe -P 8 -M 20 --cost F=1,B=2,I=1,W=1 --op 4:37
"""


def _op(text: str) -> tuple[int, int]:
    rank, sep, index = text.partition(":")
    if not sep or not rank.isdigit() or not index.isdigit():
        raise argparse.ArgumentTypeError(f"expected RANK:INDEX, got {text!r}")
    return int(rank), int(index)


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "explain",
        help="the critical path behind one instruction's start",
        description="Simulate, then walk back from one instruction to time "
        "0 along the program-order and message edges that decided when it "
        "starts, each with its time and reason.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_input_args(cmd)
    add_cost_args(cmd)
    cmd.add_argument(
        "--op", type=_op, required=True, metavar="RANK:INDEX", help="the instruction to explain"
    )
    cmd.add_argument("--json", action="store_true", help="print the chain as JSON")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    program = load_input(args.file, args)
    rank, index = args.op
    if rank >= program.num_ranks or index >= len(program.ranks[rank]):
        raise InputError(
            f"--op {rank}:{index}: the program has ranks 0..{program.num_ranks - 1}"
            + (
                f" and rank {rank} has instructions 0..{len(program.ranks[rank]) - 1}"
                if rank < program.num_ranks
                else ""
            )
        )
    costs = program_costs(load_costs(args), program)
    timeline = simulate(program, costs, model=CommModel(args.comm))
    links = critical_path(timeline.replay, rank, index)
    if args.json:
        print(json.dumps([link.to_json() for link in links]))
        return 0
    start = timeline.replay.start_time(rank, index)
    print(
        f"rank {rank} [{index}] {describe(program.ranks[rank][index])} starts at {start:g} "
        f"(comm {args.comm}; {timeline.costs.describe()})"
    )
    for link in links:
        print(f"  t={link.time:<8g} rank {link.rank} [{link.index}] {link.reason}")
    return 0
