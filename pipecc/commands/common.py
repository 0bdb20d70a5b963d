"""What several subcommands share: size flags, reading the input, writing the output."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipecc.api import compile_schedule, load_program
from pipecc.diagnostics import InputError
from pipecc.ir.program import Program


class Parser(argparse.ArgumentParser):
    """argparse, with bad flags reported as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


SubParsers = argparse._SubParsersAction  # the type `add_subparsers` returns


def define(text: str) -> tuple[str, int]:
    """Parse one `-D NAME=VALUE`."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"-D {name}: the value must be an integer, got {value!r}"
        ) from None


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_size_args(parser: argparse.ArgumentParser) -> None:
    """-P/--ranks, -M/--microbatches and -D NAME=VALUE, the same in every command."""
    parser.add_argument("-P", "--ranks", type=positive,
                        help="number of pipeline ranks (required for a .sched file)")
    parser.add_argument("-M", "--microbatches", type=positive,
                        help="microbatches per step (required for a .sched file)")
    parser.add_argument("-D", dest="defines", metavar="NAME=VALUE", type=define,
                        action="append", default=[],
                        help="set a schedule parameter (repeatable), e.g. -D V=2")


def load_input(path: str, args: argparse.Namespace) -> Program:
    """A Program from `path`: compiled from .sched (needs -P and -M), or loaded from .json."""
    if path.endswith(".json"):
        return load_program(path)
    if args.ranks is None or args.microbatches is None:
        missing = " and ".join(
            flag
            for flag, value in (("-P/--ranks", args.ranks),
                                ("-M/--microbatches", args.microbatches))
            if value is None
        )
        raise InputError(f"{path}: a .sched file needs {missing}")
    return compile_schedule(
        path, ranks=args.ranks, microbatches=args.microbatches, defines=dict(args.defines)
    )


def write_output(text: str, output: str | None) -> None:
    """Write to the file `output`, or to stdout when it is None."""
    if output is None:
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as err:
        raise InputError(f"{output}: cannot write: {err.strerror or err}") from None
