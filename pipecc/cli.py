"""The `pipecc` command line (DESIGN §8).

Exit codes everywhere: 0 success; 1 the schedule or program is wrong; 2 input pipecc cannot
use. Every failure is one message on stderr, never a traceback (a traceback is a pipecc bug).
Each subcommand lives in its own module of `pipecc.commands`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipecc import __version__
from pipecc.commands import compare, explain, list_schedules, search, simulate, verify
from pipecc.commands import compile as compile_command
from pipecc.commands import run as run_command
from pipecc.commands.common import Parser
from pipecc.diagnostics import PipeccError

COMMANDS = (
    compile_command,
    verify,
    simulate,
    compare,
    explain,
    run_command,
    search,
    list_schedules,
)

EPILOG = """\
examples:
  pipecc list
  pipecc compile schedules/dualpipe.sched --ranks 8 --microbatches 20 -o dualpipe.json
  pipecc compile zb_h1 -P 4 -M 8 --format text          # a bundled schedule, by name
  pipecc verify dualpipe.json --comm all
  pipecc verify schedules/*.sched --sweep ranks=2..8 microbatches=1..40
  pipecc simulate dualpipe -P 8 -M 20 --cost F=1,B=2,I=1,W=1,comm=0.1 --svg dualpipe.svg
  pipecc compile zb_h1 -P 4 -M 8 --cost F=1,I=1,W=1,comm=0.2 --align -o zb_h1.json
  pipecc run zb_h1.json --nproc 4 --model examples/mlp.py --check

'pipecc COMMAND --help' explains each command.
exit codes: 0 success, 1 the schedule or program is wrong, 2 input pipecc cannot use.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pipecc",
        description="Compile, verify, simulate and run pipeline-parallel training schedules.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pipecc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.register(commands)
    return parser


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
