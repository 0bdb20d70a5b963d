"""`pipecc compare`: several schedules, one cost model, one table sorted by makespan."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import PurePath

from pipecc.analysis.memory import format_bytes
from pipecc.api import resolve_schedule, schedule_parameters
from pipecc.commands.common import (
    SubParsers,
    add_cost_args,
    add_size_args,
    load_costs,
    load_input,
    simulated_model,
)
from pipecc.diagnostics import InputError, RequirementError
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel, Cut
from pipecc.simulate.timeline import RankStats, Timeline, simulate

EPILOG = """\
The costs are for one rank's share of the model (1/P of it), as in every command
(docs/simulate.md): a schedule that cuts the model into S stages per pipe (interleaved, ZB-V,
DualPipeV: 2P) runs each stage at P/S of them, so every row trains the same model and each
row's makespan is `pipecc simulate`'s. --per-stage uses the global costs as given for every
stage instead. `peak act` counts one stage's activations for one microbatch (DESIGN §2, as
simulate's); `peak shares` is the same peak in shares of the model (a V-shape stage is half
a share), the column that compares memory across rows.
-D values apply to the schedules that declare that parameter. A schedule whose `require`
rejects the sizes is listed as skipped, with the reason.

example:
  pipecc compare schedules/{1f1b,zb_h1,zb_h2,zbv}.sched -P 8 -M 32 --cost F=1,B=2,I=1,W=1
"""


PROGRAM_SUFFIXES = (".json", ".csv")


@dataclass(frozen=True, slots=True)
class Row:
    """One input's line: `label` names the input (unique in the table), `name` its schedule."""

    label: str
    name: str
    timeline: Timeline | None
    skipped: str = ""
    note: str = ""  # how a measured cost file was converted for this row's program


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "compare",
        help="simulate several schedules into one table",
        description="Simulate several schedules with the same sizes, "
        "costs and comm model; print one table sorted by makespan.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument(
        "files",
        metavar="FILE",
        nargs="+",
        help=".sched files, bundled names, compiled programs (.json) or torch action CSVs",
    )
    add_size_args(cmd)
    add_cost_args(cmd, backend=True)
    cmd.add_argument(
        "--per-stage",
        action="store_true",
        help="use the costs as given for every stage (no scaling by stage count)",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    args = argparse.Namespace(**{**vars(args), "comm": simulated_model(args).value})
    if args.ranks is None or args.microbatches is None:
        args = _sizes_of_programs(args)
    costs = load_costs(args)
    labels = input_labels(args.files, args.defines)
    rows = [_row(name, label, args, costs) for name, label in zip(args.files, labels, strict=True)]
    for note in dict.fromkeys(row.note for row in rows if row.note):  # each once, in order
        print(f"note: {note}", file=sys.stderr)
    rows.sort(
        key=lambda row: (
            row.timeline is None,
            row.timeline.makespan if row.timeline else 0.0,
            row.label,
        )
    )
    if args.json:
        print(json.dumps([_json(row) for row in rows]))
    else:
        print(format_table(rows, args, costs), end="")
    return 0


def _sizes_of_programs(args: argparse.Namespace) -> argparse.Namespace:
    """The sizes of the first file when every file is a program (.json, .csv) and -P or -M
    is missing: a program knows them; a .sched needs them to compile."""
    schedules = [name for name in args.files if not name.endswith(PROGRAM_SUFFIXES)]
    if schedules:
        raise InputError(
            f"compare needs -P/--ranks and -M/--microbatches to compile {schedules[0]}"
        )
    first = load_input(args.files[0], args)
    ranks = first.num_ranks if args.ranks is None else args.ranks
    microbatches = first.num_microbatches if args.microbatches is None else args.microbatches
    return argparse.Namespace(**{**vars(args), "ranks": ranks, "microbatches": microbatches})


def input_labels(files: list[str], defines: list[tuple[str, int]]) -> list[str]:
    """A label per input, unique in the table: a file by its name (`zbv_aligned.json`,
    `zbv.csv`, `my.sched`; by the path as written when two names are alike), a bundled
    schedule by its name; a schedule with the -D values it declares (`interleaved_1f1b -D
    V=3`); an input given twice is numbered (`zbv #2`)."""
    bases = [PurePath(name).name for name in files]  # a bundled name is its own
    labels = [
        (base if bases.count(base) == 1 else name) + _options(name, defines)
        for name, base in zip(files, bases, strict=True)
    ]
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique


def _options(name: str, defines: list[tuple[str, int]]) -> str:
    """` -D V=3`: the -D values a schedule declares (a program was compiled already)."""
    if name.endswith(PROGRAM_SUFFIXES) or not defines:
        return ""
    declared = schedule_parameters(resolve_schedule(name))
    return "".join(f" -D {key}={value}" for key, value in defines if key in declared)


def _row(name: str, label: str, args: argparse.Namespace, costs: CostModel) -> Row:
    if name.endswith(PROGRAM_SUFFIXES):
        program = load_input(name, args)  # checked and lowered as every command does
        if (program.num_ranks, program.num_microbatches) != (args.ranks, args.microbatches):
            raise InputError(
                f"{name}: the program is for P={program.num_ranks} "
                f"M={program.num_microbatches}, not -P {args.ranks} -M {args.microbatches}"
            )
    else:
        path = resolve_schedule(name)
        declared = schedule_parameters(path)
        defines = {k: v for k, v in args.defines if k in declared}
        given = argparse.Namespace(**{**vars(args), "defines": list(defines.items())})
        try:  # resolved for --backend as `pipecc run` resolves it there
            program = load_input(str(path), given)
        except RequirementError as err:  # not defined at these sizes; any other error is one
            return Row(label, path.stem, None, err.message)
    if args.per_stage:
        costs = costs.as_stage_costs(Cut.of(program))
    else:
        costs = costs.for_program(program)  # as simulate's: docs/simulate.md
    timeline = simulate(program, costs, model=CommModel(args.comm))
    return Row(label, program.schedule, timeline, note=costs.conversion())


def format_table(rows: list[Row], args: argparse.Namespace, costs: CostModel) -> str:
    best = min((row.timeline.makespan for row in rows if row.timeline), default=0.0)
    share = "per stage" if args.per_stage else "per 1/P of the model"
    width = max(18, *(len(row.label) + 1 for row in rows))
    lines = [
        f"# P={args.ranks} M={args.microbatches}  comm {args.comm}  costs {share}: "
        f"{costs.describe()}",
        f"{'input':{width}s} {'makespan':>9s} {'vs best':>8s} {'bubble':>7s} "
        f"{'peak act':>9s} {'peak shares':>12s} {'stall total':>12s}"
        + (f" {'peak bytes':>11s}" if costs.has_bytes() else ""),
    ]
    for row in rows:
        if row.timeline is None:
            lines.append(f"{row.label:{width}s} skipped: {row.skipped}")
            continue
        t = row.timeline
        peak = max(stats.peak_activations for stats in t.ranks)
        stalls = sum(s.length for stats in t.ranks for s in stats.stalls)
        ratio = t.makespan / best if best else 1.0
        lines.append(
            f"{row.label:{width}s} {t.makespan:>9g} {ratio:>7.3f}× {t.bubble_ratio:>7.1%} "
            f"{peak:>9} {peak_shares(t):>12g} {stalls:>12g}" + _byte_cell(t)
        )
    return "\n".join(lines) + "\n"


def peak_shares(timeline: Timeline) -> float:
    """The largest peak of live activations in shares of the model (1/P of it): a stage of
    a program with S stages per pipe is P/S shares (DESIGN §2's unit times that)."""
    peak = max(stats.peak_activations for stats in timeline.ranks)
    return peak * Cut.of(timeline.program).shares


def _json(row: Row) -> dict[str, object]:
    if row.timeline is None:
        return {"label": row.label, "schedule": row.name, "skipped": row.skipped}
    t = row.timeline
    return {
        "label": row.label,
        "schedule": row.name,
        "makespan": t.makespan,
        "bubble_ratio": t.bubble_ratio,
        "peak_activations": max(s.peak_activations for s in t.ranks),
        "peak_shares": peak_shares(t),
        "stall_total": sum(s.length for r in t.ranks for s in r.stalls),
        **_byte_json(t),
    }


def _largest(timeline: Timeline) -> RankStats | None:
    """The rank with the largest predicted peak in bytes (None without sizes)."""
    ranks = [stats for stats in timeline.ranks if stats.in_bytes is not None]
    return max(ranks, key=lambda stats: stats.peak_bytes or 0.0) if ranks else None


def _byte_json(timeline: Timeline) -> dict[str, object]:
    """simulate's names for the largest rank's peak in bytes, and that rank."""
    stats = _largest(timeline)
    if stats is None or stats.in_bytes is None:
        return {
            "peak_bytes": None,
            "peak_bytes_rank": None,
            "peak_bytes_at": None,
            "peak_breakdown": None,
        }
    return {
        "peak_bytes": stats.in_bytes.peak,
        "peak_bytes_rank": stats.rank,
        "peak_bytes_at": stats.in_bytes.at,
        "peak_breakdown": stats.in_bytes.breakdown.to_json(),
    }


def _byte_cell(timeline: Timeline) -> str:
    """The largest rank's predicted peak in bytes, and that rank ('' without sizes)."""
    stats = _largest(timeline)
    if stats is None or stats.peak_bytes is None:
        return ""
    return f" {format_bytes(stats.peak_bytes):>11s} (rank {stats.rank})"
