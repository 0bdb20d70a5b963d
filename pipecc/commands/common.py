"""What several subcommands share: size flags, reading the input, writing the output."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from pipecc.diagnostics import CostModelError, InputError
from pipecc.driver.compile import Alignment, Lowering
from pipecc.driver.load import DEFAULT_BACKEND, Request, RunBackend, resolve
from pipecc.driver.mesh import MeshOptions, MoeOptions
from pipecc.ir.mesh import parse_mesh
from pipecc.ir.program import Program
from pipecc.passes.insert_comms import POLICIES
from pipecc.passes.insert_fsdp_actions import DEFAULT_POLICY, FsdpPolicy
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


def runtime_import_failure(err: ImportError) -> str:
    """Why the runtime could not be imported: the runtime extra missing (torch, numpy), or
    anything else, said as it is."""
    missing = (err.name or "").split(".")[0]
    if isinstance(err, ModuleNotFoundError) and missing in ("torch", "numpy"):
        return f"pipecc run needs torch (pip install 'pipecc[runtime]'): {err}"
    return f"pipecc run: the runtime could not be imported: {type(err).__name__}: {err}"


def count(text: str) -> int:
    """An argparse type: a non-negative integer."""
    value = int(text) if text.isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


BYTE_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str, flag: str) -> float:
    """`20GiB`, `1.5 MiB`, `4096` → bytes (binary units only); InputError otherwise."""
    value = text.strip()
    scale = 1
    for unit, factor in BYTE_UNITS.items():
        if value.endswith(unit):
            value, scale = value[: -len(unit)].strip(), factor
            break
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not math.isfinite(number) or number <= 0 or (scale == 1 and not value.isdigit()):
        raise InputError(
            f"{flag}: expected a size in bytes, a whole number or one with a binary unit "
            f"({', '.join(BYTE_UNITS)}) such as 20GiB, got {text!r}"
        )
    return number * scale


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
    program (.json), or a torch.distributed.pipelining action CSV (.csv), resolved for the
    command's --backend as `pipecc run` resolves it there (`pipecc.driver.load.resolve`):
    its --comm-policy, --align and --lowering, where it has them, are inputs of that one
    resolution. Its notes (what the reader ignored, the comm ops a flag replaced) go to
    stderr."""
    resolved = resolve(request(path, args))
    print_notes(resolved.notes)
    return resolved.program


def request(path: str, args: argparse.Namespace, backend: RunBackend | None = None) -> Request:
    """The resolution the command's flags ask for, on `backend` (default: its --backend)."""
    backend = backend or backend_of(args)
    sizes = {"ranks": args.ranks, "microbatches": args.microbatches}
    return Request(
        path, **sizes, defines=dict(args.defines), backend=backend, lowering=lowering(args, backend)
    )


def print_notes(notes: tuple[str, ...]) -> None:
    """Notes on stderr, one `note:` line each."""
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


LOWERING_CHOICES = tuple(item.value for item in LoweringStyle)


def add_lowering_arg(parser: argparse.ArgumentParser) -> None:
    """`--lowering pipecc|torch|torch-defer`: whose rules place the comm ops of a compute
    order (docs/interop.md); one option of the one resolution (`Lowering.style`)."""
    parser.add_argument(
        "--lowering",
        choices=LOWERING_CHOICES,
        default=LoweringStyle.PIPECC.value,
        help="whose rules place the comm ops of a compute-only input: pipecc (default: "
        "pipecc's comm policy), torch (as torch 2.13's runtime lowers a compute-only "
        "schedule) or torch-defer (the same with defer_pp_recv=True); docs/interop.md",
    )


def requested_style(args: argparse.Namespace) -> LoweringStyle:
    """The command's --lowering (pipecc where it has no such flag), refusing a torch
    lowering together with --align or --comm-policy (both place the comm ops)."""
    style = LoweringStyle(getattr(args, "lowering", LoweringStyle.PIPECC.value))
    if style is not LoweringStyle.PIPECC:
        for flag, given in (
            ("--align", getattr(args, "align", False)),
            ("--comm-policy", getattr(args, "comm_policy", None) is not None),
        ):
            if given:
                raise InputError(
                    f"--lowering {style.value} and {flag} both place the comm ops: give one"
                )
    return style


def lowering(args: argparse.Namespace, backend: RunBackend = DEFAULT_BACKEND) -> Lowering:
    """How the command's flags ask for the comm ops to be placed (an alignment under
    --comm, else the backend's comm model)."""
    policy = getattr(args, "comm_policy", None)
    shared = getattr(args, "shared", None) or ()
    mesh = mesh_options(args)
    style = requested_style(args)  # --lowering torch|torch-defer (docs/interop.md)
    if style is not LoweringStyle.PIPECC:
        return Lowering(style=style, shared=shared, mesh=mesh)
    if not getattr(args, "align", False):
        return Lowering(policy=policy, shared=shared, mesh=mesh)
    if policy is not None:
        raise InputError("--align and --comm-policy both place the comm ops: give one of them")
    align = Alignment(load_costs(args), comm_model(args, backend))
    return Lowering(align=align, shared=shared, mesh=mesh)


def mesh_options(args: argparse.Namespace) -> MeshOptions | None:
    """The command's --mesh, --fsdp, --max-active-stages and --prefetch (None: none given)."""
    text = getattr(args, "mesh", None) or ""
    fsdp = bool(getattr(args, "fsdp", False))
    active = getattr(args, "max_active_stages", None)
    prefetch = getattr(args, "prefetch", None)
    moe = moe_options(args)
    if not (text or fsdp or active is not None or prefetch is not None or moe is not None):
        return None
    policy = FsdpPolicy(active, DEFAULT_POLICY.prefetch if prefetch is None else prefetch)
    return MeshOptions(text, fsdp, policy, moe)


def moe_options(args: argparse.Namespace) -> MoeOptions | None:
    """--moe K and --moe-overlap, with a cost file's per-stage `moe_layers` over K (None:
    no --moe)."""
    layers = getattr(args, "moe", None)
    from_model = getattr(args, "moe_stages", None)  # pipecc run: the model file's, by stage
    if layers is None and from_model:
        overlap = getattr(args, "moe_overlap", None) != "off"
        return MoeOptions(max(from_model), tuple(enumerate(from_model)), overlap)
    if layers is None:
        if getattr(args, "moe_overlap", None) is not None:
            raise InputError("--moe-overlap is for --moe K (the MoE layers of every stage)")
        return None
    stages: tuple[tuple[int, int], ...] = ()
    if getattr(args, "cost_file", None) or getattr(args, "cost", None):
        costs = load_costs(args)
        if costs.base.moe_layers is not None:  # [cost] moe_layers: every stage's
            layers = _layers(costs.base.moe_layers)
        stages = tuple(
            (s, _layers(c.moe_layers)) for s, c in costs.stages if c.moe_layers is not None
        )
    return MoeOptions(layers, stages, getattr(args, "moe_overlap", None) != "off")


def _layers(value: float) -> int:
    """A cost file's `moe_layers`: a whole, non-negative number of layers."""
    if value != int(value) or value < 0:
        raise CostModelError(f"moe_layers={value:g} must be a whole number of layers")
    return int(value)


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """--moe, --moe-overlap (docs/parallelism.md, Expert parallelism)."""
    parser.add_argument(
        "--moe",
        type=non_negative,
        metavar="K",
        help="K MoE layers in every stage (a cost file's moe_layers overrides it per stage): "
        "each stage's F, B and I run as the layers' phases with an all_to_all over ep for "
        "every dispatch and combine (docs/parallelism.md)",
    )
    parser.add_argument(
        "--moe-overlap",
        choices=("on", "off"),
        help="on (default): a fused F&B of MoE stages interleaves its halves' phases, each "
        "all_to_all hidden behind the other half (DualPipe); off: its halves in sequence",
    )


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    """--mesh, --fsdp, --max-active-stages, --prefetch (docs/parallelism.md)."""
    parser.add_argument(
        "--mesh",
        metavar="DIM=N,...",
        type=mesh_text,
        help="the device mesh: dp_shard=2,dp_replicate=2,tp=2 (pp is -P; torchtitan's names "
        "pp, dp_replicate, dp_shard, ep, cp, tp): dp_shard > 1 adds FSDP's UNSHARD, RESHARD and "
        "REDUCE_GRAD, dp_replicate or ep > 1 each stage's data-parallel all_reduce; verify and "
        "simulate replay the whole mesh (docs/parallelism.md)",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="add FSDP's stage actions (implied by a mesh with dp_shard > 1)",
    )
    parser.add_argument(
        "--max-active-stages",
        type=positive,
        metavar="K",
        help="FSDP residency: at most K stages of a rank unsharded at once (default: no bound)",
    )
    parser.add_argument(
        "--prefetch",
        type=non_negative,
        metavar="N",
        help="FSDP lookahead: unshard the stages of the next N computations ahead (default 1)",
    )


def mesh_text(text: str) -> str:
    """An argparse check of --mesh's sizes (its pp is checked against P later)."""
    try:
        parse_mesh(text)
    except InputError as err:
        raise argparse.ArgumentTypeError(err.message) from None
    return text


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {value}")
    return value


def add_backend_arg(parser: argparse.ArgumentParser) -> None:
    """--backend: resolve the program as `pipecc run` does on that backend."""
    parser.add_argument(
        "--backend",
        choices=tuple(b.value for b in RunBackend),
        default=DEFAULT_BACKEND.value,
        help="resolve the program as 'pipecc run' does on this backend (default: nccl): a "
        "compute-only input gets its comm policy (gloo: early-recv, nccl: default), and "
        "--comm defaults to its comm model (gloo: rendezvous, nccl: nccl-single; simulate "
        "and compare: nccl); hand-placed comm ops and a .json's are kept (docs/runtime.md)",
    )


def backend_of(args: argparse.Namespace) -> RunBackend:
    """The command's --backend (nccl where it has no such flag)."""
    return RunBackend(getattr(args, "backend", DEFAULT_BACKEND.value))


def comm_model(args: argparse.Namespace, backend: RunBackend | None = None) -> CommModel:
    """The command's --comm, else the comm model of `backend` (default: its --backend): the
    one its runtime follows (nccl-single on nccl), which verify, run, --align and search use."""
    given = getattr(args, "comm", None)
    if given is not None and given != "all":
        return CommModel(given)
    return (backend or backend_of(args)).comm_model


def simulated_model(args: argparse.Namespace) -> CommModel:
    """What `simulate` and `compare` replay under: the command's --comm, else its backend's
    comm model, except on nccl, where they still predict under `nccl` (per-peer streams), as
    their documented outputs were made; --comm nccl-single predicts what the runtime posts."""
    backend = backend_of(args)
    if getattr(args, "comm", None) is None and backend is RunBackend.NCCL:
        return CommModel.NCCL
    return comm_model(args, backend)


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
        help="where sends, receives and waits go: default (safe under every comm model) or "
        "early-recv (every receive posted at the start of the step: faster on gloo, "
        "deadlocks under NCCL; docs/compile.md). Given, it places every comm op afresh, "
        "hand-placed ones and a .json's included, and says how many it replaced; without "
        "it a compute-only input gets the backend's policy (gloo: early-recv, nccl: "
        "default) and any other keeps its comm ops",
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


def add_cost_args(parser: argparse.ArgumentParser, *, backend: bool = False) -> None:
    """--cost, --cost-file and --comm: the simulator's inputs (DESIGN §6). With `backend`,
    also --backend, and --comm defaults to the backend's comm model."""
    default = "nccl)"
    if backend:
        add_backend_arg(parser)
        default = "the backend's: nccl (--align: nccl-single), rendezvous on gloo)"
    parser.add_argument(
        "--cost",
        metavar="K=V,...",
        help="durations (per share, 1/P, of the model), comm latency and host time, e.g. "
        "F=1,B=2,I=1,W=1,FB=2.5,comm=0.1,post=0.05,wait=0.01,sync=3 (docs/simulate.md; "
        "default F=1,B=2,I=1,W=1)",
    )
    parser.add_argument(
        "--cost-file",
        metavar="TOML",
        help="a cost file ([cost] per share, [cost.stage.N] for the program's stage N; "
        "`pipecc run --profile` writes one, converted for the program); --cost overrides "
        "its global values",
    )
    parser.add_argument(
        "--comm",
        choices=COMM_MODELS,
        default=None if backend else "nccl",
        help=f"how sends and receives complete (DESIGN §5; default: {default})",
    )


def load_costs(args: argparse.Namespace) -> CostModel:
    """The cost model from --cost-file and --cost (flags win), as given: per share of the
    model (`program_costs` converts it for a program)."""
    model = load_cost_file(args.cost_file) if args.cost_file else CostModel()
    if args.cost:
        model = model.overridden_by(parse_cost_flag(args.cost))
    return model


def program_costs(costs: CostModel, program: Program) -> CostModel:
    """`costs` as `program`'s stages run them (docs/simulate.md), saying on stderr how a
    file measured on another cut was converted."""
    converted = costs.for_program(program)
    if note := converted.conversion():
        print(f"note: {note}", file=sys.stderr)
    return converted
