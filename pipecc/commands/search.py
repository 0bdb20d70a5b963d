"""`pipecc search`: the fastest verified schedule for measured costs and a memory cap."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

from pipecc.api import read_text
from pipecc.commands.common import SubParsers, positive, write_output
from pipecc.commands.search_layers import add_layer_flags, run_layers
from pipecc.diagnostics import InputError
from pipecc.driver.load import RunBackend
from pipecc.frontend.expand import expand
from pipecc.frontend.parser import parse
from pipecc.interop import json_program
from pipecc.ir.placement import (
    Placement,
    bidirectional_placement,
    loop_placement,
    vshape_placement,
)
from pipecc.ir.program import Backend
from pipecc.passes.insert_comms import POLICIES
from pipecc.render.grid import format_timeline
from pipecc.search.engine import placements
from pipecc.search.lower import ALIGNED, Placing
from pipecc.search.run import (
    Outcome,
    Request,
    parse_mem,
    run_search,
)
from pipecc.search.sched import write_sched
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel, Cut, load_cost_file, parse_cost_flag
from pipecc.simulate.timeline import simulate

DESCRIPTION = """\
Search the op order (forwards F, input gradients I, weight gradients W) of every rank for
the shortest step under the given costs and a per-rank memory cap, place its comm ops for
--backend, verify it under that backend's comm models, and report it with a lower bound
(docs/search.md). Costs follow every command's convention (docs/simulate.md): [cost] and
--mem are per share (1/P) of the model, a V shape (--placement vshape) cuts each share in
two stages of half the cost; a [cost.stage.N] table is stage N of the placement's cut; a
profile ('pipecc run --profile') measured on another cut is converted.

The placement is the one 'pipecc run' gives a compute-only program on that backend: on
nccl the alignment for the one stream the runtime posts on there (nccl-single), verified
under every comm model; on gloo the
early-recv policy (every receive posted at the start of the step), verified under
rendezvous and eager. The makespan and baseline lines are simulated as 'pipecc compare
--backend' simulates the written program and the bundled one on that backend, under --comm.
"""

EPILOG = """\
output (--json: one object): makespan (of the written program under --comm; with
--comm eager, the latency model the search optimises), lower_bound, gap, peak (per rank, in
--mem units: per share of the model, 1/P of it, with the default --mem one share's
activations for one microbatch; simulate's peak act counts stages), placement, seconds
(search time, from the parsed input to the chosen order),
baseline ({name, makespan} of the best bundled schedule that fits the cap, placed like the
result, or null), backend, comm (the written program's placement: aligned, early-recv, ...).

examples:
  pipecc search -P 4 -M 16 --cost-file costs.toml --memory 6 -o best.json --sched best.sched
  pipecc search -P 8 -M 32 --cost F=1,I=1,W=1,comm=1 --memory 4 --placement auto --json
  pipecc search -P 2 -M 8 --cost-file prof.toml --memory 2 --backend gloo -o best.json
  pipecc search -P 4 -M 16 --layers layers.toml --memory 40GiB -o best.json --partition cut.toml

exit codes: 0 a schedule was found; 1 no schedule fits the cap (the message gives the
smallest cap that has one); 2 input pipecc cannot use.
"""


# how `pipecc run` places a compute-only program on each backend, for the search: gloo's
# early-recv (every receive posted at the start; faster on gloo than an alignment,
# docs/changelog.md, run 4), on nccl the alignment for the one stream the runtime posts
# every op on there (nccl-single: runtime/comm/channel.py)
BACKEND_PLACING = {
    "gloo": Placing("early-recv", CommModel.RENDEZVOUS),
    "nccl": Placing(ALIGNED, RunBackend.NCCL.comm_model),
}


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "search",
        help="search the fastest verified schedule for costs and a memory cap",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("-P", "--ranks", type=positive, required=True, help="pipeline ranks")
    cmd.add_argument("-M", "--microbatches", type=positive, required=True, help="microbatches")
    cmd.add_argument("--cost", metavar="K=V,...", help="per-share costs, e.g. F=1,I=1,W=1,comm=0.2")
    cmd.add_argument(
        "--cost-file", metavar="TOML", help="a cost file or profile (docs/simulate.md)"
    )
    cmd.add_argument(
        "--memory",
        "--memory-budget",
        dest="memory",
        metavar="CAP",
        help="per-rank memory cap (--mem units; with --layers, bytes: 40GiB, no cap if "
        "omitted); --memory-budget is the same flag (the name verify uses)",
    )
    cmd.add_argument(
        "--mem",
        metavar="F=1,B=-1,I=0,W=-1",
        default="",
        help="memory change of each op kind for one share (default F=1,B=-1,I=0,W=-1)",
    )
    _add_choices(cmd)
    cmd.add_argument(
        "-o", "--output", metavar="OUT.json", help="write the program (and OUT.costs.toml)"
    )
    cmd.add_argument("--sched", metavar="OUT.sched", help="write the order as a .sched file")
    add_layer_flags(cmd)
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(run=run)


def _add_choices(cmd: argparse.ArgumentParser) -> None:
    """The search's options: placement, objective, comm model, time limit, seed."""
    cmd.add_argument(
        "--placement",
        choices=("loop", "vshape", "v", "auto", "bidirectional"),
        default="loop",
        help="loop (default), vshape (or v), auto: both, the faster wins; bidirectional: "
        "DualPipe's and Chimera's two pipes",
    )
    cmd.add_argument(
        "--placement-from",
        metavar="FILE.sched",
        help="search the placement this .sched file declares (for -P and -M)",
    )
    cmd.add_argument("--objective", choices=("makespan", "span"), default="makespan")
    cmd.add_argument(
        "--no-split",
        dest="split",
        action="store_false",
        help="full backwards B only, no I/W split (docs/search.md)",
    )
    _add_backend(cmd)
    cmd.add_argument(
        "--time-limit",
        metavar="SECONDS",
        type=float,
        help="the search's time (default: 0.7 s up to P·M = 256, then 0.7 s × P·M / 256, "
        "at most 25 s; docs/search.md)",
    )
    cmd.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def _add_backend(cmd: argparse.ArgumentParser) -> None:
    """Where the result runs and how its comm ops are placed for it."""
    cmd.add_argument(
        "--backend",
        choices=tuple(BACKEND_PLACING),
        default="nccl",
        help="the backend the program is placed for, as 'pipecc run' places a compute-only "
        "program there (default nccl: aligned for nccl-single; gloo: early-recv, run under "
        "rendezvous)",
    )
    cmd.add_argument(
        "--comm-policy",
        choices=(ALIGNED, *sorted(POLICIES)),
        help="how the comm ops are placed: aligned (for the cut's costs under --comm), "
        "default or early-recv (gloo only); default: the backend's",
    )
    cmd.add_argument(
        "--comm",
        choices=[model.value for model in CommModel],
        help="the comm model the program is aligned for and reported under (default: the "
        "backend's: nccl-single, or rendezvous on gloo)",
    )


def _placing(args: argparse.Namespace) -> Placing:
    """--backend, --comm-policy and --comm → the placement; early-recv only where every
    posted op progresses on its own (gloo; the rendezvous and eager models)."""
    default = BACKEND_PLACING[args.backend]
    placing = Placing(
        args.comm_policy or default.policy,
        CommModel(args.comm) if args.comm else default.model,
    )
    if placing.backend is Backend.INDEPENDENT_PROGRESS:
        if args.backend != "gloo" or placing.model not in placing.verified_under:
            raise InputError(
                f"--comm-policy {placing.policy} needs every posted op to progress on its own "
                f"(--backend gloo, --comm rendezvous or eager); it deadlocks under "
                f"{args.backend if args.backend != 'gloo' else placing.model.value}'s ordered "
                "streams"
            )
    return placing


def _costs(args: argparse.Namespace) -> CostModel:
    if args.cost is None and args.cost_file is None:
        raise InputError("give the costs: --cost K=V,... or --cost-file FILE")
    model = load_cost_file(args.cost_file) if args.cost_file else CostModel()
    if args.cost:
        model = model.overridden_by(parse_cost_flag(args.cost))
    return model


def _memory(args: argparse.Namespace) -> float:
    if args.memory is None:
        raise InputError("give the per-rank memory cap: --memory CAP (in --mem units)")
    try:
        cap = float(args.memory)
    except ValueError:
        raise InputError(
            f"--memory must be a number (in --mem units; bytes such as 40GiB go with "
            f"--layers), got {args.memory!r}"
        ) from None
    if not math.isfinite(cap) or cap <= 0:
        raise InputError(f"--memory must be a positive number, got {cap:g}")
    return cap


def _request(args: argparse.Namespace) -> Request:
    cap = _memory(args)
    layout = _layout(args)
    if args.time_limit is not None and not (0 < args.time_limit < math.inf):
        raise InputError(
            f"--time-limit must be a positive number of seconds, got {args.time_limit}"
        )
    placing = _placing(args)
    return Request(
        ranks=args.ranks,
        microbatches=args.microbatches,
        costs=_costs(args),
        cap=cap,
        mem=parse_mem(args.mem),
        placement=args.placement,
        objective=args.objective,
        comm=placing.model,
        time_limit=args.time_limit,
        seed=args.seed,
        policy=placing.policy,
        backend=args.backend,
        split=args.split,
        layout=layout,
    )


def _layout(args: argparse.Namespace) -> Placement | None:
    """`--placement-from FILE.sched`: the file's placement for -P and -M (None: a loop or V
    placement, searched as `--placement` names it)."""
    if args.placement_from is None:
        return None
    path = args.placement_from
    placement = expand(
        parse(read_text(Path(path)), path), ranks=args.ranks, microbatches=args.microbatches
    ).placement
    named = {
        "loop": loop_placement(args.ranks, 1),
        "vshape": vshape_placement(args.ranks),
        "bidirectional": bidirectional_placement(args.ranks),
    }
    for name, known in named.items():
        if placement == known:
            args.placement = name
            return None
    args.placement = "table"  # any other: its slots, written back as a table
    return placement


def run(args: argparse.Namespace) -> int:
    if args.placement == "v":
        args.placement = "vshape"
    if args.layers is not None:
        if args.placement_from is not None or not args.split or args.placement == "bidirectional":
            raise InputError(
                "--placement bidirectional, --placement-from and --no-split search orders on a "
                "given cut: not with --layers"
            )
        return run_layers(args, _placing(args))
    if args.partition is not None:
        raise InputError("--partition writes the cut of a layer search: give --layers")
    began = time.perf_counter()
    request = _request(args)
    _note_host_costs(request.costs)
    _note_conversions(request)
    outcome = run_search(request)
    _write(args, outcome)
    total = time.perf_counter() - began
    if args.json:
        print(json.dumps(outcome.to_json()))
    else:
        print(_table(outcome, total), end="")
        program = outcome.lowered.program
        timeline = simulate(program, request.costs.for_program(program), model=outcome.comm)
        print(format_timeline(timeline, width=120), end="")
    return 0


def _note_host_costs(costs: CostModel) -> None:
    """Say (on stderr) which given costs the search's latency model leaves out."""
    host = costs.host
    given = [f"{key}={value:g}" for key in ("post", "wait", "sync")
             if (value := getattr(host, key))]  # fmt: skip
    if given:
        print(
            f"note: the search's latency model has no host time: {', '.join(given)} are not"
            " in its search nor in OUT.costs.toml (its makespan and baseline lines include"
            " them, as pipecc compare does)",
            file=sys.stderr,
        )


def _note_conversions(request: Request) -> None:
    """Say (on stderr) how a profile measured on another cut is converted for each
    placement searched (docs/simulate.md)."""
    for placement in placements(request.placement):
        stages = request.ranks * (1 if placement == "loop" else 2)
        cut = Cut(request.ranks, stages, placement)
        if note := request.costs.for_cut(cut).conversion():
            print(f"note: {note}", file=sys.stderr)


def _write(args: argparse.Namespace, outcome: Outcome) -> None:
    lowered = outcome.lowered
    if args.output:
        write_output(json_program.dumps(lowered.program), args.output)
        costs_path = Path(args.output).with_suffix(".costs.toml")
        write_output(outcome.costs_text, str(costs_path))
    if args.sched:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(args.sched).stem) or "search"
        text = write_sched(outcome.problem, outcome.order, name, outcome.header())
        write_output(text, args.sched)


def _table(outcome: Outcome, total: float) -> str:
    problem = outcome.problem
    span = problem.objective.value == "span"
    base = outcome.baseline
    baseline = f"{base.name} {base.makespan:g}" if base is not None else "none fits the cap"
    lines = [
        outcome.header().splitlines()[0],
        f"makespan     {outcome.makespan:g} ({outcome.comm.value})   "
        f"latency model {outcome.lowered.eager_makespan:g}",
        f"placed       {outcome.placing.describe()} (backend {outcome.backend}), verified under "
        + ", ".join(model.value for model in outcome.placing.verified_under),
        f"lower bound  {outcome.lower_bound:g}   gap {outcome.gap:.2%}",
        *([f"span         {outcome.span:g} (the objective, latency model)"] if span else []),
        f"peak         {' '.join(f'{p:g}' for p in outcome.peak)}   (cap {problem.cap:g}; "
        "in --mem units of one share of the model, where simulate's peak act counts stages)",
        f"baseline     {baseline}",
        f"placement    {problem.placement}   chosen by {outcome.chosen_by}",
        f"seconds      {outcome.seconds:.3f} search, {total:.3f} in all",
    ]
    return "\n".join(lines) + "\n"
