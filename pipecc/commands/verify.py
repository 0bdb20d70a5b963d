"""`pipecc verify`: deadlocks, mismatched messages, data dependencies, coverage, placement
and memory, with witnesses (docs/verify.md)."""

from __future__ import annotations

import argparse
import json
import os

from pipecc.commands.common import SubParsers, add_size_args, load_costs, positive
from pipecc.diagnostics import InputError
from pipecc.driver.check import Outcome, verify_file
from pipecc.driver.lowering import add_lowering_arg, requested_style
from pipecc.driver.sweep import CompileFailure, SweepResult, parse_sizes, sweep_files
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
torch.distributed.pipelining action CSV (.csv; compute-only CSVs are lowered with the default
comm policy first). Every violation names the instruction and its source line.
"""

EPILOG = """\
comm models (--comm):
  nccl         (default) rendezvous, plus per-peer FIFO streams: ops toward one peer run in
               posting order; a group is one unit on every stream it touches
  nccl-single  one FIFO stream per rank for all peers
  rendezvous   a send and its receive complete together once both are posted (gloo)
  eager        sends complete when posted (unbounded buffering); passing only here is
               reported as "needs buffering"
  all          the verdict under each; exit 1 unless all pass

examples:
  pipecc verify schedules/dualpipe.sched -P 8 -M 20
  pipecc verify schedules/*.sched --sweep ranks=2..8 microbatches=1..40
  pipecc verify prog.json --comm all
  pipecc verify actions.csv --format github
  pipecc verify dualpipe -P 8 -M 20 --cost F=1,B=2,I=1,W=1,comm=0.1 --stall-budget 0

exit codes: 0 verified, 1 a violation, 2 input pipecc cannot use.
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
    cmd.add_argument(
        "--comm", choices=COMMS, default="nccl", help="comm model to verify under (default: nccl)"
    )
    cmd.add_argument(
        "--max-activations",
        type=positive,
        metavar="N",
        help="fail if a rank holds more than N activation units at once",
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
        help="durations (per share of the model) and latency for --stall-budget (docs/simulate.md)",
    )
    cmd.add_argument("--cost-file", metavar="TOML", help="a cost file for --stall-budget")
    cmd.add_argument(
        "--sweep",
        nargs="+",
        metavar="DIM=RANGE",
        help="verify every size: ranks=2..8 microbatches=1..40 (ranges a..b, "
        "lists a,b,c, or both: 1..4,8)",
    )
    cmd.add_argument(
        "--jobs", type=positive, metavar="N", help="processes for --sweep (default: one per CPU)"
    )
    cmd.add_argument(
        "--format", choices=FORMATS, default="text", help="output format (default: text)"
    )
    add_lowering_arg(cmd)
    cmd.add_argument(
        "--limit",
        type=positive,
        default=5,
        metavar="N",
        help="violations shown per kind (default: 5)",
    )
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    models = ALL_MODELS if args.comm == "all" else (CommModel(args.comm),)
    costs, budget = _stall_options(args)
    options = Options(
        models=models,
        max_activations=args.max_activations,
        limit=args.limit,
        costs=costs,
        stall_budget=budget,
    )
    defines = dict(args.defines)
    style = requested_style(args)
    if args.sweep and style is not LoweringStyle.PIPECC:
        raise InputError("--sweep verifies pipecc's lowering; give --lowering without --sweep")
    if args.sweep:
        ranks, microbatches = parse_sweep(args.sweep, args)
        jobs = args.jobs or os.cpu_count() or 1
        results = sweep_files(
            _sched_files(args.files),
            ranks=ranks,
            microbatches=microbatches,
            defines=defines,
            options=options,
            jobs=jobs,
        )
        print(_render_sweeps(results, args.format), end="")
        return 0 if all(r.ok for r in results) else 1
    outcomes = [
        verify_file(
            path,
            ranks=args.ranks,
            microbatches=args.microbatches,
            defines=defines,
            options=options,
            style=style,
        )
        for path in args.files
    ]
    print(_render_outcomes(outcomes, args.format), end="")
    return 0 if all(o.report.ok for o in outcomes) else 1


def _stall_options(args: argparse.Namespace) -> tuple[CostModel | None, StallBudget | None]:
    """--stall-budget with its cost model; a cost model alone is an error (simulate shows the
    waits without a budget)."""
    if args.stall_budget is None:
        if args.cost or args.cost_file:
            raise InputError(
                "--cost/--cost-file are for --stall-budget (to see the waits "
                "without a budget, use 'pipecc simulate')"
            )
        return None, None
    if not (args.cost or args.cost_file):
        raise InputError("--stall-budget needs a cost model: --cost K=V,... or --cost-file")
    return load_costs(args), StallBudget.parse(args.stall_budget)


def _sched_files(files: list[str]) -> list[str]:
    for path in files:
        if path.endswith((".json", ".csv")):
            raise InputError(
                f"{path}: --sweep compiles .sched files at each size; a compiled "
                "program has one size"
            )
    return files


def parse_sweep(specs: list[str], args: argparse.Namespace) -> tuple[tuple[int, ...], ...]:
    """`ranks=2..8 microbatches=1..40` (P= and M= also accepted; lists a,b,c); a missing
    dimension takes -P/-M."""
    try:
        found = parse_sizes(specs)
    except InputError as err:
        raise InputError(f"--sweep {err.message}") from None
    for key, given in (("ranks", args.ranks), ("microbatches", args.microbatches)):
        if key not in found:
            if given is None:
                raise InputError(f"--sweep needs {key}=A..B (or -P/-M for a fixed size)")
            found[key] = (given,)
    return found["ranks"], found["microbatches"]


def _render_outcomes(outcomes: list[Outcome], fmt: str) -> str:
    if fmt == "json":
        data = [report.as_json(o.report, o.label, o.notes) for o in outcomes]
        return json.dumps(data[0] if len(data) == 1 else data, indent=2) + "\n"
    render_one = report.github if fmt == "github" else report.text
    return "".join(render_one(o.report, o.label, o.notes) for o in outcomes)


def _skips(result: SweepResult) -> list[str]:
    """Skipped sizes grouped by requirement, M ranges per P: `P=4: M=1..3`."""
    lines = []
    reasons = sorted({s.reason for s in result.skipped})
    for reason in reasons:
        per_rank: dict[int, list[int]] = {}
        for s in result.skipped:
            if s.reason == reason:
                per_rank.setdefault(s.ranks, []).append(s.microbatches)
        sizes = "; ".join(f"P={p}: M={_spans(ms)}" for p, ms in per_rank.items())
        count = sum(len(ms) for ms in per_rank.values())
        lines.append(f"  skipped {count} size(s), {reason}: {sizes}")
    return lines


def _spans(values: list[int]) -> str:
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs)


def _render_sweeps(results: list[SweepResult], fmt: str) -> str:
    if fmt == "json":
        data = [
            {
                "file": r.path,
                "ok": r.ok,
                "verified": r.verified,
                "skipped": [
                    {"ranks": s.ranks, "microbatches": s.microbatches, "reason": s.reason}
                    for s in r.skipped
                ],
                "failed": _failure_json(r.failed),
            }
            for r in results
        ]
        return json.dumps(data, indent=2) + "\n"
    out = []
    for r in results:
        if isinstance(r.failed, CompileFailure):
            out.append(_compile_failure(r.failed, fmt))
        elif r.failed is not None:
            body = (report.github if fmt == "github" else report.text)(
                r.failed.report, r.failed.label
            )
            out.append(body)
        status = "ok" if r.failed is None else f"FAILED at {r.failed.label}"
        lines = [
            f"{r.path}: {status}: {r.verified} size(s) verified, {len(r.skipped)} skipped",
            *_skips(r),
        ]
        text = "\n".join(lines)
        out.append(
            text + "\n"
            if fmt == "text"
            else "".join(f"::notice::{line.strip()}\n" for line in lines)
        )
    return "".join(out)


def _compile_failure(failure: CompileFailure, fmt: str) -> str:
    err = failure.error
    text = f"{failure.label}: does not compile, although its requires allow this size"
    if fmt != "github":
        return f"{err}\n\n{text}\n"
    where = ""
    if err.span is not None:
        where = f" file={err.span.file},line={err.span.line},col={err.span.col},"
    message = f"{text}: {err.message}".replace("%", "%25").replace("\n", "%0A")
    return f"::error{where or ' '}title=pipecc verify [compile]::{message}\n"


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
