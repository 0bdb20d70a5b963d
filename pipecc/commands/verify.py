"""`pipecc verify`: deadlocks, mismatched messages, data dependencies, coverage, placement
and memory, with witnesses (docs/verify.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pipecc.commands.common import (
    SubParsers,
    add_backend_arg,
    add_lowering_arg,
    add_mesh_args,
    add_moe_args,
    add_policy_arg,
    add_shared_arg,
    add_size_args,
    backend_of,
    comm_model,
    load_costs,
    lowering,
    parse_bytes,
    positive,
)
from pipecc.diagnostics import InputError
from pipecc.driver.check import Outcome, Resolution, Unusable, input_label, verify_source
from pipecc.driver.load import Resolved, read_source
from pipecc.driver.sweep import (
    CompileFailure,
    Distinct,
    Size,
    Skip,
    SweepResult,
    parse_sizes,
    sweep_files,
)
from pipecc.passes.torch_program import LoweringStyle
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel
from pipecc.verify import ALL_MODELS, Options, StallBudget, report

FORMATS = ("text", "json", "github")
COMMS = (*(m.value for m in CommModel), "all")

DESCRIPTION = """\
Prove a schedule or program free of deadlocks and mismatched messages under a comm model,
and check its data dependencies, coverage, placement and memory. FILE is a .sched file (with
-P/-M, or --sweep), a bundled schedule's name, a compiled program (.json), or a
torch.distributed.pipelining action CSV (.csv; compute-only CSVs are lowered with the backend's
comm policy first). Every violation names the instruction and its source line.

The program verified is the one `pipecc run` runs on --backend (default nccl), with the same
--comm-policy, --align or --lowering: `pipecc verify X --backend B [flags]` proves what
`pipecc run X [flags]` runs on B (docs/runtime.md).
"""

EPILOG = """\
comm models (--comm):
  nccl         rendezvous, plus per-peer FIFO streams: ops toward one peer run in posting
               order; a group is one unit on every stream it touches (a runtime that posts
               each peer's ops on a communicator of their own)
  nccl-single  (default, --backend nccl) one FIFO stream per rank for all peers: what
               pipecc's runtime runs on NCCL, every op through one communicator
  rendezvous   a send and its receive complete together once both are posted (gloo)
  eager        sends complete when posted (unbounded buffering); a program that passes
               only here passes eager but fails with a "needs-buffering" violation
  all          the verdict under each; exit 1 unless all pass

examples:
  pipecc verify schedules/dualpipe.sched -P 8 -M 20
  pipecc verify schedules/*.sched --sweep ranks=2..8 microbatches=1..40
  pipecc verify my.sched --sweep ranks=4,8 microbatches=8..32 frac=2,3   # and a -D parameter
  pipecc verify prog.json --comm all
  pipecc verify actions.csv --format github
  pipecc verify dualpipe -P 8 -M 20 --cost F=1,B=2,I=1,W=1,comm=0.1 --stall-budget 0
  pipecc verify zb_h1 -P 4 -M 8 --backend gloo     # what pipecc run runs on gloo

Several inputs are each verified and reported, whatever the others give: an input pipecc
cannot use is one error (on stderr, and one line, object or ::error annotation in the report).

exit codes: 0 every input verified, 1 a violation, 2 an input pipecc cannot use (whatever
the others gave).
"""


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "verify",
        help="prove a schedule free of deadlocks and mismatched messages",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument(
        "files",
        metavar="FILE",
        nargs="+",
        help=".sched file, bundled schedule name, .json program or torch .csv",
    )
    add_size_args(cmd)
    add_backend_arg(cmd)
    cmd.add_argument(
        "--comm",
        choices=COMMS,
        help="comm model to verify under (default: the backend's, nccl-single or rendezvous "
        "with --backend gloo)",
    )
    add_policy_arg(cmd)
    add_shared_arg(cmd)  # the sums `pipecc run` places for its model file's ties
    cmd.add_argument(
        "--align",
        action="store_true",
        help="place comm ops for --cost/--cost-file under --comm, as 'pipecc run --align' "
        "does (docs/align.md)",
    )
    cmd.add_argument(
        "--max-activations",
        type=positive,
        metavar="N",
        help="fail if a rank holds more than N activation units at once",
    )
    cmd.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="with --cost-file (or --cost) giving sizes in bytes: fail if a rank's predicted "
        "peak exceeds SIZE (per rank; bytes, or with KiB, MiB, GiB, TiB: 20GiB)",
    )
    cmd.add_argument(
        "--stall-budget",
        metavar="T|P%",
        help="with --cost/--cost-file: fail if a rank waits longer than T time "
        "units (or P%% of the makespan) for a message it could have had "
        "(a placement-bound wait, docs/align.md)",
    )
    cmd.add_argument(
        "--cost",
        metavar="K=V,...",
        help="durations (per share of the model) and latency for --stall-budget, sizes for "
        "--memory-budget (docs/simulate.md)",
    )
    cmd.add_argument(
        "--cost-file", metavar="TOML", help="a cost file for --stall-budget or --memory-budget"
    )
    cmd.add_argument(
        "--sweep",
        nargs="+",
        metavar="DIM=RANGE",
        help="verify every size: ranks=2..8 microbatches=1..40, and every value of a -D "
        "parameter: frac=2,3 (ranges a..b, lists a,b,c, or both: 1..4,8); every failing "
        "size is reported",
    )
    cmd.add_argument(
        "--jobs", type=positive, metavar="N", help="processes for --sweep (default: one per CPU)"
    )
    cmd.add_argument(
        "--format", choices=FORMATS, default="text", help="output format (default: text)"
    )
    add_lowering_arg(cmd)
    add_mesh_args(cmd)
    add_moe_args(cmd)
    cmd.add_argument(
        "--limit",
        type=positive,
        default=5,
        metavar="N",
        help="violations shown per kind (default: 5)",
    )
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    models = ALL_MODELS if args.comm == "all" else (comm_model(args),)
    costs, budget = _stall_options(args)
    memory = _memory_budget(args)
    options = Options(
        models=models,
        max_activations=args.max_activations,
        limit=args.limit,
        costs=costs,
        stall_budget=budget,
        memory_budget=memory,
    )
    defines = dict(args.defines)
    backend = backend_of(args)
    resolution = Resolution(backend, lowering(args, backend))
    if args.sweep and resolution.lowering.style is not LoweringStyle.PIPECC:
        raise InputError("--sweep verifies pipecc's lowering; give --lowering without --sweep")
    if args.sweep:
        ranks, microbatches, params = parse_sweep(args.sweep, args)
        jobs = args.jobs or os.cpu_count() or 1
        results = sweep_files(
            _sched_files(args.files),
            ranks=ranks,
            microbatches=microbatches,
            defines=defines,
            options=options,
            jobs=jobs,
            resolution=resolution,
            params=params,
        )
        _print_errors(results)
        print(_render_sweeps(results, args.format), end="")
        return _exit_code(results)
    outcomes: list[Outcome | Unusable] = []
    for path in args.files:
        try:
            outcomes.append(verified(path, args, options, resolution)[0])
        except InputError as err:  # reported with the others' verdicts
            outcomes.append(Unusable(path, input_label(path, args.ranks, args.microbatches), err))
    _print_errors(outcomes)
    print(_render_outcomes(outcomes, args.format), end="")
    return _exit_code(outcomes)


def verified(
    path: str, args: argparse.Namespace, options: Options, resolution: Resolution
) -> tuple[Outcome, Resolved | None]:
    """One input verified: read, resolved as `pipecc run` resolves it on the backend (the
    one resolution, `driver/load.resolve_source`), verified; its resolved program too."""
    source = read_source(
        path, ranks=args.ranks, microbatches=args.microbatches, defines=dict(args.defines)
    )
    return verify_source(source, options, resolution)


def _print_errors(results: list[Outcome | Unusable] | list[SweepResult | Unusable]) -> None:
    """Each unusable input's full error (location, caret) on stderr, as every command
    prints one; the report on stdout gives it one line among the others."""
    errors = [str(found.error) for found in results if isinstance(found, Unusable)]
    if errors:
        print("\n\n".join(errors), file=sys.stderr)


def _exit_code(results: list[Outcome | Unusable] | list[SweepResult | Unusable]) -> int:
    """2 if any input was unusable (in a sweep: a size that does not compile), else 1 if
    any violation, else 0."""
    verdicts = [_verdict(r) for r in results]
    return 2 if None in verdicts else 0 if all(verdicts) else 1


def _verdict(found: Outcome | SweepResult | Unusable) -> bool | None:
    """True verified, False a violation, None unusable (a sweep's size that does not
    compile included)."""
    if isinstance(found, Unusable):
        return None
    if isinstance(found, Outcome):
        return found.report.ok
    return None if found.compile_failed else found.ok


def _stall_options(args: argparse.Namespace) -> tuple[CostModel | None, StallBudget | None]:
    """--stall-budget with its cost model; a cost model alone is an error (simulate shows the
    waits without a budget)."""
    if args.stall_budget is None:
        moe = args.moe is not None  # a cost file's moe_layers
        if _has_costs(args) and not (args.align or moe) and args.memory_budget is None:
            raise InputError(
                "--cost/--cost-file are for --stall-budget or --memory-budget (to see the "
                "waits without a budget, use 'pipecc simulate')"
            )
        costs = load_costs(args) if args.memory_budget is not None and _has_costs(args) else None
        return costs, None
    if not _has_costs(args):
        raise InputError("--stall-budget needs a cost model: --cost K=V,... or --cost-file")
    return load_costs(args), StallBudget.parse(args.stall_budget)


def _has_costs(args: argparse.Namespace) -> bool:
    return bool(args.cost or args.cost_file)


def _memory_budget(args: argparse.Namespace) -> float | None:
    """--memory-budget in bytes; it needs a cost model that gives sizes."""
    if args.memory_budget is None:
        return None
    budget = parse_bytes(args.memory_budget, "--memory-budget")
    if not _has_costs(args) or not load_costs(args).has_bytes():
        raise InputError(
            "--memory-budget needs the sizes of the stages in bytes: a --cost-file from "
            "'pipecc run --profile' (param_bytes, act_bytes, ...) or --cost act_bytes=...,"
            "param_bytes=... (docs/simulate.md, Memory in bytes)"
        )
    return budget


def _sched_files(files: list[str]) -> list[str]:
    for path in files:
        if path.endswith((".json", ".csv")):
            raise InputError(
                f"{path}: --sweep compiles .sched files at each size; a compiled "
                "program has one size"
            )
    return files


def parse_sweep(
    specs: list[str], args: argparse.Namespace
) -> tuple[tuple[int, ...], tuple[int, ...], dict[str, tuple[int, ...]]]:
    """`ranks=2..8 microbatches=1..40 frac=2,3` (P= and M= also accepted; lists a,b,c): the
    ranks, the microbatch counts and each swept -D parameter's values; a missing dimension
    takes -P/-M. A parameter both swept and set with -D is an error."""
    try:
        found = parse_sizes(specs)
    except InputError as err:
        raise InputError(f"--sweep {err.message}") from None
    for key, given in (("ranks", args.ranks), ("microbatches", args.microbatches)):
        if key not in found:
            if given is None:
                raise InputError(f"--sweep needs {key}=A..B (or -P/-M for a fixed size)")
            found[key] = (given,)
    ranks, microbatches = found.pop("ranks"), found.pop("microbatches")
    for name, _ in args.defines:
        if name in found:
            raise InputError(f"-D {name}: {name} is also swept (--sweep {name}=...); give one")
    return ranks, microbatches, found


def _render_outcomes(outcomes: list[Outcome | Unusable], fmt: str) -> str:
    if fmt == "json":
        data = [_outcome_json(o) for o in outcomes]
        return json.dumps(data[0] if len(data) == 1 else data, indent=2) + "\n"
    render_one = report.github if fmt == "github" else report.text
    return "".join(
        _unusable(o, fmt) if isinstance(o, Unusable) else render_one(o.report, o.label, o.notes)
        for o in outcomes
    )


def _outcome_json(found: Outcome | Unusable) -> dict[str, object]:
    if isinstance(found, Unusable):
        return {"input": found.label, "ok": False, "error": report.error_json(found.error)}
    return report.as_json(found.report, found.label, found.notes)


def _unusable(found: Unusable, fmt: str) -> str:
    """An unusable input in a text or github report: its one line, or its annotation."""
    if fmt == "github":
        return report.unusable_annotation(found.label, found.path, found.error) + "\n"
    return report.unusable_line(found.label, found.error) + "\n"


def _skips(result: SweepResult) -> list[str]:
    """Skipped sizes grouped by requirement, M ranges per P: `P=4: M=1..3`."""
    lines = []
    reasons = sorted({s.reason for s in result.skipped})
    for reason in reasons:
        per_rank: dict[str, list[int]] = {}
        for s in result.skipped:
            if s.reason == reason:
                per_rank.setdefault(_skip_head(s), []).append(s.microbatches)
        sizes = "; ".join(f"{head}: M={_spans(ms)}" for head, ms in per_rank.items())
        count = sum(len(ms) for ms in per_rank.values())
        lines.append(f"  skipped {count} size(s), {reason}: {sizes}")
    return lines


def _skip_head(skip: Skip) -> str:
    """`P=4`, or `P=4 frac=2` in a sweep over a parameter: the M ranges' group."""
    return " ".join([f"P={skip.ranks}", *(f"{key}={value}" for key, value in skip.params)])


def _spans(values: list[int]) -> str:
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs)


def _render_sweeps(results: list[SweepResult | Unusable], fmt: str) -> str:
    if fmt == "json":
        data = [_sweep_json(r) for r in results]
        return json.dumps(data, indent=2) + "\n"
    return "".join(
        _unusable(r, fmt) if isinstance(r, Unusable) else _render_sweep(r, fmt) for r in results
    )


def _sweep_json(result: SweepResult | Unusable) -> dict[str, object]:
    if isinstance(result, Unusable):
        return {"file": result.path, "ok": False, "error": report.error_json(result.error)}
    return {
        "file": result.path,
        "ok": result.ok,
        "verified": result.verified,
        "skipped": [
            {"ranks": s.ranks, "microbatches": s.microbatches, **dict(s.params), "reason": s.reason}
            for s in result.skipped
        ],
        "failed": _failure_json(result.failed),
        "failures": [_distinct_json(found) for found in result.distinct()],
        "sizes": [{**_size_json(size), "verdict": verdict} for size, verdict in result.ran],
    }


def _size_json(size: Size) -> dict[str, object]:
    """`{"ranks": 4, "microbatches": 8, "frac": 2}`: a size and its swept parameters."""
    return {"ranks": size.ranks, "microbatches": size.microbatches, **dict(size.params)}


def _distinct_json(found: Distinct) -> dict[str, object]:
    """One distinct failure: what it is, every size it occurs at, its first size's report."""
    return {
        "failure": found.signature,
        "sizes": [_size_json(size) for size in found.sizes],
        "first": _failure_json(found.found),
    }


def _render_sweep(r: SweepResult, fmt: str) -> str:
    """One file's sweep: the first size of each distinct failure in full, then its verdict
    line, a line per distinct failure with every size it occurs at, and the skips."""
    out = []
    distinct = r.distinct()
    for found in distinct:
        failed = found.found
        if isinstance(failed, CompileFailure):
            out.append(_compile_failure(failed, fmt))
        else:
            out.append(
                (report.github if fmt == "github" else report.text)(failed.report, failed.label)
            )
    status = (
        "ok"
        if r.ok
        else f"FAILED at {len(r.failures)} size(s), {len(distinct)} distinct failure(s)"
    )
    lines = [
        f"{r.path}: {status}: {r.verified} size(s) verified, {len(r.skipped)} skipped",
        *(_distinct_line(found) for found in distinct),
        *_skips(r),
    ]
    text = "\n".join(lines)
    out.append(
        text + "\n" if fmt == "text" else "".join(f"::notice::{line.strip()}\n" for line in lines)
    )
    return "".join(out)


def _distinct_line(found: Distinct) -> str:
    """`  error[mismatch] at x.sched:3:22: 2 size(s): P=2 M=3, P=4 M=8 frac=2`."""
    sizes = ", ".join(size.label for size in found.sizes)
    return f"  {found.signature}: {len(found.sizes)} size(s): {sizes}"


def _compile_failure(failure: CompileFailure, fmt: str) -> str:
    err = failure.error
    text = f"{failure.label}: does not compile, although its requires allow this size"
    if fmt != "github":
        return f"{err}\n\n{text}\n"
    title = f"pipecc verify [compile] {failure.label}"
    shown = InputError(f"{text}: {err.message}", err.span)
    return report.error_annotation(shown, title) + "\n"


def _failure_json(failed: Outcome | CompileFailure | None) -> object:
    if failed is None:
        return None
    if isinstance(failed, CompileFailure):
        span = failed.error.span
        return {
            "input": failed.label,
            "compile_error": failed.error.message,
            **({"file": span.file, "line": span.line, "col": span.col} if span else {}),
        }
    return report.as_json(failed.report, failed.label)
