"""`pipecc compare`: several schedules, one cost model, one table sorted by makespan."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import PurePath

from pipecc.analysis.memory import format_bytes
from pipecc.api import resolve_schedule, schedule_parameters
from pipecc.commands.common import (
    SubParsers,
    add_cost_args,
    add_size_args,
    define,
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
`span bubble` is the zero-bubble papers' rate: 1 - busy / (last end - first start) of the
rank whose span is longest (fill and drain left out; `bubble` counts them).
-D values apply to the schedules that declare that parameter. FILE:NAME=VALUE,... gives
options to one row (they override -D there), so one schedule can be several rows:
vhalf.sched:frac=2 vhalf.sched:frac=3. A schedule whose `require` rejects the sizes is
listed as skipped, with the reason.

examples:
  pipecc compare schedules/{1f1b,zb_h1,zb_h2,zbv}.sched -P 8 -M 32 --cost F=1,B=2,I=1,W=1
  pipecc compare interleaved_1f1b:V=2 interleaved_1f1b:V=4 1f1b -P 4 -M 16
"""


PROGRAM_SUFFIXES = (".json", ".csv")
_ROW_OPTIONS = re.compile(r"[A-Za-z_]\w*=[^,]*(,[A-Za-z_]\w*=[^,]*)*")


@dataclass(frozen=True, slots=True)
class Input:
    """One FILE argument: the input, and the options given to its row (`FILE:V=2,X=1`)."""

    name: str
    options: tuple[tuple[str, int], ...] = ()
    written: str = ""  # the options as written, for the label

    @classmethod
    def parse(cls, text: str) -> Input:
        """`zbv`, `my.sched:frac=2` or `my.sched:frac=2,V=3` (the options after the last `:`)."""
        name, sep, written = text.rpartition(":")
        if not sep or not name or _ROW_OPTIONS.fullmatch(written) is None:
            return cls(text)
        try:
            options = tuple(define(part) for part in written.split(","))
        except argparse.ArgumentTypeError as err:
            raise InputError(f"{text}: {err}") from None
        if name.endswith(PROGRAM_SUFFIXES):
            raise InputError(
                f"{text}: a compiled program has its parameters already; row options are "
                "for .sched files and bundled schedules"
            )
        return cls(name, options, written)


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
    inputs = [Input.parse(text) for text in args.files]
    labels = input_labels(args.files, args.defines)
    rows = [_row(found, label, args, costs) for found, label in zip(inputs, labels, strict=True)]
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
    schedules = [
        found.name for found in map(Input.parse, args.files) if not _is_program(found.name)
    ]
    if schedules:
        raise InputError(
            f"compare needs -P/--ranks and -M/--microbatches to compile {schedules[0]}"
        )
    first = load_input(args.files[0], args)
    ranks = first.num_ranks if args.ranks is None else args.ranks
    microbatches = first.num_microbatches if args.microbatches is None else args.microbatches
    return argparse.Namespace(**{**vars(args), "ranks": ranks, "microbatches": microbatches})


def _is_program(name: str) -> bool:
    return name.endswith(PROGRAM_SUFFIXES)


def input_labels(files: list[str], defines: list[tuple[str, int]]) -> list[str]:
    """A label per input, unique in the table: a file by its name (`zbv_aligned.json`,
    `zbv.csv`, `my.sched`; by the path as written when two names are alike), a bundled
    schedule by its name; its row's options as written (`vhalf.sched:frac=2`); a schedule
    with the -D values it declares and its row does not set (`interleaved_1f1b -D V=3`); an
    input given twice is numbered (`zbv #2`)."""
    inputs = [Input.parse(text) for text in files]
    names = [found.name for found in inputs]
    bases = [PurePath(name).name for name in names]  # a bundled name is its own
    labels = [
        (base if bases.count(base) == 1 else found.name)
        + (f":{found.written}" if found.written else "")
        + _options(found, defines)
        for found, base in zip(inputs, bases, strict=True)
    ]
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique


def _options(found: Input, defines: list[tuple[str, int]]) -> str:
    """` -D V=3`: the -D values a schedule declares and its row does not set (a program was
    compiled already)."""
    if _is_program(found.name) or not defines:
        return ""
    declared = schedule_parameters(resolve_schedule(found.name))
    own = {key for key, _ in found.options}
    return "".join(
        f" -D {key}={value}" for key, value in defines if key in declared and key not in own
    )


def _row(found: Input, label: str, args: argparse.Namespace, costs: CostModel) -> Row:
    name = found.name
    if _is_program(name):
        program = load_input(name, args)  # checked and lowered as every command does
        if (program.num_ranks, program.num_microbatches) != (args.ranks, args.microbatches):
            raise InputError(
                f"{name}: the program is for P={program.num_ranks} "
                f"M={program.num_microbatches}, not -P {args.ranks} -M {args.microbatches}"
            )
    else:
        path = resolve_schedule(name)
        declared = schedule_parameters(path)
        defines = {k: v for k, v in args.defines if k in declared} | dict(found.options)
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
        f"{costs.describe()}  (peak act in stage units, peak shares in 1/P of the model)",
        f"{'input':{width}s} {'makespan':>9s} {'vs best':>8s} {'bubble':>7s} "
        f"{'span bubble':>12s} {'peak act':>9s} {'peak shares':>12s} {'stall total':>12s}"
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
            f"{t.span_bubble_ratio:>12.1%} {peak:>9} {peak_shares(t):>12g} {stalls:>12g}"
            + _byte_cell(t)
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
        "span_bubble_ratio": t.span_bubble_ratio,
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
