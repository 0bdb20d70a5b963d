"""Same input, same bytes (DESIGN §4), whatever the interpreter's hash seed.

Compiling twice in one process cannot see a dependence on set or dict-of-str iteration
order: both runs share one `PYTHONHASHSEED`. Here every output is made in separate
processes with different seeds and their digests compared.
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

# Compiles every bundled schedule (and the example schedules) with each placement of the
# comm ops, writes JSON and torch CSV, verifies and simulates, and prints one digest per
# output kind.
DIGESTS = """
import contextlib, hashlib, io, json, sys
from pathlib import Path
from pipecc.cli import main

def run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return f"{code}\\n{out.getvalue()}"

found = {}
paths = [*sorted(Path("schedules").glob("*.sched"))]
paths += sorted(Path("examples/schedules").glob("*.sched"))
for path in paths:
    base = (str(path), "-P", "4", "-M", "8")
    for name, flags in (
        ("json", ("--format", "json")),
        ("early-recv", ("--comm-policy", "early-recv")),
        ("align", ("--align", "--cost", "F=1,B=2,I=1,W=1,comm=0.2")),
        ("torch-csv", ("--format", "torch-csv-comms")),
        ("listing", ("--format", "listing")),
    ):
        found.setdefault("compile " + name, []).append(run("compile", *base, *flags))
    found.setdefault("verify", []).append(run("verify", *base, "--comm", "all", "--format", "json"))
    found.setdefault("simulate", []).append(run("simulate", *base, "--json", "--cost", "comm=0.1"))
for kind, outputs in sorted(found.items()):
    print(kind, hashlib.sha256("\\n".join(outputs).encode()).hexdigest())
"""


def _digests(seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run(
        [sys.executable, "-c", DIGESTS], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_outputs_do_not_depend_on_the_hash_seed() -> None:
    first, second = _digests("0"), _digests("4242")
    assert len(first.splitlines()) == 7, first
    assert first == second
