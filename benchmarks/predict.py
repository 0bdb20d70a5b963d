"""Predicted against measured step time: the simulator fed with the runtime's own profile.

    .venv/bin/python benchmarks/predict.py                  # every bundled schedule, P=2
    .venv/bin/python benchmarks/predict.py --hidden 1024 --only 1f1b zb_h1

For each schedule: `pipecc run … --profile costs.toml` runs the MLP of examples/mlp.py on 2
CPU processes (gloo), times its steps (`step_ms`: the median over the timed steps of rank
0's wall time between a barrier before and one after) and writes what it measured in those
steps: per-(stage, op) durations, host time per post and per wait, the message latency and,
for DualPipe, the duplicated-stage gradient sum (`sync`); `pipecc simulate … --cost-file
costs.toml --backend gloo` (the program `pipecc run` ran on gloo, its comm ops placed by
early-recv, under gloo's rendezvous semantics) predicts the step from them: the program's
makespan plus `sync` (`step` in its JSON). It prints both, the relative error (the target is
within 15%), the `sync` part, the simulated step without the host time of posts and waits
(`--cost post=0,wait=0`: what that term adds), the profile's `post` and `comm`, and the load
average of the machine around each run. Both come from the same
run of the same program, so machine noise moves them together only in part: run it on a
quiet machine. Not modelled, and so part of the error: the barriers around the step and the
runtime's work before the first and after the last instruction (splitting the batch, the
end-of-step checks), about 0.3–0.8 ms in all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PIPECC = [sys.executable, "-m", "pipecc.cli"]
SIZES = {  # schedule -> (microbatches, defines): a size every schedule accepts at P=2
    "gpipe": (8, []),
    "1f1b": (8, []),
    "interleaved_1f1b": (8, []),
    "interleaved_zb": (8, []),
    "looped_bfs": (8, []),
    "zb_h1": (8, []),
    "zb_h2": (8, []),
    "zbv": (8, []),
    "dualpipe": (8, []),
    "dualpipev": (8, []),
}


class Prediction(NamedTuple):
    """One schedule: measured and simulated step (ms), and what went into the simulation."""

    measured: float
    simulated: float
    sync: float  # the simulated step's duplicated-stage sum (part of `simulated`)
    without_host: float  # the simulated step with post = wait = 0
    post: float  # the profile's host time per post (ms)
    comm: float  # the profile's latency (ms)


def _json(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return dict(json.loads(result.stdout))


def predict(name: str, hidden: int, steps: int) -> Prediction:
    """Run one schedule at P=2 with --profile, then simulate it from that profile."""
    microbatches, defines = SIZES[name]
    env = {**os.environ, "PIPECC_MLP_HIDDEN": str(hidden)}
    size = ["-P", "2", "-M", str(microbatches), *defines]
    with tempfile.TemporaryDirectory() as folder:
        costs = str(Path(folder) / "costs.toml")
        run = [*PIPECC, "run", name, *size, "--model", "examples/mlp.py"]
        timing = ["--steps", str(steps), "--warmup", "2", "--profile", costs, "--json",
                  "--allow-noisy-profile"]  # fmt: skip
        measured = _json([*run, *timing], env)
        # the program `pipecc run` ran: on gloo, the comm ops placed by early-recv
        simulate = [*PIPECC, "simulate", name, *size, "--cost-file", costs]
        simulate += ["--backend", "gloo", "--json"]
        simulated = _json(simulate, env)
        no_host = _json([*simulate, "--cost", "post=0,wait=0"], env)
        profile = tomllib.loads(Path(costs).read_text("utf-8"))["cost"]
    return Prediction(
        measured=float(measured["step_ms"]),
        simulated=float(simulated["step"]),
        sync=float(simulated["sync"]),
        without_host=float(no_host["step"]),
        post=float(profile.get("post", 0.0)),
        comm=float(profile.get("comm", 0.0)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="MLP width (default 512)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--only", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    print(
        f"P=2, gloo, MLP H={args.hidden}, 2 blocks per stage, M=8; median of {args.steps} "
        "steps; simulated under rendezvous with the run's own profile (= makespan + sync)"
    )
    print(
        f"{'schedule':17s} {'measured ms':>11s} {'simulated ms':>12s} {'error':>7s}  "
        f"{'sync':>5s} {'no post/wait':>12s} {'post µs':>7s} {'comm ms':>7s}  load"
    )
    errors = []
    for name in args.only:
        before = os.getloadavg()[0]
        got = predict(name, args.hidden, args.steps)
        error = (got.simulated - got.measured) / got.measured
        errors.append(abs(error))
        sync = f"{got.sync:5.2f}" if got.sync else f"{'':5s}"
        print(
            f"{name:17s} {got.measured:11.2f} {got.simulated:12.2f} {error:+7.1%}  {sync} "
            f"{got.without_host:12.2f} {got.post * 1e3:7.0f} {got.comm:7.3f}  "
            f"{before:.2f}–{os.getloadavg()[0]:.2f}"
        )
    print(
        f"largest |error| {max(errors):.1%}; within 15%: "
        f"{sum(e <= 0.15 for e in errors)} of {len(errors)}; load: the 1-minute load "
        f"average before and after each schedule, on {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
