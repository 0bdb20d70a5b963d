"""`pipecc compile`: a schedule → per-rank instruction lists (JSON, grid, listing, torch CSV)."""

from __future__ import annotations

import argparse
import sys

from pipecc.commands.common import (
    SubParsers,
    add_cost_args,
    add_input_args,
    add_lowering_arg,
    add_mesh_args,
    add_moe_args,
    add_policy_arg,
    add_shared_arg,
    load_input,
    write_output,
)
from pipecc.diagnostics import InputError
from pipecc.driver.mesh import whole_mesh
from pipecc.interop import json_program, torch_csv
from pipecc.ir.printer import format_grid, format_listing
from pipecc.ir.program import Program

FORMATS = ("json", "text", "listing", "torch-csv", "torch-csv-comms")

DESCRIPTION = """\
Compile a schedule for P ranks and M microbatches: expand its phases, give every op its
microbatch, resolve every W to its I, and place sends, receives and waits with the default
comm policy (docs/compile.md). FILE is a .sched file, the name of a bundled schedule (see
'pipecc list'), or a compiled program (.json) to convert to another format.

The program is the one `pipecc run` runs on --backend (default nccl; docs/runtime.md): a
compute-only input gets the backend's comm policy (gloo: early-recv, nccl: default), a
.sched file's hand-placed comm ops are kept, a .json's comm ops too.

--comm-policy early-recv posts every receive at the start of the step: faster on gloo, where
each posted op progresses on its own, but it deadlocks under NCCL (verify it with --comm
rendezvous; the runtime refuses it on NCCL). --align places every send, receive and wait for
the given costs and comm model instead, so that no rank waits for a message it could have
had (docs/align.md). Either keeps the compute order and places hand-placed comm ops again
(a note says how many it replaced).
"""

EPILOG = """\
formats:
  json             the compiled program (DESIGN §4; docs/program.schema.json)
  text             one row per rank, one column per compute op (F0.3 = forward of chunk 0
                   on microbatch 3; F0.4&B1.1 = a fused pair)
  listing          every instruction of every rank, comm ops and waits included
  torch-csv        torch.distributed.pipelining action CSV, compute only
  torch-csv-comms  the same with SEND_F/RECV_F/SEND_B/RECV_B cells

examples:
  pipecc compile schedules/dualpipe.sched -P 8 -M 20 -o dualpipe.json
  pipecc compile schedules/interleaved_1f1b.sched -P 4 -M 8 -D V=2 --format text
  pipecc compile zb_h1 -P 4 -M 8 --format torch-csv
  pipecc compile zb_h1 -P 4 -M 8 --cost F=1,I=1,W=1,comm=0.2 --align -o zb_h1.json
  pipecc compile zb_h1 -P 4 -M 8 --comm-policy early-recv -o zb_h1_gloo.json
  pipecc compile zb_h1 -P 4 -M 8 --backend gloo -o zb_h1_gloo.json   # the same program
  pipecc compile 1f1b -P 4 -M 8 --shared 0+3 -o tied.json
"""


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "compile",
        help="compile a .sched file into per-rank instruction lists",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_input_args(cmd)
    add_lowering_arg(cmd)
    cmd.add_argument(
        "--format", choices=FORMATS, default="json", help="output format (default: json)"
    )
    cmd.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    cmd.add_argument(
        "--align",
        action="store_true",
        help="place comm ops for --cost/--cost-file under --comm (docs/align.md)",
    )
    add_policy_arg(cmd)
    add_shared_arg(cmd)
    add_mesh_args(cmd)
    add_moe_args(cmd)
    cmd.add_argument(
        "--expand",
        action="store_true",
        help="write a pipeline's program on a mesh for the whole mesh: one list per global "
        "rank, as verify and simulate replay it (for inspection and hand edits; verify reads "
        "it back)",
    )
    add_cost_args(cmd, backend=True)
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.align and args.moe is None and (args.cost or args.cost_file):
        raise InputError("--cost/--cost-file are for --align (without it nothing uses them)")
    program = load_input(args.file, args)
    if args.expand:
        if program.mesh is None:
            raise InputError("--expand writes a program on a mesh for every rank: give --mesh")
        program = whole_mesh(program)[0]
    match args.format:
        case "json":
            text = json_program.dumps(program)
        case "text":
            text = format_grid(program)
        case "listing":
            text = format_listing(program)
        case "torch-csv":
            text = torch_csv.dumps(program)
        case "torch-csv-comms":
            text = torch_csv.dumps(program, with_comms=True)
        case _:
            raise AssertionError(args.format)
    write_output(text, args.output)
    for note in _format_notes(program, args.format):
        print(f"note: {note}", file=sys.stderr)
    return 0


def _format_notes(program: Program, fmt: str) -> tuple[str, ...]:
    """What an output format cannot hold of this program (torch's UNSHARD & co.)."""
    if fmt == "text" and torch_csv.has_stage_ops(program):
        return (
            "the text grid shows compute ops only: this program's UNSHARD/RESHARD/REDUCE_GRAD "
            "are not in it (--format listing or json shows them)",
        )
    if fmt == "torch-csv":
        return torch_csv.dump_notes(program, with_comms=False)
    return ()
