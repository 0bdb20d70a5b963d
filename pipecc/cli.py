"""The `pipecc` command line (DESIGN §8).

Exit codes everywhere: 0 success; 1 the schedule or program is wrong; 2 input pipecc cannot
use. Every failure is one message on stderr, never a traceback (a traceback is a pipecc bug).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipecc import __version__
from pipecc.api import bundled_schedules, compile_schedule, load_program, read_text
from pipecc.diagnostics import InputError, PipeccError, Span
from pipecc.frontend import ast
from pipecc.frontend.parser import parse
from pipecc.interop import json_program, torch_csv
from pipecc.ir.printer import format_grid, format_listing
from pipecc.ir.program import Program

COMPILE_FORMATS = ("json", "text", "listing", "torch-csv", "torch-csv-comms")

EPILOG = """\
examples:
  pipecc compile schedules/dualpipe.sched --ranks 8 --microbatches 20 -o dualpipe.json
  pipecc compile schedules/interleaved_1f1b.sched -P 4 -M 8 -D V=2 --format text
  pipecc compile zb_h1 -P 4 -M 8 --format torch-csv      # a bundled schedule, by name
  pipecc list

exit codes: 0 success, 1 the schedule or program is wrong, 2 input pipecc cannot use.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with bad flags reported as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


def _define(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"-D {name}: the value must be an integer, got {value!r}"
        ) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_size_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    need = " (required for a .sched file)" if required else ""
    parser.add_argument("-P", "--ranks", type=_positive, help=f"number of pipeline ranks{need}")
    parser.add_argument(
        "-M", "--microbatches", type=_positive, help=f"microbatches per step{need}"
    )
    parser.add_argument(
        "-D",
        dest="defines",
        metavar="NAME=VALUE",
        type=_define,
        action="append",
        default=[],
        help="set a schedule parameter (repeatable), e.g. -D V=2",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pipecc",
        description="Compile, verify, simulate and run pipeline-parallel training schedules.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pipecc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_compile(commands)
    _add_list(commands)
    return parser


def _add_compile(commands: argparse._SubParsersAction[_Parser]) -> None:
    cmd = commands.add_parser(
        "compile",
        help="compile a .sched file into per-rank instruction lists",
        description=(
            "Compile a schedule for P ranks and M microbatches: expand its phases, give every "
            "op its microbatch, resolve every W to its I, and place sends, receives and waits "
            "with the default comm policy (docs/compile.md). FILE is a .sched file, or the "
            "name of a bundled schedule (see 'pipecc list')."
        ),
        epilog=(
            "formats:\n"
            "  json             the compiled program (DESIGN §4; docs/program.schema.json)\n"
            "  text             one row per rank, one column per compute op (F0.3 = forward\n"
            "                   of chunk 0 on microbatch 3; F0.4&B1.1 = a fused pair)\n"
            "  listing          every instruction of every rank, comm ops and waits included\n"
            "  torch-csv        torch.distributed.pipelining action CSV, compute only\n"
            "  torch-csv-comms  the same with SEND_F/RECV_F/SEND_B/RECV_B cells\n\n"
            "example:\n"
            "  pipecc compile schedules/dualpipe.sched -P 8 -M 20 -o dualpipe.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("file", metavar="FILE", help=".sched file or bundled schedule name")
    _add_size_args(cmd, required=True)
    cmd.add_argument("--format", choices=COMPILE_FORMATS, default="json",
                     help="output format (default: json)")
    cmd.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    cmd.set_defaults(run=_run_compile)


def _add_list(commands: argparse._SubParsersAction[_Parser]) -> None:
    cmd = commands.add_parser(
        "list",
        help="list the bundled schedules with their parameters and constraints",
        description="List the schedules shipped with pipecc (usable by name in every command).",
    )
    cmd.set_defaults(run=_run_list)


# ---- commands ------------------------------------------------------------------------------


def load_input(args: argparse.Namespace) -> Program:
    """A Program from FILE: compiled from .sched (needs -P and -M), or loaded from .json."""
    path = str(args.file)
    if path.endswith(".json"):
        return load_program(path)
    if args.ranks is None or args.microbatches is None:
        missing = " and ".join(
            flag for flag, value in (("-P/--ranks", args.ranks), ("-M/--microbatches",
                                     args.microbatches)) if value is None
        )
        raise InputError(f"{path}: a .sched file needs {missing}")
    return compile_schedule(
        path, ranks=args.ranks, microbatches=args.microbatches, defines=dict(args.defines)
    )


def _run_compile(args: argparse.Namespace) -> int:
    program = load_input(args)
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
    _write(text, args.output)
    return 0


def _run_list(args: argparse.Namespace) -> int:
    rows = [("NAME", "PLACEMENT", "PARAMETERS", "REQUIRES", "ORIGIN")]
    for name, path in bundled_schedules().items():
        text = read_text(path)
        tree = parse(text, str(path))
        rows.append((name, *_summary(tree, text)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        print("  ".join(cells + [row[-1]]).rstrip())
    return 0


def _summary(tree: ast.ScheduleFile, text: str) -> tuple[str, str, str, str]:
    placement, params, requires = "loop", [], []
    for decl in tree.decls:
        match decl:
            case ast.NamedPlacement(name=name, arg=arg):
                placement = name + (f"({_slice(arg.span)})" if arg is not None else "")
            case ast.TablePlacement():
                placement = "table"
            case ast.Param(name=name, default=default):
                params.append(f"{name}={_slice(default.span)}")
            case ast.Require(conditions=conditions):
                requires.extend(_slice(cond.span) for cond in conditions)
    origin = next(
        (line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), ""
    )
    return placement, " ".join(params) or "-", ", ".join(requires) or "-", origin


def _slice(span: Span | None) -> str:
    return span.text() if span is not None else ""


def _write(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as err:
        raise InputError(f"{output}: cannot write: {err.strerror or err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except PipeccError as err:
        print(str(err), file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
