"""`pipecc run`: execute a schedule on local processes with a user's model (needs torch).

The runtime and torch are imported inside `run`, so `pipecc` itself works without torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from pipecc.commands.common import (
    SubParsers,
    add_input_args,
    add_policy_arg,
    load_input,
    positive,
    write_output,
)
from pipecc.diagnostics import InputError, ProgramError
from pipecc.driver.load import load, needs_lowering
from pipecc.ir.program import Program

DESCRIPTION = """\
Run a schedule on P local processes (gloo on CPU; NCCL when there is a GPU per rank) with the
stages of a model file, time its steps, and optionally check every gradient against a
single-process reference (docs/runtime.md).

The model file defines build_stage(stage, num_stages) -> module (one stage: each rank builds
only its own) or build_stages(num_stages) -> list of modules (the whole model as consecutive
stages), deterministic, make_batch(num_rows, seed) -> (inputs, targets), and
optionally loss_fn(output, target) (default: mean squared error, for floating targets),
boundaries(example_inputs) (explicit boundary specs) and autocast (a torch dtype).

When pipecc compiles the program itself (a .sched file, a bundled name, a compute-only
.json or .csv) and no --comm-policy is given, it places the comm ops for the backend:
early-recv on gloo, the default (NCCL-safe) policy on NCCL. A compiled .json runs as
compiled.
"""

EPILOG = """\
examples:
  pipecc run schedules/zb_h1.sched --nproc 4 --microbatches 8 --model examples/mlp.py --check
  pipecc run 1f1b --nproc 2 -M 16 --model examples/mlp.py --steps 10 --warmup 2 --json
  pipecc run 1f1b --nproc 2 -M 16 --model examples/mlp.py --profile costs.toml
  pipecc run zbv --nproc 2 -M 8 --model examples/mlp.py --comm-policy default --check
  pipecc run 1f1b --nproc 2 -M 4 --model examples/gpt.py --check --autocast bf16

exit codes: 0 ok; 1 the check failed or a rank failed (the message names the rank and
instruction); 2 input pipecc cannot use.
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
    cmd.add_argument("--nproc", dest="ranks", type=positive, help="processes to start (= -P)")
    cmd.add_argument("--model", required=True, metavar="FILE.py", help="the model file")
    cmd.add_argument(
        "--batch-size",
        type=positive,
        metavar="N",
        help="rows per step, split evenly into M microbatches (default: 8·M)",
    )
    cmd.add_argument("--steps", type=positive, default=1, help="timed steps (default: 1)")
    cmd.add_argument("--warmup", type=_count, default=0, help="untimed steps first (default: 0)")
    cmd.add_argument(
        "--check",
        action="store_true",
        help="compare every step with a single-process reference; exit 1 if not equal",
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
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a rank may wait for a message (default: 300)",
    )
    cmd.add_argument(
        "--profile", metavar="FILE", help="write measured per-(stage, op) costs as a TOML cost file"
    )
    add_policy_arg(cmd)
    cmd.set_defaults(run=run)


def _count(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _program(args: argparse.Namespace, backend: str) -> tuple[Program, str]:
    """The program to run, and where its comm policy came from: `flag` (--comm-policy),
    `program` (a compiled .json keeps its own) or `backend` (compiled here, for it)."""
    choice = "flag" if args.comm_policy is not None else "program"
    if args.comm_policy is None and _compiled_here(args):
        choice = "backend"
        args = argparse.Namespace(**{**vars(args), "comm_policy": _policy_for(backend)})
    program = load_input(args.file, args)
    if args.ranks is not None and program.num_ranks != args.ranks:
        raise InputError(
            f"{args.file}: the program is for {program.num_ranks} ranks, not --nproc {args.ranks}"
        )
    if args.microbatches is not None and program.num_microbatches != args.microbatches:
        raise InputError(
            f"{args.file}: the program is for {program.num_microbatches} "
            f"microbatches, not -M {args.microbatches}"
        )
    return program, choice


def _compiled_here(args: argparse.Namespace) -> bool:
    """A .sched file (or a bundled name), or a compute-only .json or .csv."""
    if not args.file.endswith((".json", ".csv")):
        return True
    return needs_lowering(load(args.file, lowering=None).program)


def _policy_for(backend: str) -> str:
    """The comm policy that suits the backend: early receives on gloo (each receive posted
    at the start of the step; faster, docs/performance.md), the NCCL-safe default on NCCL."""
    return "early-recv" if backend == "gloo" else "default"


def _ranks(args: argparse.Namespace) -> int:
    if args.ranks is not None:
        return int(args.ranks)
    if args.file.endswith((".json", ".csv")):
        return load(args.file, lowering=None).program.num_ranks
    raise InputError(f"{args.file}: a .sched file needs --nproc (or -P)")


def _import_failure(err: ImportError) -> str:
    """Why the runtime could not be imported: the runtime extra missing (torch, numpy), or
    anything else, said as it is."""
    missing = (err.name or "").split(".")[0]
    if isinstance(err, ModuleNotFoundError) and missing in ("torch", "numpy"):
        return f"pipecc run needs torch (pip install 'pipecc[runtime]'): {err}"
    return f"pipecc run: the runtime could not be imported: {type(err).__name__}: {err}"


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise InputError("--timeout must be positive")
    try:
        from pipecc.runtime.launcher import AUTOCAST, RunJob, backend_for, run_job  # type: ignore[import-not-found]  # runtime/ installed as pipecc.runtime
    except ImportError as err:
        raise InputError(_import_failure(err)) from None
    program, choice = _program(args, backend_for(_ranks(args)))
    batch = args.batch_size or 8 * program.num_microbatches
    job = RunJob(
        program=program,
        model=args.model,
        batch_size=batch,
        steps=args.steps,
        warmup=args.warmup,
        check=args.check,
        timeout=args.timeout,
        profile=args.profile is not None,
        seed=args.seed,
        derive_rng=args.derive_rng,
        autocast=AUTOCAST.get(args.autocast),
    )
    report = run_job(job)
    if args.profile is not None and report.cost_file is not None:
        write_output(report.cost_file, args.profile)
    fields = {k: v for k, v in asdict(report).items() if k != "cost_file"}
    fields["comm_choice"] = choice
    tolerance = args.tolerance if args.tolerance is not None else fields["tolerance"]
    fields["tolerance"] = tolerance
    failure = _failure(fields, tolerance) if args.check else None
    if args.json:
        print(json.dumps(fields))
    else:
        _print_summary(fields, args, failure)
    if failure is not None:
        raise ProgramError(f"check failed: {failure}")
    return 0


def _failure(fields: dict[str, Any], tolerance: float) -> str | None:
    rel = fields["max_rel_grad_diff"]
    if rel > tolerance:
        worst = "".join(
            f"\n  stage {d['stage']} '{d['name']}' on rank {d['rank']}: max abs diff "
            f"{d['max_abs']:.3g}, rel {d['max_rel']:.3g}"
            for d in fields["worst_params"]
        )
        return f"max_rel_grad_diff {rel:.3g} > tolerance {tolerance:g}; worst parameters:{worst}"
    loss, ref = fields["loss"], fields["reference_loss"]
    if abs(loss - ref) > tolerance * max(abs(ref), 1e-30):
        return f"loss {loss!r} differs from the reference {ref!r} (tolerance {tolerance:g})"
    return None


def _print_summary(fields: dict[str, Any], args: argparse.Namespace, failure: str | None) -> None:
    print(
        f"{fields['schedule']}  P={fields['ranks']} M={fields['microbatches']}  "
        f"batch {fields['batch_size']} rows  backend {fields['backend']}  comm {fields['comm']}"
    )
    line = f"loss {fields['loss']:.6g}"
    if fields["reference_loss"] is not None:
        line += f" (reference {fields['reference_loss']:.6g})"
    print(line)
    if args.check:
        verdict = "ok" if failure is None else "FAILED"
        print(
            f"gradients: max abs diff {fields['max_abs_grad_diff']:.3g}, max rel diff "
            f"{fields['max_rel_grad_diff']:.3g} (tolerance {fields['tolerance']:g}): {verdict}"
        )
    print(
        f"step {fields['step_ms']:.3f} ms (median of {fields['steps']} step(s) after "
        f"{fields['warmup']} warm-up)"
    )
    if args.profile is not None:
        print(f"wrote {args.profile}")
