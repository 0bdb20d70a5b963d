"""`pipecc search --layers layers.toml`: the cut, the order and the recomputation together
(docs/search.md "Searching the cut")."""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

from pipecc.commands.common import write_output
from pipecc.diagnostics import InputError
from pipecc.interop import json_program
from pipecc.render.grid import format_timeline
from pipecc.search.layers import Cut, Profile, cut_toml, format_size, load_layers, parse_size
from pipecc.search.lower import Placing
from pipecc.search.partition_run import LayerOutcome, LayerRequest, run_layer_search
from pipecc.search.sched import write_sched
from pipecc.simulate.timeline import simulate

PER_SHARE_ONLY = ("cost", "cost_file", "mem")


def add_layer_flags(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--layers",
        metavar="TOML",
        help="a per-layer profile: search the cut of the layers into stages too "
        "(docs/search.md); --memory is then in bytes (40GiB)",
    )
    cmd.add_argument(
        "--partition",
        metavar="OUT.toml",
        help="with --layers: write the cut (one [[stage]] per program stage: index, layers, "
        "recompute)",
    )


def run_layers(args: argparse.Namespace, placing: Placing) -> int:
    """The layer search of the parsed command line; its report and files."""
    began = time.perf_counter()
    for name in PER_SHARE_ONLY:
        if getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} is for per-share costs: the profile of --layers gives them")
    if args.objective != "makespan":
        raise InputError("--layers minimises the step: --objective span is for per-share costs")
    profile = load_layers(args.layers)
    request = LayerRequest(
        profile=profile,
        ranks=args.ranks,
        microbatches=args.microbatches,
        cap=_cap(args.memory, profile),
        placement=args.placement,
        comm=placing.model,
        time_limit=_time_limit(args.time_limit),
        seed=args.seed,
        policy=placing.policy,
        backend=args.backend,
    )
    found = run_layer_search(request)
    _write(args, found, profile)
    if args.json:
        print(json.dumps(found.to_json(profile)))
        return 0
    print(_table(found, profile, request, time.perf_counter() - began), end="")
    program = found.outcome.lowered.program
    timeline = simulate(program, found.outcome.lowered.costs, model=found.outcome.comm)
    print(format_timeline(timeline, width=120), end="")
    return 0


def _cap(text: str | None, profile: Profile) -> float | None:
    if text is None:
        return None
    cap = parse_size(text)
    if not profile.has_bytes:
        raise InputError(
            f"--memory {text}: {profile.origin} gives no sizes (act_bytes, param_bytes, ...)"
        )
    return cap


def _time_limit(value: float | None) -> float | None:
    if value is not None and not (0 < value < math.inf):
        raise InputError(f"--time-limit must be a positive number of seconds, got {value}")
    return value


def _write(args: argparse.Namespace, found: LayerOutcome, profile: Profile) -> None:
    outcome = found.outcome
    problem = outcome.problem
    cap = "no cap" if args.memory is None else f"cap {args.memory}"
    header = (
        f"pipecc search --layers {profile.origin}  P={problem.ranks} M={problem.microbatches}"
        f"  placement {problem.placement}  comm {outcome.comm.value}  {cap}"
    )
    if args.output:
        write_output(json_program.dumps(outcome.lowered.program), args.output)
        recomputed = [str(s) for s, flag in enumerate(found.cut.recompute) if flag]
        note = (
            f"# recomputed stages: {', '.join(recomputed)} (their I includes their F again;"
            f" the cut file says so)\n"
            if recomputed
            else ""
        )
        costs = str(Path(args.output).with_suffix(".costs.toml"))
        write_output(
            f"# {header}\n# cut: {found.cut.describe()}\n{note}{outcome.costs_text}", costs
        )
    if args.sched:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(args.sched).stem) or "search"
        cut = f"cut (layers per stage, r: recomputed): {found.cut.describe()}"
        text = write_sched(outcome.problem, outcome.order, name, f"{header}\n{cut}")
        write_output(_recompute_line(text, found.cut), args.sched)
    if args.partition:
        write_output(cut_toml(found.cut, profile, header), args.partition)


def _table(found: LayerOutcome, profile: Profile, req: LayerRequest, total: float) -> str:
    outcome = found.outcome
    unit = f" {profile.unit}" if profile.unit else ""
    cap = "no cap" if req.cap is None else f"cap {format_size(req.cap)}"
    lines = [
        f"pipecc search  P={req.ranks} M={req.microbatches}  {len(profile.layers)} layers "
        f"({profile.origin})  placement {outcome.problem.placement}  "
        f"comm {outcome.comm.value}  {cap}",
        f"cut          {found.cut.describe()}   (layers per stage; r: recomputed)",
        *_stage_lines(found, profile),
        f"step         {outcome.makespan:g}{unit} ({outcome.comm.value})   latency model "
        f"{outcome.lowered.eager_makespan:g}",
        f"lower bound  {outcome.lower_bound:g} (this cut)   {found.any_cut_bound:g} (any cut)"
        f"   gap {outcome.gap:.2%}",
        f"peak         {' '.join(format_size(p) for p in found.peaks)}   ({cap})",
        *_uniform_lines(found, unit),
        f"placed       {outcome.placing.describe()} (backend {outcome.backend}), verified "
        "under " + ", ".join(model.value for model in outcome.placing.verified_under),
        f"chosen by    {outcome.chosen_by}",
        f"seconds      {found.seconds:.3f} search, {total:.3f} in all",
    ]
    return "\n".join(lines) + "\n"


def _stage_lines(found: LayerOutcome, profile: Profile) -> list[str]:
    lines = []
    for stage in found.stages(profile):
        names = stage["layers"]
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        extra = "  recompute" if stage["recompute"] else ""
        lines.append(f"  stage {stage['index']:<3} {span} ({len(names)}){extra}")
    return lines


def _uniform_lines(found: LayerOutcome, unit: str) -> list[str]:
    lines = []
    for placement in dict.fromkeys(u.placement for u in found.uniform):
        entries = [u for u in found.uniform if u.placement == placement]
        counts = " ".join(map(str, entries[0].counts))
        figures = ", ".join(
            f"{u.schedule} {u.makespan:g}" if u.makespan is not None else f"{u.schedule} -"
            for u in entries
        )
        lines.append(f"uniform cut  {counts} ({placement}): {figures}")
    best = found.best_uniform
    if best is not None and best.makespan:
        lead = 1 - found.outcome.makespan / best.makespan
        lines.append(
            f"             best uniform: {best.schedule} {best.makespan:g}{unit}; the searched "
            f"cut's step is {lead:.1%} shorter"
        )
    else:
        lines.append("             no bundled schedule fits the cap on a uniform cut")
    return lines


def _recompute_line(text: str, cut: Cut) -> str:
    """The .sched with `recompute stage ...` after its placement line when the cut
    recomputes stages, so `pipecc compile` carries them into the program."""
    stages = [str(s) for s in range(cut.stages) if cut.recompute[s]]
    if not stages:
        return text
    return re.sub(
        r"^(placement .*)$", lambda m: f"{m[1]}\nrecompute stage {', '.join(stages)}", text,
        count=1, flags=re.M,
    )  # fmt: skip
