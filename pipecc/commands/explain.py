"""`pipecc explain`: why an instruction starts when it does (its critical path)."""

from __future__ import annotations

import argparse
import difflib
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
from pipecc.diagnostics import InputError, ParseError
from pipecc.frontend.parser import parse_op_name
from pipecc.ir.ops import computations, is_compute
from pipecc.ir.printer import describe
from pipecc.ir.program import Program
from pipecc.semantics import CommModel
from pipecc.simulate.timeline import simulate

EPILOG = """\
--op names an instruction of one rank: RANK:INDEX as `pipecc compile --format listing`
numbers it, or RANK:NAME with the op's name as pipecc prints it or as a .sched file writes
it (3:W0.0 or 3:W0[0]; a fused op as 3:F0.4&B1.1, or by either half).

examples:
  pipecc explain dualpipe -P 8 -M 20 --cost F=1,B=2,I=1,W=1 --op 4:37
  pipecc explain zb_h1 -P 4 -M 8 --op 3:W0.5
"""


def _op(text: str) -> tuple[int, int | str]:
    rank, sep, which = text.partition(":")
    if not sep or not rank.isdigit() or not which.strip():
        raise argparse.ArgumentTypeError(f"expected RANK:INDEX or RANK:NAME, got {text!r}")
    return int(rank), int(which) if which.isdigit() else which.strip()


def _index(program: Program, rank: int, which: int | str) -> int:
    """The index on `rank` of the instruction `which` names (an index, or an op's name)."""
    if rank >= program.num_ranks:
        raise InputError(f"--op {rank}:{which}: the program has ranks 0..{program.num_ranks - 1}")
    instrs = program.ranks[rank]
    if isinstance(which, int):
        if which >= len(instrs):
            raise InputError(
                f"--op {rank}:{which}: rank {rank} has instructions 0..{len(instrs) - 1}"
            )
        return which
    labels = {instr.label(): index for index, instr in enumerate(instrs) if is_compute(instr)}
    if which in labels:  # as printed, torch's sequential `(B0.0;F0.2)` included
        return labels[which]
    try:
        named = parse_op_name(which)
    except ParseError as err:
        raise InputError(
            f"--op {rank}:{which}: not an index or an op's name (F0.3, W0[0], F0.4&B1.1): "
            f"{err.message}"
        ) from None
    wanted = "&".join(f"{kind.value}{chunk}.{mb}" for kind, chunk, mb in named)
    if wanted in labels:
        return labels[wanted]
    if len(named) == 1:  # one half of a fused op names it too
        for index, instr in enumerate(instrs):
            if is_compute(instr) and wanted in (op.label() for op in computations(instr)):
                return index
    raise InputError(_unknown(program, rank, wanted, which))


def _unknown(program: Program, rank: int, wanted: str, written: str) -> str:
    """Says that rank `rank` has no op `wanted`, which ranks do, and its ops that are close."""
    elsewhere = [
        f"rank {other} [{index}]"
        for other, instrs in enumerate(program.ranks)
        for index, instr in enumerate(instrs)
        if other != rank
        and is_compute(instr)
        and wanted in (instr.label(), *(op.label() for op in computations(instr)))
    ]
    instrs = [instr for instr in program.ranks[rank] if is_compute(instr)]
    halves = wanted.split("&")
    holding = [  # the fused ops of this rank that hold a half of the fused op asked for
        instr.label()
        for instr in instrs
        if len(halves) > 1 and any(op.label() in halves for op in computations(instr))
    ]
    close = holding or _close(wanted, [instr.label() for instr in instrs])
    message = f"--op {rank}:{written}: rank {rank} has no {wanted}"
    if elsewhere:
        message += f" ({wanted} is on {', '.join(elsewhere)})"
    if close:
        message += f"; close on rank {rank}: {' '.join(close)}"
    return message


def _close(wanted: str, names: list[str]) -> list[str]:
    """Up to 6 names like `wanted`: the same ops on the nearest microbatches, else the names
    spelt most alike."""
    parts = wanted.split("&")
    same_ops = [
        name
        for name in names
        if [p.partition(".")[0] for p in name.split("&")] == [p.partition(".")[0] for p in parts]
    ]
    if same_ops:
        return sorted(same_ops, key=lambda name: _mb_distance(name, wanted))[:6]
    return difflib.get_close_matches(wanted, names, n=6, cutoff=0.5)


def _mb_distance(name: str, wanted: str) -> int:
    pairs = zip(name.split("&"), wanted.split("&"), strict=True)
    return sum(abs(int(a.partition(".")[2]) - int(b.partition(".")[2])) for a, b in pairs)


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
        "--op",
        type=_op,
        required=True,
        metavar="RANK:INDEX|RANK:NAME",
        help="the instruction to explain: 3:17, 3:W0.0, 3:W0[0], 3:F0.4&B1.1",
    )
    cmd.add_argument("--json", action="store_true", help="print the chain as JSON")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    program = load_input(args.file, args)
    rank, which = args.op
    index = _index(program, rank, which)
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
