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
import torch
from pipecc.runtime.engine.recompute import (
    Selection,
    Selector,
    check_selections,
    parse_spec,
    recomputed,
    selections,
)
from pipecc.runtime.engine.selective import Selected, recording
from pipecc.runtime.tools.model_file import load_model
from pipecc.runtime.tools.spawn import spawn
from recompute_cases import Case, run_cases

from pipecc.api import compile_schedule
from pipecc.diagnostics import InputError, SetupError

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
    return cases + _selective_cases()


def _selective_cases() -> list[Case]:
    """Selective recomputation of each block's `mix` (Linear, dropout, GELU)."""
    cases = []
    for schedule, m in SCHEDULES:
        program = compile_schedule(schedule, ranks=2, microbatches=m)
        cases.append(Case(f"{schedule}-sel", program, recompute="mix"))
        cases.append(Case(f"{schedule}-sel-aux", program, recompute="mix", aux=True))
    zb_h1 = compile_schedule("zb_h1", ranks=2, microbatches=4)
    cases.append(Case("zb_h1-sel-stage0", zb_h1, recompute={0: "type=Mixer"}, aux=True))
    cases.append(Case("zb_h1-sel-linear", zb_h1, recompute="type=Linear"))
    cases.append(Case("zb_h1-sel-mixed", zb_h1, recompute={0: "full", 1: "name=mix"}))
    dualpipe = compile_schedule("dualpipe", ranks=2, microbatches=6)
    cases.append(Case("dualpipe-sel-hook", dualpipe, recompute="mix", aux=True, hooked=True))
    zbv = compile_schedule("zbv", ranks=2, microbatches=4)
    cases.append(Case("zbv-sel-wrong-rng", zbv, recompute="mix", wrong_rng=True))
    cases.append(Case("own-rng-zbv-sel", zbv, recompute="mix", aux=True, own_rng=True))
    program = compile_schedule("1f1b", ranks=2, microbatches=4)
    modes = ("none", "mix", "full")
    cases.append(Case("memory-1f1b-sel", program, memory=True, modes=modes))
    return cases


@functools.cache
def _group() -> list[dict[str, dict[str, Any]]]:
    return spawn(run_cases, 2, _cases(), timeout=120.0)  # type: ignore[no-any-return]


NAMES = [c for s, _ in SCHEDULES for c in (s, f"{s}-aux")]
NAMES += ["zb_h1-stage1", "dualpipe-hook", "dualpipe-hook-none"]
SELECTIVE = [c for s, _ in SCHEDULES for c in (f"{s}-sel", f"{s}-sel-aux")]
SELECTIVE += ["zb_h1-sel-stage0", "zb_h1-sel-linear", "zb_h1-sel-mixed", "dualpipe-sel-hook"]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(b), 1.0)


@pytest.mark.parametrize("name", NAMES + SELECTIVE)
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
    assert parse_spec("attn") == "attn"
    assert parse_spec("0:type=Attention+name=blocks.*.mlp,1:full") == {
        0: "type=Attention+name=blocks.*.mlp",
        1: "full",
    }
    assert recomputed({0: "attn", 1: "full"}, 2) == {1}
    assert selections({0: "attn", 1: "full"}, 2) == {0: Selection((Selector("any", "attn"),))}
    for bad in ("kind=Attention", "type=", "attn+", "a b", "0:full,1:full+x", "full+attn"):
        with pytest.raises(InputError, match="selector|not a recomputation mode"):
            parse_spec(bad)
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


def test_selective_composes_with_the_overlap_hook() -> None:
    """Selected modules keep the hook: its forward records them, its backward runs on the
    graph the replay completed (gradients above)."""
    assert sum(r["dualpipe-sel-hook"]["hook_calls"] for r in _group()) > 0


def test_a_selective_replay_with_the_wrong_rng_fails() -> None:
    """The comparison above can fail: replays one draw off give other dropout masks."""
    worst = max(r["zbv-sel-wrong-rng"]["grad_rel"] for r in _group())
    assert worst > 1e-3, worst


def test_selective_with_saved_rng_states() -> None:
    """derive_rng=False: the regions' saved states make the gradients those without
    recomputation, bit for bit."""
    for result in (r["own-rng-zbv-sel"] for r in _group()):
        assert "error" not in result, result
        assert result["count"] > 0 and result["same"], result


def test_selective_peak_is_between_none_and_full() -> None:
    """Rank 0 on 1F1B: recomputing `mix` keeps less than nothing recomputed, more than the
    whole stage recomputed."""
    peaks = [r["memory-1f1b-sel"]["peaks"] for r in _group()]
    assert peaks[0]["full"] < peaks[0]["mix"] < peaks[0]["none"], peaks


def test_selection_matches_outermost_modules() -> None:
    """By type (the class or a base), by name (a dotted tail, shell patterns), outermost."""
    from recompute_cases import Block

    stage = torch.nn.Sequential(Block(False), Block(False))
    mixers = [stage[0].mix, stage[1].mix]
    assert list(Selection((Selector("type", "Mixer"),)).modules(stage)) == mixers
    assert list(Selection((Selector("any", "mix"),)).modules(stage)) == mixers
    assert list(Selection((Selector("name", "1.*"),)).modules(stage)) == [
        stage[1].mix,
        stage[1].second,
    ]
    linears = Selection((Selector("type", "Linear"), Selector("name", "0.mix")))
    want = [stage[0].mix, stage[0].second, stage[1].mix.first, stage[1].second]
    assert list(linears.modules(stage)) == want  # 0.mix.first is inside 0.mix
    assert list(Selection((Selector("type", "Module"),)).modules(stage)) == [stage]


def test_a_selector_matching_nothing_is_named() -> None:
    """Per stage: in its stage; for every stage: in some stage."""
    from recompute_cases import Block

    stages = {0: Block(False), 1: torch.nn.Linear(2, 2)}
    check_selections("mix", 2, stages, whole=True)  # stage 1 has none: recomputes nothing
    with pytest.raises(InputError, match="'atn' matches no submodule"):
        check_selections("mix+atn", 2, stages, whole=True)
    with pytest.raises(InputError, match="recompute of stage 1: 'mix' matches no submodule"):
        check_selections({1: "mix"}, 2, stages, whole=False)
    check_selections("atn", 2, stages, whole=False)  # one rank cannot tell: the launcher does


def test_a_selected_module_that_changes_its_input_is_refused() -> None:
    """An in-place change of a selected module's input would make its replay start from
    other values: refused at the call."""
    relu = torch.nn.ReLU(inplace=True)
    stage = torch.nn.Sequential(torch.nn.Linear(4, 4), relu, torch.nn.Linear(4, 4))
    holder = Selected([], None, stage)
    with pytest.raises(SetupError, match="ReLU, recomputed selectively, modified its input"):
        with recording([relu], torch.device("cpu"), None, holder):
            stage(torch.randn(3, 4, requires_grad=True))


def test_a_replay_that_saves_other_tensors_is_refused() -> None:
    """The replay fills the forward's saved tensors by position: a module that does other
    work when called again is an error, never a wrong gradient."""

    class Moody(torch.nn.Module):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x.sin() if self.calls == 1 else x.sin().cos()

    moody = Moody()
    holder = Selected([], None, moody)
    x = torch.randn(3, requires_grad=True)
    with recording([moody], torch.device("cpu"), None, holder):
        y = (moody(x * 2) * 3).sum()
    with pytest.raises(SetupError, match="the replay of Moody saved 2 tensors, its forward 1"):
        holder.replay("cpu", None)
    del y


def test_a_loss_added_inside_a_selected_module() -> None:
    """`add_loss` inside a selected module: the forward's added loss is a root of the
    backward on the graph the replay completes; the replay adds nothing of its own."""
    from pipecc.runtime import add_loss
    from pipecc.runtime.engine.aux_loss import collecting

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x).tanh()
            return self.drop(add_loss(h, (h**2).mean()))  # type: ignore[no-any-return]

    torch.manual_seed(0)
    inner = Inner()
    x0 = torch.randn(3, 4)
    results = []
    for selective in (False, True):
        inner.zero_grad()
        x = x0.clone().requires_grad_(True)
        added: list[torch.Tensor] = []
        holder = Selected([], None, inner)
        torch.manual_seed(7)
        with collecting(added):
            if selective:
                with recording([inner], torch.device("cpu"), None, holder):
                    y = inner(x)
            else:
                y = inner(x)
        torch.manual_seed(99)  # the replay restores the state the call started from
        holder.replay("cpu", None)
        torch.autograd.backward([y.sum(), *added])
        results.append([x.grad, *(p.grad for p in inner.parameters())])
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
