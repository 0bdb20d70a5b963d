"""Full recomputation against single-process training, and its measured peak.

One process group of 2 ranks runs every case (recompute_cases.py): 1F1B, ZB-H1 (the
Linear weight contract), ZBV, DualPipeV and DualPipe with dropout on, with and without
`add_loss`, and one stage only recomputed: every gradient within 1e-6 relative of the
reference, the global loss (main plus added) and each reported added loss equal. The
measured peak (the exact CPU count) is lower with recomputation on a model whose
activations dominate. Without derived RNG states (ZBV) the gradients equal those without
recomputation, bit for bit. In this process: the spec's parsing and its refusals.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from pipecc.runtime.engine.recompute import parse_spec, recomputed
from pipecc.runtime.tools.model_file import load_model
from pipecc.runtime.tools.spawn import spawn
from recompute_cases import Case, run_cases

from pipecc.api import compile_schedule
from pipecc.diagnostics import InputError

TOLERANCE = 1e-6
SCHEDULES = [("1f1b", 4), ("zb_h1", 4), ("zbv", 4), ("dualpipev", 5), ("dualpipe", 6)]


def _cases() -> list[Case]:
    cases = []
    for schedule, m in SCHEDULES:
        program = compile_schedule(schedule, ranks=2, microbatches=m)
        cases.append(Case(f"{schedule}", program))
        cases.append(Case(f"{schedule}-aux", program, aux=True))
    program = compile_schedule("zb_h1", ranks=2, microbatches=4)
    cases.append(Case("zb_h1-stage1", program, recompute={1: "full", 0: "none"}, aux=True))
    program = compile_schedule("dualpipe", ranks=2, microbatches=6)
    cases.append(Case("dualpipe-hook", program, aux=True, hooked=True))
    cases.append(Case("dualpipe-hook-none", program, recompute="none", aux=True, hooked=True))
    program = compile_schedule("zbv", ranks=2, microbatches=4)
    cases.append(Case("own-rng-zbv", program, aux=True, own_rng=True))
    cases.append(
        Case("memory-1f1b", compile_schedule("1f1b", ranks=2, microbatches=4), memory=True)
    )
    return cases


@functools.cache
def _group() -> list[dict[str, dict[str, Any]]]:
    return spawn(run_cases, 2, _cases(), timeout=120.0)  # type: ignore[no-any-return]


NAMES = [c for s, _ in SCHEDULES for c in (s, f"{s}-aux")]
NAMES += ["zb_h1-stage1", "dualpipe-hook", "dualpipe-hook-none"]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(b), 1.0)


@pytest.mark.parametrize("name", NAMES)
def test_matches_the_reference(name: str) -> None:
    for result in (r[name] for r in _group()):
        assert "error" not in result, result
        assert result["grad_rel"] <= TOLERANCE, (name, result["grad_rel"])
        assert _close(result["total"], result["want_total"]), result
        for mb, by_stage in result["aux"].items():
            for stage, value in by_stage.items():
                assert _close(value, result["want_aux"][mb][stage]), (mb, stage)
    if name.endswith("aux"):
        reported = {(mb, s) for r in _group() for mb, d in r[name]["aux"].items() for s in d}
        wanted = {(mb, s) for mb, d in _group()[0][name]["want_aux"].items() for s in d}
        assert reported == wanted


def test_the_overlap_hook_is_left_for_recomputed_stages() -> None:
    """The hook would build the forward's graph: a recomputed pair runs one after the other
    (correct, above), and the hook runs as before without recomputation."""
    assert sum(r["dualpipe-hook"]["hook_calls"] for r in _group()) == 0
    assert sum(r["dualpipe-hook-none"]["hook_calls"] for r in _group()) > 0


def test_recompute_lowers_the_measured_peak() -> None:
    """Rank 0 holds two microbatches' activations at once on 1F1B: recomputed, it holds one
    (measured 1313536 -> 920320 bytes); the last stage holds one either way."""
    peaks = [r["memory-1f1b"]["peaks"] for r in _group()]
    assert peaks[0]["full"] < 0.8 * peaks[0]["none"], peaks
    assert peaks[1]["full"] <= peaks[1]["none"], peaks


def test_saved_rng_states_without_derivation() -> None:
    """derive_rng=False: dropout on the ranks' own streams; the replay restores F's state,
    so every gradient equals the run without recompute's, bit for bit."""
    for result in (r["own-rng-zbv"] for r in _group()):
        assert "error" not in result, result
        assert result["count"] > 0 and result["same"], result


def test_spec() -> None:
    assert parse_spec("full") == "full"
    assert parse_spec("0:full,1:none") == {0: "full", 1: "none"}
    assert recomputed("full", 3) == {0, 1, 2}
    assert recomputed({1: "full", 0: "none"}, 3) == {1}
    assert recomputed(None, 3) == frozenset()
    with pytest.raises(InputError, match="selective"):
        parse_spec("attn")
    with pytest.raises(InputError, match="stage:mode"):
        parse_spec("x:full")
    with pytest.raises(InputError, match="0..1"):
        recomputed({2: "full"}, 2)


MODEL = """
import torch
from torch import nn
def build_stage(stage, num_stages):
    return nn.Linear(4, 4)
def make_batch(rows, seed):
    return torch.randn(rows, 4), torch.randn(rows, 4)
recompute = {value}
"""


def test_model_file_recompute(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(value='{0: "full"}'))
    assert load_model(str(path)).recompute == {0: "full"}
    path.write_text(MODEL.format(value='{"0": "full"}'))
    with pytest.raises(InputError, match="recompute must map stage numbers to modes"):
        load_model(str(path))
