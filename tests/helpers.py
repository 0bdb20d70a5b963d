"""Shared helpers for the tests: compile bundled schedules, normalise compute orders, run the
command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipecc.api import compile_schedule
from pipecc.cli import main
from pipecc.ir.ops import Compute, Fused
from pipecc.ir.program import Program

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ROOT / "schedules"


def compile_bundled(name: str, ranks: int, microbatches: int, **defines: int) -> Program:
    return compile_schedule(
        SCHEDULES / f"{name}.sched", ranks=ranks, microbatches=microbatches, defines=defines
    )


def _op(op: Compute) -> tuple[Any, ...]:
    return (op.kind.value, op.stage, op.mb)


def compute_order(program: Program) -> list[list[tuple[Any, ...]]]:
    """Per rank: ("F", stage, mb) per compute op, ("OVERLAP", f, b) per fused pair."""
    orders = []
    for instrs in program.ranks:
        row: list[tuple[Any, ...]] = []
        for instr in instrs:
            if isinstance(instr, Compute):
                row.append(_op(instr))
            elif isinstance(instr, Fused):
                row.append(("OVERLAP", _op(instr.forward), _op(instr.backward)))
        orders.append(row)
    return orders


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`pipecc ARGV...` in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
