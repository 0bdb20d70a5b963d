"""What several subcommands share: size flags, reading the input, writing the output."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from pipecc.diagnostics import CostModelError, InputError
from pipecc.driver.compile import Alignment, Lowering
from pipecc.driver.load import load
from pipecc.driver.lowering import requested_style
from pipecc.ir.program import Program
from pipecc.passes.insert_comms import POLICIES
from pipecc.passes.sum_shared import sum_shared
from pipecc.passes.torch_program import LoweringStyle
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel, load_cost_file, parse_cost_flag


class Parser(argparse.ArgumentParser):
    """argparse, with bad flags reported as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


# the type `add_subparsers` returns (generic only for the type checker in Python 3.11)
if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    SubParsers = argparse._SubParsersAction


def define(text: str) -> tuple[str, int]:
    """Parse one `-D NAME=VALUE`."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{name}: the value must be an integer, got {value!r}"
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
    parser.add_argument(
        "-P", "--ranks", type=positive, help="number of pipeline ranks (required for a .sched file)"
    )
    parser.add_argument(
        "-M",
        "--microbatches",
        type=positive,
        help="microbatches per step (required for a .sched file)",
    )
    parser.add_argument(
        "-D",
        dest="defines",
        metavar="NAME=VALUE",
        type=define,
        action="append",
        default=[],
        help="set a schedule parameter (repeatable), e.g. -D V=2",
    )


def add_input_args(parser: argparse.ArgumentParser) -> None:
    """FILE and -P/-M/-D: the one program that `load_input` reads."""
    parser.add_argument("file", metavar="FILE", help=".sched file, bundled schedule name, or .json")
    add_size_args(parser)


def load_input(path: str, args: argparse.Namespace) -> Program:
    """A Program from `path`, by extension: a .sched file compiled for -P/-M/-D, a compiled
    program (.json), or a torch.distributed.pipelining action CSV (.csv); a compute-only one
    gets its comm ops placed (DESIGN §1, §5). The command's --comm-policy and --align, where
    it has them, are inputs of that one compilation (`pipecc.driver.load`)."""
    sizes = {"ranks": args.ranks, "microbatches": args.microbatches}
    how = lowering(args)
    program, notes = load(path, **sizes, defines=dict(args.defines), lowering=how)
    for note in notes:  # what the reader ignored (CSV cells, unknown JSON fields), on stderr
        print(f"note: {note}", file=sys.stderr)
    if how.shared:  # a .json or .csv read as it is gets the sums too (the pass is idempotent)
        program = sum_shared(program, shared=how.shared)
    return program


def lowering(args: argparse.Namespace) -> Lowering:
    """How the command's flags ask for the comm ops to be placed."""
    policy = getattr(args, "comm_policy", None)
    shared = getattr(args, "shared", None) or ()
    style = requested_style(args)  # --lowering torch|torch-defer (docs/interop.md)
    if style is not LoweringStyle.PIPECC:
        return Lowering(style=style, shared=shared)
    if not getattr(args, "align", False):
        return Lowering(policy=policy, shared=shared)
    if policy is not None:
        raise InputError("--align and --comm-policy both place the comm ops: give one of them")
    return Lowering(align=Alignment(load_costs(args), CommModel(args.comm)), shared=shared)


def shared_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Parse `--shared 0+7/1+6` as a cost file's `shared` is parsed."""
    try:
        return parse_cost_flag(f"shared={text}").shared
    except CostModelError as err:
        raise argparse.ArgumentTypeError(err.message.removeprefix("--cost: ")) from None


def add_shared_arg(parser: argparse.ArgumentParser) -> None:
    """--shared: stages that hold one parameter, whose gradients the program sums."""
    parser.add_argument(
        "--shared",
        metavar="S+S[/S+S]",
        type=shared_groups,
        help="stages that hold one parameter (a tied embedding: 0+7; groups separated by /, "
        "as a cost file's shared): the program sums their gradients with one all_reduce "
        "per set of ranks holding them (DualPipe's duplicated stages always get theirs; "
        "docs/compile.md)",
    )


def add_policy_arg(parser: argparse.ArgumentParser) -> None:
    """--comm-policy: how the compiler places sends, receives and waits."""
    parser.add_argument(
        "--comm-policy",
        choices=sorted(POLICIES),
        help="where sends, receives and waits go: default (the default for a .sched file; "
        "safe under every comm model) or early-recv (every receive posted at the start of "
        "the step: faster on gloo, deadlocks under NCCL; docs/compile.md). A .json program "
        "keeps its own placement unless this is given",
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


COMM_MODELS = tuple(model.value for model in CommModel)


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    """--cost, --cost-file and --comm: the simulator's inputs (DESIGN §6)."""
    parser.add_argument(
        "--cost",
        metavar="K=V,...",
        help="durations, comm latency and host time, e.g. F=1,B=2,I=1,W=1,FB=2.5,comm=0.1,"
        "post=0.05,wait=0.01,sync=3 (docs/simulate.md; default F=1,B=2,I=1,W=1)",
    )
    parser.add_argument(
        "--cost-file",
        metavar="TOML",
        help="a cost file ([cost] and [cost.stage.N]; `pipecc run --profile` "
        "writes one); --cost overrides its global values",
    )
    parser.add_argument(
        "--comm",
        choices=COMM_MODELS,
        default="nccl",
        help="how sends and receives complete (DESIGN §5; default nccl)",
    )


def load_costs(args: argparse.Namespace) -> CostModel:
    """The cost model from --cost-file and --cost (flags win)."""
    model = load_cost_file(args.cost_file) if args.cost_file else CostModel()
    if args.cost:
        model = model.overridden_by(parse_cost_flag(args.cost))
    return model
