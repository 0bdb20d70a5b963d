"""`pipecc simulate`: a timed replay with a cost model — makespan, bubbles, stalls, memory."""

from __future__ import annotations

import argparse
import json
import sys

from pipecc.analysis.memory import format_bytes
from pipecc.commands.common import (
    SubParsers,
    add_cost_args,
    add_input_args,
    add_lowering_arg,
    add_mesh_args,
    add_moe_args,
    load_costs,
    load_input,
    positive,
    print_notes,
    program_costs,
    simulated_model,
    write_output,
)
from pipecc.diagnostics import InputError
from pipecc.driver.mesh import whole_mesh
from pipecc.interop.torch_csv import has_stage_ops
from pipecc.render.grid import format_timeline
from pipecc.render.png import MissingDependencyError, render_png
from pipecc.render.svg import render_svg
from pipecc.render.trace import render_trace
from pipecc.semantics.costs import Cut
from pipecc.simulate.timeline import Timeline, op_name, simulate

DESCRIPTION = """\
Replay a compiled schedule with durations (the same replay `pipecc verify` runs, DESIGN §5)
and report the makespan, the step (makespan + the cost model's `sync` for a program with
duplicated stages), the bubble ratio 1 - Σbusy / (P·makespan), per rank its busy and idle
time, the idle time between its first start and last end (the bubble zero-bubble schedules
remove), its peak live activations, and every stall (a wait on a receive or on a rendezvous
send). With `post`/`wait` costs, posts and waits take host time on their rank. Pictures:
--svg (a Gantt chart like the papers'), --png (needs matplotlib), --trace (Chrome/Perfetto
trace JSON, opens in ui.perfetto.dev).
"""

EPILOG = """\
examples:
  pipecc simulate schedules/1f1b.sched --ranks 4 --microbatches 8 --cost F=1,B=2
  pipecc simulate dualpipe -P 8 -M 20 --cost F=1,B=2,I=1,W=1,FB=2.6,comm=0.1 --svg out.svg
  pipecc simulate zb_h1 -P 4 -M 8 --cost-file costs.toml --json
"""


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "simulate",
        help="timed replay: makespan, bubbles, stalls, memory",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_input_args(cmd)
    add_lowering_arg(cmd)
    add_mesh_args(cmd)
    add_moe_args(cmd)
    add_cost_args(cmd, backend=True)
    cmd.add_argument(
        "--stall-threshold",
        type=float,
        default=0.0,
        metavar="T",
        help="report waits longer than T (default 0: every wait)",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object (DESIGN §6)")
    cmd.add_argument(
        "--width", type=positive, default=120, help="width of the text timeline (default: 120)"
    )
    cmd.add_argument("--svg", metavar="OUT", help="write an SVG Gantt chart")
    cmd.add_argument("--png", metavar="OUT", help="write a PNG Gantt chart (needs matplotlib)")
    cmd.add_argument("--trace", metavar="OUT", help="write a Chrome/Perfetto trace")
    cmd.add_argument("--arrows", action="store_true", help="draw messages in the SVG/PNG")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    program, whole = whole_mesh(load_input(args.file, args))  # a mesh: every rank of it
    print_notes(whole)
    costs = program_costs(load_costs(args), program)
    if costs.names_stage_ops() and not has_stage_ops(program):
        print(
            "note: the costs name UNSHARD, RESHARD or REDUCE_GRAD, and this program holds none "
            "(only a torch CSV's or torch's lowering has them: --lowering torch): they add no "
            "time",
            file=sys.stderr,
        )
    timeline = simulate(
        program, costs, model=simulated_model(args), stall_threshold=args.stall_threshold
    )
    if args.svg:
        write_output(render_svg(timeline, arrows=args.arrows), args.svg)
    if args.trace:
        write_output(render_trace(timeline), args.trace)
    if args.png:
        try:
            render_png(timeline, args.png, arrows=args.arrows)
        except MissingDependencyError as err:
            raise InputError(str(err)) from None
    if args.json:
        print(json.dumps(timeline.to_json()))
    else:
        print(summary(timeline), end="")
        if args.moe is not None:
            off = args.moe_overlap == "off"
            print(moe_lines(timeline, _other_form(args, timeline), sequential=off), end="")
        elif any(stats.a2a_exposed for stats in timeline.ranks):  # a MoE program as given
            exposed = ", ".join(f"rank {s.rank} {s.a2a_exposed:g}" for s in timeline.ranks)
            print(f"exposed a2a (blocked on all-to-alls): {exposed}")
        print(format_timeline(timeline, width=args.width), end="")
    return 0


def _other_form(args: argparse.Namespace, timeline: Timeline) -> Timeline:
    """The same step with --moe-overlap the other way (its fused MoE ops interleaved or in
    sequence), for the side-by-side prediction."""
    other = argparse.Namespace(**vars(args))
    other.moe_overlap = "on" if args.moe_overlap == "off" else "off"
    program, _ = whole_mesh(load_input(args.file, other))
    costs = timeline.costs
    return simulate(program, costs, model=timeline.model, stall_threshold=args.stall_threshold)


def moe_lines(timeline: Timeline, other: Timeline, *, sequential: bool) -> str:
    """The overlapped and the sequential step of a MoE program side by side (`timeline` is
    the sequential one when `sequential`), and per rank the all-to-all time each leaves
    exposed (the rank blocked on it)."""
    overlapped, plain = (other, timeline) if sequential else (timeline, other)
    lines = [
        f"moe: step overlapped {overlapped.step:g}, sequential {plain.step:g} "
        f"(--moe-overlap {'off' if sequential else 'on'} is the one shown)",
        "rank  exposed a2a overlapped  sequential",
    ]
    for a, b in zip(overlapped.ranks, plain.ranks, strict=True):
        lines.append(f"{a.rank:>4}  {a.a2a_exposed:>20g}  {b.a2a_exposed:>10g}")
    return "\n".join(lines) + "\n"


def summary(timeline: Timeline) -> str:
    """The headline figures and the per-rank table."""
    program = timeline.program
    step = f"   step {timeline.step:g} (sync {timeline.sync:g})" if timeline.sync else ""
    sizes = f"P={program.num_ranks} M={program.num_microbatches}"
    if program.mesh is not None:  # the whole mesh: its sizes, and the pipeline's
        m = program.num_microbatches // program.mesh.pipelines
        sizes = (
            f"mesh {program.mesh.describe()} ({program.num_ranks} ranks)  P={program.mesh.pp} M={m}"
        )
    lines = [
        f"# {program.schedule}  {sizes}  comm {timeline.model.value}  "
        f"costs {timeline.costs.describe()}",
        f"makespan {timeline.makespan:g}{step}   bubble ratio {timeline.bubble_ratio:.4f}   "
        f"span bubble ratio {timeline.span_bubble_ratio:.4f} "
        f"(rank {timeline.longest_rank.rank})",
        "rank   busy     idle  in-bubble  peak act  stalls (count, total)  "
        "dependency-bound  placement-bound",
    ]
    for stats in timeline.ranks:
        total = sum(stall.length for stall in stats.stalls)
        stalls = f"{len(stats.stalls):>3}, {total:g}"
        lines.append(
            f"{stats.rank:>4} {stats.busy:>6g} {stats.idle:>8g} {stats.internal_idle:>10g} "
            f"{stats.peak_activations:>9}  {stalls:<20s} {stats.dependency_bound:>16g} "
            f"{stats.placement_bound:>16g}"
        )
    shares = Cut.of(program).shares
    lines.append(
        "peak act: in stage units (one stage's activations for one microbatch; a stage of "
        f"this program is {shares:g} {'share' if shares <= 1 else 'shares'} of the model)"
    )
    lines += _byte_lines(timeline)
    if any(stats.host for stats in timeline.ranks):
        hosts = ", ".join(f"rank {stats.rank} {stats.host:g}" for stats in timeline.ranks)
        lines.append(f"host time in posts and waits (part of idle): {hosts}")
    return "\n".join(lines) + "\n"


def _byte_lines(timeline: Timeline) -> list[str]:
    """Each rank's predicted peak in bytes, where it is reached and what it is made of
    (only where the costs give sizes)."""
    lines: list[str] = []
    for stats in timeline.ranks:
        found = stats.in_bytes
        if found is None:
            continue
        if not lines:
            lines.append(
                "peak bytes per rank (at instruction: parameters, gradients, optimizer, "
                "activations, buffers, unsharded, workspace):"
            )
        instrs = timeline.program.ranks[stats.rank]
        where = f"@{found.at} {op_name(instrs[found.at])}" if found.at >= 0 else "start"
        parts = ", ".join(format_bytes(value) for value in found.breakdown)
        lines.append(f"{stats.rank:>4} {format_bytes(found.peak):>10}  {where}: {parts}")
    return lines
