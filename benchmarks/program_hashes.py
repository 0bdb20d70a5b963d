"""Hashes of the programs pipecc compiles: the check that a refactoring changed no output.

    .venv/bin/python benchmarks/program_hashes.py --out before.txt   # on the old tree
    .venv/bin/python benchmarks/program_hashes.py --out after.txt    # on the new one
    diff before.txt after.txt                                        # must be empty

Every bundled schedule and every schedule in examples/schedules is compiled through the
command line (`pipecc compile ... --format json`, so the check does not depend on internal
names) over a grid of sizes, plainly, with `--comm-policy early-recv`, and with `--align`
for two cost models and two comm models. Each line is `program-name sha256-of-its-JSON`
(or the exit code and first line of the message, for a size the schedule refuses); the last
line is the digest of all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipecc.cli import main as pipecc

ROOT = Path(__file__).resolve().parent.parent
SIZES = (
    (1, 1), (1, 4), (2, 2), (2, 4), (2, 8), (3, 6), (3, 7), (4, 4), (4, 8), (4, 12), (6, 24),
    (8, 16), (8, 32),
)  # fmt: skip
VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plain", ()),
    ("early-recv", ("--comm-policy", "early-recv")),
    ("align", ("--align",)),
    ("align-comm", ("--align", "--cost", "F=1,B=2,I=1,W=1,comm=0.2")),
    ("align-rdv", ("--align", "--cost", "F=1,I=1,W=1,comm=0.5", "--comm", "rendezvous")),
)
# variants that start from the plain program's JSON (the comms of a .json placed again)
FROM_JSON: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("json", ()),
    ("json-early-recv", ("--comm-policy", "early-recv")),
    ("json-align", ("--align", "--cost", "F=1,B=2,I=1,W=1,comm=0.2")),
)
DEFINES = {"interleaved_1f1b": ((), ("-D", "V=3")), "interleaved_zb": ((), ("-D", "V=3"))}


def schedules() -> list[Path]:
    """The bundled schedules, then the example schedules, by name."""
    bundled = sorted(Path("schedules").glob("*.sched"))
    return bundled + sorted(Path("examples", "schedules").glob("*.sched"))


def cases() -> Iterator[tuple[str, list[str]]]:
    """(label, pipecc arguments) for every program of the grid."""
    for path in schedules():
        for defines in DEFINES.get(path.stem, ((),)):
            for ranks, microbatches in SIZES:
                for variant, flags in VARIANTS:
                    label = " ".join((path.stem, *defines, f"P={ranks}", f"M={microbatches}"))
                    argv = [str(path), "-P", str(ranks), "-M", str(microbatches), *defines]
                    yield f"{label} {variant}", [*argv, *flags]


def program_hash(argv: list[str], out: Path) -> str:
    """The sha256 of the JSON `pipecc compile` writes, or `exit N: message` when it refuses."""
    out.unlink(missing_ok=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pipecc(["compile", *argv, "-o", str(out)])
    if code != 0:
        first = err.getvalue().strip().splitlines()[:1]
        return f"exit {code}: {first[0] if first else ''}"
    return hashlib.sha256(out.read_bytes()).hexdigest()


def hashes(folder: Path) -> Iterator[str]:
    """One line per program of the grid, the `.json` re-placements after each plain one."""
    out, plain = folder / "program.json", folder / "plain.json"
    for label, argv in cases():
        yield f"{label} {program_hash(argv, out)}"
        if not label.endswith(" plain") or not out.exists():
            continue
        out.replace(plain)
        base = label.removesuffix(" plain")
        for variant, flags in FROM_JSON:
            yield f"{base} {variant} {program_hash([str(plain), *flags], out)}"
        plain.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the lines here (and the digest to stdout)")
    args = parser.parse_args()
    os.chdir(ROOT)  # relative paths: the JSON's "source" and the messages name no checkout
    with tempfile.TemporaryDirectory() as folder:
        lines = list(hashes(Path(folder)))
    compiled = sum(1 for line in lines if " exit " not in line)
    total = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    summary = f"total {total} ({compiled} programs, {len(lines) - compiled} refused sizes)"
    text = "\n".join([*lines, summary]) + "\n"
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(summary)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
