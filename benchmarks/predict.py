"""Predicted against measured step time: the simulator fed with the runtime's own profile.

    .venv/bin/python benchmarks/predict.py                  # every bundled schedule, P=2
    .venv/bin/python benchmarks/predict.py --hidden 1024 --only 1f1b zb_h1

For each schedule: `pipecc run … --profile costs.toml` runs the MLP of examples/mlp.py on 2
CPU processes (gloo), times its steps and writes the measured per-(stage, op) durations and
the message latency; `pipecc simulate … --cost-file costs.toml --comm rendezvous` (gloo's
semantics) predicts the step from them. It prints both and the relative error; the target is
within 15%. Both come from the same run of the same program, so machine noise moves them
together only in part: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPECC = [sys.executable, "-m", "pipecc.cli"]
SIZES = {  # schedule -> (microbatches, defines): a size every schedule accepts at P=2
    "gpipe": (8, []), "1f1b": (8, []), "interleaved_1f1b": (8, []),
    "interleaved_zb": (8, []), "looped_bfs": (8, []), "zb_h1": (8, []), "zb_h2": (8, []),
    "zbv": (8, []), "dualpipe": (8, []), "dualpipev": (8, []),
}


def _json(command: list[str], env: dict[str, str]) -> dict[str, object]:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                            check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return json.loads(result.stdout)


def predict(name: str, hidden: int, steps: int) -> tuple[float, float]:
    """(measured, simulated) step time in ms for one schedule at P=2."""
    microbatches, defines = SIZES[name]
    env = {**os.environ, "PIPECC_MLP_HIDDEN": str(hidden)}
    with tempfile.TemporaryDirectory() as folder:
        costs = str(Path(folder) / "costs.toml")
        measured = _json([*PIPECC, "run", name, "--nproc", "2", "-M", str(microbatches),
                          *defines, "--model", "examples/mlp.py", "--steps", str(steps),
                          "--warmup", "2", "--profile", costs, "--json"], env)
        simulated = _json([*PIPECC, "simulate", name, "-P", "2", "-M", str(microbatches),
                           *defines, "--cost-file", costs, "--comm", "rendezvous", "--json"],
                          env)
    return float(measured["step_ms"]), float(simulated["makespan"])  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="MLP width (default 512)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--only", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    print(f"P=2, gloo, MLP H={args.hidden}, 2 blocks per stage, M=8; median of {args.steps} "
          "steps; simulated under rendezvous with the run's own profile")
    print(f"{'schedule':17s} {'measured ms':>12s} {'simulated ms':>13s} {'error':>7s}")
    errors = []
    for name in args.only:
        measured, simulated = predict(name, args.hidden, args.steps)
        error = (simulated - measured) / measured
        errors.append(abs(error))
        print(f"{name:17s} {measured:12.2f} {simulated:13.2f} {error:+7.1%}")
    print(f"largest |error| {max(errors):.1%}; within 15%: "
          f"{sum(e <= 0.15 for e in errors)} of {len(errors)}")


if __name__ == "__main__":
    main()
