"""The profile → search → run loop, measured end to end on this machine's CPUs (gloo).

    .venv/bin/python benchmarks/search_loop.py                      # P=2, M=8, 7 rounds
    .venv/bin/python benchmarks/search_loop.py --ranks 4 --rounds 5
    .venv/bin/python benchmarks/search_loop.py --rounds 2 --only zb_h1 zbv   # a smoke run

1. Profile: `pipecc run PROFILED --nproc P -M M --model examples/mlp.py --profile prof.toml`
   (its default 20 timed steps after 2 warm-up; --allow-noisy-profile, so that a busy
   machine still gives a figure: the spread is printed beside the result).
   Every program trains the same model: PIPECC_MLP_BLOCKS = 2P blocks (--blocks), cut into
   P stages of two blocks by a loop and 2P stages of one by a V shape or interleaved 1F1B
   (examples/mlp.py's own default, two blocks per stage, would give a V shape a model twice
   as deep as a loop's).
2. Search: `pipecc search -P P -M M --cost-file prof.toml --memory CAP --backend gloo
   --placement auto -o searched.json`: the order placed as `pipecc run` places a
   compute-only program on gloo (early-recv). The same order aligned for the rendezvous
   model (`pipecc compile searched.json --align --comm rendezvous` with the cut's costs) is
   a second row, the placement the search did not choose.
3. The bundled schedules that compile at these sizes, each compiled with `--comm-policy
   early-recv` (what `pipecc run` runs on gloo for them) to a .json, so that `compare` and
   `run` see the same programs.
4. Predict: `pipecc compare ALL.json --cost-file prof.toml --comm rendezvous` (gloo's model).
5. Measure: every program run with `pipecc run X.json --steps S --warmup W` once per round,
   in an order rotated every round (alternating rounds: load that drifts reaches every
   program alike); a program's figure is the median over rounds of each run's `step_ms`
   (itself the median of its timed steps).

It prints the profile's `[cost]` figures (with `dispatch`, the fixed part of every op), per
program compare's predicted makespan (ms), the measured median step and their ratio, then
the verdict the loop promises: wherever compare predicts the searched program faster than
the best bundled schedule by more than the profile's spread, it is at least as fast in the
measured medians. Run it on a quiet machine: on a loaded one the spread is large, and the
promise is then rarely put to the test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PIPECC = [sys.executable, "-m", "pipecc.cli"]
MODEL = "examples/mlp.py"
BUNDLED = ("1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev", "interleaved_1f1b")
SEARCHED = "searched"
ALIGNED = "searched-aligned"


def _call(command: list[str], env: dict[str, str], *, json_out: bool = True) -> Any:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr}")
    return json.loads(result.stdout) if json_out else result.stdout


def profile(args: argparse.Namespace, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    """Step 1: the profile of the profiled schedule, and its run's report (with the spread)."""
    costs = folder / "prof.toml"
    run = [*PIPECC, "run", args.profiled, "--nproc", str(args.ranks), "-M", str(args.mbs),
           "--model", MODEL, "--profile", str(costs), "--allow-noisy-profile",
           "--json"]  # fmt: skip
    report: dict[str, Any] = _call(run, env)
    return report


def search(args: argparse.Namespace, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    """Step 2: the searched program for gloo, and the same order aligned for rendezvous."""
    out = folder / f"{SEARCHED}.json"
    found: dict[str, Any] = _call(
        [*PIPECC, "search", "-P", str(args.ranks), "-M", str(args.mbs),
         "--cost-file", str(folder / "prof.toml"), "--memory", str(args.memory or args.ranks),
         "--backend", "gloo", "--placement", args.placement, "--json", "-o", str(out)],
        env,
    )  # fmt: skip
    _call(
        [*PIPECC, "compile", str(out), "--align", "--cost-file",
         str(out.with_suffix(".costs.toml")), "--comm", "rendezvous",
         "-o", str(folder / f"{ALIGNED}.json")],
        env, json_out=False,
    )  # fmt: skip
    return found


def bundled(args: argparse.Namespace, folder: Path, env: dict[str, str]) -> list[str]:
    """Step 3: the bundled schedules that compile at these sizes, as gloo runs them."""
    names = []
    for name in args.only:
        out = folder / f"{name}.json"
        result = subprocess.run(
            [*PIPECC, "compile", name, "-P", str(args.ranks), "-M", str(args.mbs),
             "--comm-policy", "early-recv", "-o", str(out)],
            capture_output=True, text=True, env=env, cwd=ROOT, check=False,
        )  # fmt: skip
        if result.returncode == 0:
            names.append(name)
        else:
            print(f"skipped {name}: {result.stderr.strip().splitlines()[-1]}")
    return names


def predict(names: list[str], folder: Path, env: dict[str, str]) -> dict[str, float]:
    """Step 4: compare's makespan of every program with the profile, under rendezvous (one
    program per call: the rows of one table are sorted by makespan, and both searched rows
    carry the schedule name `search`)."""
    predicted = {}
    for name in names:
        rows = _call(
            [*PIPECC, "compare", str(folder / f"{name}.json"), "--cost-file",
             str(folder / "prof.toml"), "--comm", "rendezvous", "--json"],
            env,
        )  # fmt: skip
        predicted[name] = float(rows[0]["makespan"])
    return predicted


def measure(
    names: list[str], args: argparse.Namespace, folder: Path, env: dict[str, str]
) -> dict[str, list[float]]:
    """Step 5: alternating rounds, each program once per round, the order rotated."""
    steps: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            report = _call(
                [*PIPECC, "run", str(folder / f"{name}.json"), "--model", MODEL,
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--json"],
                env,
            )  # fmt: skip
            steps[name].append(float(report["step_ms"]))
        print(f"round {round_ + 1}: " + "  ".join(f"{n} {steps[n][-1]:.2f}" for n in names))
    return steps


def verdict(predicted: dict[str, float], measured: dict[str, float], spread: float) -> str:
    """Whether the searched program holds every predicted lead: against each bundled
    schedule that compare predicts slower by more than the profile's spread, the searched
    program's measured median must be at most that schedule's (the cap does not enter: a
    schedule outside the search's cap that compare predicts slower is held to it too)."""
    bundled_names = [name for name in predicted if name not in (SEARCHED, ALIGNED)]
    if not bundled_names:
        return "no bundled schedule compiled at these sizes"
    lines = []
    for name in sorted(bundled_names, key=lambda n: predicted[n]):
        lead = (predicted[name] - predicted[SEARCHED]) / predicted[name]
        said = f"{name}: compare predicts {SEARCHED} {lead:+.1%}"
        if lead <= spread:
            lines.append(f"{said}, not beyond the spread {spread:.1%}: nothing to hold")
            continue
        holds = measured[SEARCHED] <= measured[name]
        lines.append(
            f"{said}, beyond the spread {spread:.1%}: measured {measured[SEARCHED]:.2f} "
            f"against {measured[name]:.2f} ms: {'holds' if holds else 'FAILS'}"
        )
    held = [line for line in lines if line.endswith(("holds", "FAILS"))]
    failed = sum(line.endswith("FAILS") for line in held)
    summary = (
        f"the loop's promise: {len(held) - failed} of {len(held)} predicted leads held"
        if held
        else "the loop's promise: no predicted lead beyond the spread"
    )
    return "\n".join([*lines, summary])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="P (default 2)")
    parser.add_argument("--mbs", "-M", type=int, default=8, help="M (default 8)")
    parser.add_argument("--hidden", type=int, default=512, help="MLP width (default 512)")
    parser.add_argument(
        "--blocks",
        type=int,
        help="Linear+GELU blocks of the whole model, the same in every program (default 2P: "
        "two per stage of a loop, one per stage of a V shape)",
    )
    parser.add_argument("--profiled", default="zb_h1", help="the schedule profiled (zb_h1)")
    parser.add_argument("--memory", type=float, help="the search's cap (default P shares)")
    parser.add_argument("--placement", default="auto", choices=("loop", "vshape", "auto"))
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (10)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per run (2)")
    parser.add_argument("--only", nargs="+", default=list(BUNDLED), choices=BUNDLED)
    args = parser.parse_args()
    blocks = args.blocks or 2 * args.ranks
    env = {**os.environ, "PIPECC_MLP_HIDDEN": str(args.hidden), "PIPECC_MLP_BLOCKS": str(blocks)}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        report = profile(args, folder, env)
        spread = float(report["profile_spread"] or 0.0)
        measured_costs = tomllib.loads((folder / "prof.toml").read_text())["cost"]
        found = search(args, folder, env)
        names = [SEARCHED, ALIGNED, *bundled(args, folder, env)]
        predicted = predict(names, folder, env)
        steps = measure(names, args, folder, env)
    measured = {name: statistics.median(values) for name, values in steps.items()}
    print(
        f"\nMLP H={args.hidden}, {blocks} blocks, P={args.ranks}, M={args.mbs}, gloo; profile of "
        f"{args.profiled} ({report['steps']} steps after {report['warmup']} warm-up): spread "
        f"{spread:.3f} at {report['profile_spread_at']} (bound {report['profile_spread_bound']})"
    )
    keys = ("F", "I", "W", "comm", "post", "wait", "dispatch")
    print("profile [cost] (ms): " + ", ".join(
        f"{key}={measured_costs[key]}" for key in keys if key in measured_costs
    ))  # fmt: skip
    print(
        f"search: {found['placement']} placement, comm {found['comm']}, predicted "
        f"{found['makespan']:.2f} ms (rendezvous), baseline {found['baseline']}"
    )
    print(f"{'program':18s} {'predicted ms':>12s} {'measured ms':>11s} {'pred/meas':>9s}  rounds")
    for name in sorted(names, key=lambda n: predicted[n]):
        rounds = " ".join(f"{value:.2f}" for value in steps[name])
        ratio = predicted[name] / measured[name]
        print(f"{name:18s} {predicted[name]:12.2f} {measured[name]:11.2f} {ratio:9.3f}  {rounds}")
    print(verdict(predicted, measured, spread))
    print(
        f"{args.rounds} alternating rounds of {args.steps} steps after {args.warmup} warm-up; "
        f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after, "
        f"on {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
