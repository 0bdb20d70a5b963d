"""`pipecc run`: execute a schedule on local processes with a user's model (needs torch).

The runtime and torch are imported inside `run`, so `pipecc` itself works without torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, NamedTuple

from pipecc.commands.common import (
    SubParsers,
    add_input_args,
    add_lowering_arg,
    add_moe_args,
    add_policy_arg,
    add_shared_arg,
    count,
    lowering,
    mesh_text,
    positive,
    print_notes,
    runtime_import_failure,
    write_output,
)
from pipecc.commands.run_model import NOTHING, FromModel, from_model, partition
from pipecc.commands.run_report import (
    check_failure,
    gradient_sums,
    memory_fields,
    print_summary,
    tie_notes,
)
from pipecc.diagnostics import InputError, ProgramError
from pipecc.driver.check import Resolution, verify_source
from pipecc.driver.load import Resolved, RunBackend, read_source, refuse_invalid
from pipecc.driver.mesh import run_mesh
from pipecc.ir.program import Program
from pipecc.semantics import CommModel
from pipecc.semantics.costs import parse_cost_text
from pipecc.simulate import simulate
from pipecc.verify import Options, report

# the timed and warm-up steps of `pipecc run --profile` unless --steps and --warmup say
PROFILE_STEPS = 20
PROFILE_WARMUP = 2

DESCRIPTION = """\
Run a schedule on P local processes (gloo on CPU; NCCL when there is a GPU per rank) with the
stages of a model file, time its steps, and optionally check every gradient against a
single-process reference (docs/runtime.md).

The model file defines build_stage(stage, num_stages) -> module (one stage: each rank builds
only its own) or build_stages(num_stages) -> list of modules (the whole model as consecutive
stages), deterministic, make_batch(num_rows, seed) -> (inputs, targets) or (inputs,
targets, context) (context: a dict of keyword inputs every stage takes, split like the
inputs, never sent), and optionally loss_fn(output, target) (default: mean squared error,
for floating targets), boundaries(example_inputs) (explicit boundary specs), autocast (a
torch dtype) and build_model() (the whole model, for --check --reference whole).

The program is resolved as `pipecc verify FILE --backend B --shared T` resolves it, B the
backend this run uses, T the model file's ties (its shared(), Parameter identity in its
build_stages built on the meta device) and --shared's: the gradient sum of every tie held
on several ranks is an instruction of the program. A compute-only input gets the backend's
comm policy (early-recv on gloo, the default on NCCL); a .sched file's hand-placed comm ops
are kept; a .json or .csv with comm ops runs as it is; --comm-policy, --align or --lowering
place every comm op afresh (a note says how many they replaced). Before any process starts,
that exact program is verified under the backend's comm model (gloo: rendezvous, NCCL:
nccl-single) with verify's checks; one that fails is refused (exit 1, with verify's report)
unless --unverified. The first line says which program runs and that it verified.
"""

EPILOG = """\
examples:
  pipecc run schedules/zb_h1.sched --nproc 4 --microbatches 8 --model examples/mlp.py --check
  pipecc run 1f1b --nproc 2 -M 16 --model examples/mlp.py --steps 10 --warmup 2 --json
  pipecc run 1f1b --nproc 2 -M 16 --model examples/mlp.py --profile costs.toml
  pipecc run zb_h1 --nproc 2 -M 8 --model examples/gpt.py --memory
  pipecc run zbv --nproc 2 -M 8 --model examples/mlp.py --comm-policy default --check
  pipecc run 1f1b --nproc 2 -M 4 --model examples/gpt.py --check --autocast bf16
  pipecc run zb_h1 --nproc 2 -M 4 --model examples/moe.py --check --reference whole
  pipecc run dl.sched --nproc 2 -M 2 --model examples/mlp.py --unverified --timeout 5
  pipecc run 1f1b --nproc 2 -M 4 --model examples/gpt_stages.py --profile-layers layers.toml
  pipecc run best.sched --nproc 2 -M 4 --model examples/gpt_stages.py --partition cut.toml --check

exit codes: 0 ok; 1 the program fails verification (refused, with verify's report), the
check failed or a rank failed (the message names the rank and instruction); 2 input pipecc
cannot use.
"""


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "run",
        help="run a schedule on local processes with a model file (needs torch)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_input_args(cmd)
    cmd.add_argument(
        "--nproc",
        dest="ranks",
        type=positive,
        help="processes to start (= -P; with --mesh the world size, the mesh's product)",
    )
    cmd.add_argument(
        "--mesh",
        metavar="DIM=N,...",
        type=mesh_text,
        help="run on a device mesh, e.g. dp_replicate=2, dp_shard=2 or tp=2 (pp: --nproc "
        "over the other sizes): each replica takes its contiguous share of --batch-size, the "
        "program gets each stage's data-parallel all_reduce and FSDP's stage actions, the "
        "stages FSDP2 (dp_shard) and the model file's parallelize (tp); --check compares "
        "with the whole batch (docs/parallelism.md)",
    )
    cmd.add_argument("--model", required=True, metavar="FILE.py", help="the model file")
    cmd.add_argument(
        "--batch-size",
        type=positive,
        metavar="N",
        help="rows per step, split evenly into M microbatches (default: 8·M)",
    )
    cmd.add_argument(
        "--steps",
        type=positive,
        help=f"timed steps (default: 1; with --profile or --profile-layers {PROFILE_STEPS})",
    )
    cmd.add_argument(
        "--warmup",
        type=count,
        help="untimed steps first (default: 0; with --profile or --profile-layers "
        f"{PROFILE_WARMUP})",
    )
    cmd.add_argument(
        "--check",
        action="store_true",
        help="compare every step with a single-process reference; exit 1 if not equal",
    )
    cmd.add_argument(
        "--reference",
        choices=("auto", "stages", "whole"),
        default="auto",
        help="what --check compares with: the model file's stages run one after another in "
        "one process, or the whole unsplit model of its build_model(), parameter by "
        "parameter name, dropout off (checks the split too: a forgotten layer, a dropped "
        "norm, an undeclared tie); auto (default): whole where the file defines build_model",
    )
    cmd.add_argument(
        "--tolerance",
        type=float,
        help="largest max_rel_grad_diff (and relative loss difference) that --check accepts "
        "(default: 1e-5 in fp32, 1e-2 with bf16 or fp16 parameters or autocast)",
    )
    cmd.add_argument(
        "--seed", type=int, default=0, help="the seed of the per-forward RNG states (default: 0)"
    )
    cmd.add_argument(
        "--no-rng-derivation",
        dest="derive_rng",
        action="store_false",
        help="run forwards on the ranks' own RNG streams instead of states derived from "
        "(seed, step, stage, microbatch); --check then fails with dropout",
    )
    cmd.add_argument(
        "--autocast",
        choices=("bf16", "fp16"),
        help="run every forward under torch.autocast with this dtype (overrides the model file)",
    )
    cmd.add_argument(
        "--recompute",
        metavar="SPEC",
        help="recompute activations: 'full', 'none' or a selection of submodules for every "
        "stage, or per stage as '0:full,1:attn' (stages left out: none); a selection is "
        "'type=CLASS', 'name=PATTERN' (a module name or its dotted tail, * allowed) or a "
        "bare word (either), joined by '+', e.g. 'attn', 'type=Attention+name=mlp'; "
        "overrides the model file's `recompute` (docs/runtime.md, Recomputation)",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a rank may wait for a message (default: 300)",
    )
    cmd.add_argument(
        "--profile",
        metavar="FILE",
        help="write measured per-(stage, op) costs as a TOML cost file: the median over the "
        "timed steps of each step's mean; refused (exit 1) when a stage's compute time per "
        "step spreads beyond the bound (docs/runtime.md)",
    )
    cmd.add_argument(
        "--allow-noisy-profile",
        action="store_true",
        help="write the --profile file even when its spread exceeds the bound, or with one "
        "timed step (no spread)",
    )
    cmd.add_argument(
        "--memory",
        action="store_true",
        help="measure each rank's peak bytes over one more step and print it beside the "
        "predicted peak (docs/runtime.md, Memory)",
    )
    cmd.add_argument(
        "--optimizer",
        choices=("adamw", "adam", "sgd", "none"),
        help="the optimizer whose state --memory and --profile report in bytes (default: the "
        "model file's `optimizer`, else adamw: two fp32 states per parameter)",
    )
    cmd.add_argument(
        "--partition",
        metavar="CUT.toml",
        help="build the stages from this cut (the file `pipecc search --layers --partition` "
        "writes: each stage's layer names) with the model file's build_layers_model and "
        "init_stage (docs/runtime.md, Running a searched cut)",
    )
    cmd.add_argument(
        "--profile-layers",
        metavar="LAYERS.toml",
        help="write the per-layer profile `pipecc search --layers` reads: each layer of the "
        "model file's build_layers_model timed alone on one microbatch, then scaled to the "
        "stage times this run measured (timed steps as with --profile; docs/runtime.md)",
    )
    add_policy_arg(cmd)
    cmd.add_argument(
        "--align",
        action="store_true",
        help="place comm ops for --cost/--cost-file under the backend's comm model (docs/align.md)",
    )
    cmd.add_argument("--cost", metavar="K=V,...", help="durations and latency for --align")
    cmd.add_argument("--cost-file", metavar="TOML", help="a cost file for --align")
    add_lowering_arg(cmd)
    add_shared_arg(cmd)  # with the model file's ties (its shared(), Parameter identity)
    add_moe_args(cmd)  # the MoE phases and all-to-alls, placed and verified like any op
    cmd.add_argument(
        "--unverified",
        action="store_true",
        help="run a program that fails verification anyway (to reproduce a hang: with a "
        "short --timeout); it still says so",
    )
    cmd.set_defaults(run=run)


def _timing(args: argparse.Namespace) -> tuple[int, int]:
    """(timed steps, warm-up steps): the flags, else 1 and 0, or with --profile or
    --profile-layers enough steps for a median and a spread. A profile of one step has no
    spread: refused unless --allow-noisy-profile."""
    profile = args.profile is not None
    timed = profile or args.profile_layers is not None  # the layers are scaled to the steps
    steps = args.steps or (PROFILE_STEPS if timed else 1)
    warmup = args.warmup if args.warmup is not None else (PROFILE_WARMUP if timed else 0)
    if profile and steps < 2 and not args.allow_noisy_profile:
        raise InputError(
            f"--profile with --steps {steps}: the spread of a profile needs 2 or more timed "
            f"steps (default with --profile: {PROFILE_STEPS}); --allow-noisy-profile writes it "
            "without one"
        )
    return steps, warmup


def _noisy(fields: dict[str, Any], args: argparse.Namespace) -> str | None:
    """Why the profile is not written: its worst spread is over the bound (None: write it)."""
    spread, bound = fields["profile_spread"], fields["profile_spread_bound"]
    if args.profile is None or args.allow_noisy_profile or spread is None or spread <= bound:
        return None
    return (
        f"{args.profile}: not written: the profile is noisy: {fields['profile_spread_at']} "
        f"has a spread of {spread:.3g} (the interquartile range of its compute time per step "
        f"over its median), over the bound {bound:g}; measure on a quieter machine or over more "
        "--steps, or give --allow-noisy-profile"
    )


class Verified(NamedTuple):
    """The program `pipecc run` runs, and what its verification said."""

    resolved: Resolved
    backend: RunBackend
    ok: bool

    def line(self) -> str:
        """`program: ..., verified under rendezvous (gloo): ok`"""
        verdict = "ok" if self.ok else "FAILED, run anyway (--unverified)"
        return f"program: {self.resolved.description}, verified under {self.model}: {verdict}"

    @property
    def model(self) -> str:
        return f"{self.backend.comm_model.value} ({self.backend.value})"


def program_to_run(
    args: argparse.Namespace,
    backend_for: Callable[[int], str],
    model: Callable[[Program, int], FromModel] | None = None,
) -> Verified:
    """The program to run on the backend `backend_for` picks for its processes (`--nproc`,
    the mesh's world with --mesh, whose pp is the program's P), resolved as `pipecc verify
    --backend` resolves it, verified once under that backend's comm model with verify's
    checks, and refused (exit 1, verify's report on stderr) when it fails, unless
    --unverified. `model`: what the model file adds (pipecc/commands/run_model.py): its
    tied stages, placed as --shared places them; on a mesh with ep > 1 without --moe, its
    MoE layers, placed as --moe places them."""
    mesh = run_mesh(args.mesh, args.ranks) if args.mesh else None
    ranks = mesh.pp if mesh is not None else args.ranks  # the program is one pipeline's
    world = mesh.world if mesh is not None else None
    source = read_source(
        args.file, ranks=ranks, microbatches=args.microbatches, defines=dict(args.defines)
    )
    _check_sizes(args, source.program, ranks)
    backend = RunBackend(backend_for(world or source.program.num_ranks))
    found = model(source.program, mesh.ep if mesh else 1) if model is not None else NOTHING
    args.moe_stages = found.moe
    placing = lowering(args, backend)
    resolution = Resolution(backend, replace(placing, shared=(*placing.shared, *found.ties)))
    outcome, resolved = verify_source(source, Options(models=(backend.comm_model,)), resolution)
    ok = outcome.report.ok
    if not ok and not source.compiled:  # a .json or .csv pipecc cannot use: exit 2, as anywhere
        if resolved is None:
            refuse_invalid(source.label, source.program, compute_only=source.compute_only)
        else:
            refuse_invalid(source.label, resolved.program, compute_only=False)
    if resolved is None:  # a .sched file with no correct program (an order that cannot run)
        print(report.text(outcome.report, outcome.label, outcome.notes), file=sys.stderr)
        raise ProgramError(
            f"{outcome.label}: refused: it has no correct program to run, as reported above"
        )
    print_notes(
        (*resolved.notes, *tie_notes(args.model, found.ties), *filter(None, (resolved.placed_for,)))
    )
    if not ok:
        print(report.text(outcome.report, outcome.label, outcome.notes), file=sys.stderr)
    if not (ok or args.unverified):
        raise ProgramError(
            f"{outcome.label}: refused: it fails verification under "
            f"{backend.comm_model.value} ({backend.value}), as reported above; --unverified "
            "runs it anyway"
        )
    return Verified(resolved, backend, ok)


def _check_sizes(args: argparse.Namespace, program: Program, ranks: int | None) -> None:
    """--nproc and -M, where given, agree with a compiled program's sizes; a program for a
    mesh of several pipelines is not run on one pipeline (docs/parallelism.md)."""
    if program.mesh is not None and program.mesh.pipelines > 1 and not args.mesh:
        raise InputError(
            f"{args.file}: the program is for the mesh {program.mesh.describe()}; "
            "run it with --mesh (pipecc run --mesh: docs/parallelism.md)"
        )
    if ranks is not None and program.num_ranks != ranks:
        raise InputError(
            f"{args.file}: the program is for {program.num_ranks} ranks, not --nproc {ranks}"
        )
    if args.microbatches is not None and program.num_microbatches != args.microbatches:
        raise InputError(
            f"{args.file}: the program is for {program.num_microbatches} "
            f"microbatches, not -M {args.microbatches}"
        )


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise InputError("--timeout must be positive")
    if not args.align and (args.cost or args.cost_file):
        raise InputError("--cost/--cost-file are for --align (without it nothing uses them)")
    try:
        import pipecc.runtime.tools.launcher as launcher  # type: ignore[import-not-found]  # runtime/ installed as pipecc.runtime
    except ImportError as err:
        raise InputError(runtime_import_failure(err)) from None
    steps, warmup = _timing(args)
    mesh = run_mesh(args.mesh, args.ranks) if args.mesh else None
    model = functools.partial(from_model, args, launcher.model_ties, launcher.moe_layers_of)
    verified = program_to_run(args, launcher.backend_for, model)
    program = verified.resolved.program
    if not args.json:
        print(verified.line(), flush=True)
    batch = args.batch_size or 8 * program.num_microbatches
    layers, cut_recompute = partition(args.partition, program)
    job = launcher.RunJob(
        program=program,
        model=args.model,
        batch_size=batch,
        steps=steps,
        warmup=warmup,
        check=args.check,
        timeout=args.timeout,
        profile=args.profile is not None or args.profile_layers is not None,
        seed=args.seed,
        derive_rng=args.derive_rng,
        autocast=launcher.AUTOCAST.get(args.autocast),
        reference=args.reference,
        mesh=mesh,
        memory=args.memory,
        optimizer=args.optimizer,
        recompute=_recompute(args, program, cut_recompute, launcher.parse_spec),
        layers=layers,
        profile_layers=args.profile_layers is not None,
        replay=functools.partial(replayed_ms, program=program, model=verified.backend.comm_model),
    )
    report = launcher.run_job(job)
    fields = {k: v for k, v in asdict(report).items() if k not in ("cost_file", "layer_profile")}
    _write_layers(report.layer_profile, args.profile_layers)
    memory_fields(fields, program, memory=args.memory)
    noisy = _noisy(fields, args)
    if args.profile is not None and report.cost_file is not None and noisy is None:
        write_output(report.cost_file, args.profile)
    fields["comm_choice"] = verified.resolved.choice.value
    fields["program"] = verified.resolved.description
    fields["verified"] = verified.backend.comm_model.value
    fields["verified_ok"] = verified.ok
    fields["gradient_sums"] = gradient_sums(program)  # every one in the verified program
    fields["mesh"] = mesh.describe() if mesh is not None else None
    tolerance = args.tolerance if args.tolerance is not None else fields["tolerance"]
    fields["tolerance"] = tolerance
    failure = check_failure(fields, tolerance) if args.check else None
    if args.json:
        print(json.dumps(fields))
    else:
        print_summary(fields, args, failure, written=noisy is None)
    if failure is not None:
        raise ProgramError(f"check failed: {failure}")
    if noisy is not None:
        raise ProgramError(noisy)
    return 0


def replayed_ms(text: str, *, program: Program, model: CommModel) -> float:
    """The makespan (ms) of `program` replayed under `model` with the cost file `text`: how
    `pipecc run --profile` calibrates the profile's `comm` (the runtime does not import the
    simulator; docs/runtime.md)."""
    costs = parse_cost_text(text, "the profile").for_program(program)
    return simulate(program, costs, model=model).makespan


def _recompute(
    args: argparse.Namespace,
    program: Program,
    cut: dict[int, str],
    parse: Callable[[str], object],
) -> object:
    """The stages to recompute: a program that names some (its `recompute` field) runs
    them, and --recompute or the cut's lines must then say the same (exit 2 otherwise);
    without, --recompute wins over the cut's lines, which win over the model file's."""
    given = parse(args.recompute) if args.recompute is not None else None
    if not program.recompute:
        return given if given is not None else (cut or None)
    named = set(program.recompute)
    stages = program.placement.num_stages(0)
    for what, spec in ((f"--recompute {args.recompute}", given), ("the cut's recompute", cut)):
        if spec and _full_stages(spec, stages) != named:
            raise InputError(
                f"{what} conflicts with the program, which recomputes stage(s) "
                f"{', '.join(map(str, sorted(named)))} (its recompute field): give the same "
                "stages or leave it out"
            )
    if given is not None:  # the same full stages, and perhaps selections on others: kept
        return given
    return {stage: "full" for stage in sorted(named)}


def _full_stages(spec: object, stages: int) -> set[int]:
    """The stages a recompute spec ("full", "none" or {stage: mode}) recomputes in full."""
    if isinstance(spec, str):
        return set(range(stages)) if spec == "full" else set()
    assert isinstance(spec, dict)
    return {int(stage) for stage, mode in spec.items() if mode == "full"}


def _write_layers(text: str | None, path: str | None) -> None:
    """--profile-layers: the per-layer profile, written."""
    if path is not None and text is not None:
        write_output(text, path)
