"""The one memory rule: the verifier's --max-activations and the simulator's peaks read it."""

from __future__ import annotations

import pytest
from helpers import compile_bundled

from pipecc.analysis.memory import peak_activations
from pipecc.api import bundled_schedules
from pipecc.diagnostics import RequirementError
from pipecc.ir.ops import Compute, Fused, Kind
from pipecc.semantics.costs import CostModel, parse_cost_flag
from pipecc.simulate.timeline import simulate
from pipecc.verify import Options, verify


def _f(mb: int) -> Compute:
    return Compute(Kind.F, 0, 0, 0, mb)


def test_a_fused_op_allocates_then_frees() -> None:
    # F F F&B F F: 1, 2, 3 (the forward before the backward frees), 2, 3, 4
    ops = [_f(0), _f(1), Fused(_f(2), Compute(Kind.B, 0, 0, 0, 0)), _f(3), _f(4)]
    assert peak_activations(ops) == (4, 4)
    # I keeps what W needs; W frees it
    ops = [_f(0), Compute(Kind.I, 0, 0, 0, 0), _f(1), Compute(Kind.W, 0, 0, 0, 0), _f(2)]
    assert peak_activations(ops) == (2, 2)
    assert peak_activations([]) == (0, -1)


@pytest.mark.parametrize("name", sorted(bundled_schedules()))
def test_verify_and_simulate_report_the_same_peaks(name: str) -> None:
    for ranks, microbatches in ((2, 4), (4, 8), (4, 16)):
        try:
            program = compile_bundled(name, ranks, microbatches)
        except RequirementError:
            continue
        report = verify(program, Options(models=()))
        timeline = simulate(program, parse_cost_flag("act_bytes=3"))
        assert [(p.peak, max(p.index, 0)) for p in report.peaks] == [
            (s.peak_activations, s.peak_index) for s in timeline.ranks
        ]
        assert [s.peak_bytes for s in timeline.ranks] == [3.0 * p.peak for p in report.peaks]
        assert simulate(program, CostModel()).ranks[0].peak_bytes is None
