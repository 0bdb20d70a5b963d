"""`add_loss` and context inputs under every kind of schedule, against a hand-written step.

One process group of 2 ranks and one of 4 run every case (training_cases.py). `add_loss`:
1F1B, ZB-H1 (the Linear weight contract and the graph walk), ZBV, DualPipeV and DualPipe
(with and without the overlap hook) at P=2 and ZB-H1 at P=4: every gradient within 1e-6
relative of single-process training whose loss includes the added losses, the reported
main and added losses equal the reference's, per microbatch and stage and in
`global_loss`. Context: a loop, a V shape and DualPipe (with the hook, boundaries learned
by a function): every gradient equal. In this process: `add_loss` outside pipecc.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from pipecc.runtime import add_loss
from pipecc.runtime.boundaries.context import describe_signature, split_context
from pipecc.runtime.boundaries.signatures import signature_from_text, signature_of
from pipecc.runtime.tools.model_file import load_model
from pipecc.runtime.tools.spawn import spawn
from torch import nn
from training_cases import TOLERANCE, Case, build, run_cases

from pipecc.api import compile_schedule
from pipecc.diagnostics import InputError

Results = list[dict[str, dict[str, Any]]]


def _case(name: str, schedule: str, ranks: int, microbatches: int, **kw: Any) -> Case:
    program = compile_schedule(schedule, ranks=ranks, microbatches=microbatches)
    return Case(name, program, **kw)


def cases_2() -> list[Case]:
    return [
        _case("aux-1f1b", "1f1b", 2, 4),
        _case("aux-mixed-1f1b", "1f1b", 2, 4, model="mixed"),
        _case("aux-zb_h1", "zb_h1", 2, 4),
        _case("aux-zb_h1-raw", "zb_h1", 2, 4, model="raw"),
        _case("aux-zbv", "zbv", 2, 4),
        _case("aux-zbv-raw", "zbv", 2, 4, model="raw"),
        _case("aux-dualpipev", "dualpipev", 2, 5),
        _case("aux-dualpipe", "dualpipe", 2, 6),
        _case("aux-dualpipe-hook", "dualpipe", 2, 6, model="hooked"),
        _case("aux-dualpipev-hook", "dualpipev", 2, 5, model="hooked"),
        _case("context-1f1b", "1f1b", 2, 4, model="context"),
        _case("context-zbv", "zbv", 2, 4, model="context", fixed=True),
        _case("context-dualpipe", "dualpipe", 2, 6, model="context", infer=True),
        _case("context-rows", "1f1b", 2, 4, model="context", bad_rows=True),
        _case("against", "zbv", 2, 4, model="against"),
        _case("against-bug", "1f1b", 2, 2, model="against-bug"),
    ]


def cases_4() -> list[Case]:
    return [
        _case("aux-zb_h1-P4", "zb_h1", 4, 8),
        _case("context-zbv-P4", "zbv", 4, 8, model="context"),
    ]


@functools.cache
def _group(ranks: int) -> Results:
    cases = cases_2() if ranks == 2 else cases_4()
    return spawn(run_cases, ranks, cases, timeout=120.0)  # type: ignore[no-any-return]


def _results(ranks: int, name: str) -> list[dict[str, Any]]:
    return [per_rank[name] for per_rank in _group(ranks)]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(b), 1.0)


def _check(per_rank: list[dict[str, Any]], microbatches: int) -> None:
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result.get('message')}"
        assert result["grad_rel"] <= TOLERANCE, f"rank {rank}: gradient off by {result['grad_rel']}"
    want = per_rank[0]["want"]
    losses = {mb: v for r in per_rank for mb, v in r["losses"].items()}
    assert sorted(losses) == list(range(microbatches))
    assert _close(sum(losses.values()) / microbatches, want["main"])
    aux: dict[int, dict[int, float]] = {}
    for result in per_rank:
        for mb, by_stage in result["aux"].items():
            for stage, value in by_stage.items():
                assert stage not in aux.setdefault(mb, {}), "each stage's loss reported once"
                aux[mb][stage] = value
    assert aux.keys() == want["aux"].keys()
    for mb, by_stage in want["aux"].items():
        assert aux[mb].keys() == by_stage.keys()
        assert all(_close(aux[mb][s], v) for s, v in by_stage.items())
    for result in per_rank:  # forward only (evaluation) reports the same added losses
        assert result["aux_forward"].keys() == result["aux"].keys()
        for mb, by_stage in result["aux"].items():
            assert all(_close(result["aux_forward"][mb][s], v) for s, v in by_stage.items())
    for result in per_rank:  # the same on every rank
        found = result["breakdown"]
        assert _close(found["main"], want["main"])
        assert _close(found["added"], want["added"])
        assert _close(found["total"], want["main"] + want["added"])
        assert _close(result["total"], found["total"])
        assert _close(sum(found["by_stage"].values()), want["added"])


@pytest.mark.parametrize(
    "name", [c.name for c in cases_2() if c.name.startswith(("aux", "context-")) and not c.bad_rows]
)
def test_p2_matches_training_with_the_added_losses(name: str) -> None:
    case = next(c for c in cases_2() if c.name == name)
    per_rank = _results(2, name)
    _check(per_rank, case.program.num_microbatches)
    if "hook" in name or name == "context-dualpipe":  # ContextBlock defines the hook too
        assert sum(r["hook_calls"] for r in per_rank) > 0, "the overlap hook ran"
    if case.model != "context":
        assert per_rank[0]["want"]["added"] > 0.1, "the added losses are not negligible"


@pytest.mark.parametrize("name", [c.name for c in cases_4()])
def test_p4_matches_training_with_the_added_losses(name: str) -> None:
    case = next(c for c in cases_4() if c.name == name)
    _check(_results(4, name), case.program.num_microbatches)


def test_add_loss_outside_pipecc_adds_with_scale_one() -> None:
    """Plain training: `add_loss` in the model, `loss.backward()` on the main loss alone,
    gives the gradient of main + added."""
    (block,) = build("moe", 1)
    (recorded,) = build("moe", 1)
    recorded.record = True  # type: ignore[assignment]
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    nn.functional.mse_loss(block(x), y).backward()
    out = recorded(x)
    (nn.functional.mse_loss(out, y) + recorded.added.pop()).backward()  # type: ignore[operator]
    for (name, got), want in zip(block.named_parameters(), recorded.parameters(), strict=True):
        assert torch.allclose(got.grad, want.grad, atol=1e-7), name  # type: ignore[arg-type]


def test_add_loss_refuses_a_non_scalar_loss() -> None:
    with pytest.raises(InputError, match="scalar tensor"):
        add_loss(torch.ones(2), torch.ones(3))


def test_check_against_the_whole_model_in_a_training_script() -> None:
    """Every rank holds the whole model but trained only its stages (their weights moved):
    the reference takes the stages' current weights, so a correct split passes."""
    per_rank = _results(2, "against")
    for rank, found in enumerate(per_rank):
        assert "error" not in found, f"rank {rank}: {found.get('message')}"
        assert found["ok"], found["failures"]
        assert found["max_rel_grad_diff"] <= 1e-5
        assert found["loss"] == pytest.approx(found["reference_loss"], rel=1e-6)


def test_check_against_names_a_forgotten_layer_on_every_rank() -> None:
    per_rank = _results(2, "against-bug")
    for found in per_rank:
        assert not found["ok"]
        assert "the model's parameter 'layers.1.qkv.weight' is in no stage" in found["failures"]
    assert per_rank[0]["failures"] == per_rank[1]["failures"]


def test_the_context_must_be_a_dict_of_keywords() -> None:
    found: list[str] = []
    assert split_context([torch.ones(4)], 2, torch.device("cpu"), found) is None
    assert found and "context must be a dict of keyword arguments" in found[0]
    found = []
    parts = split_context({"pos": torch.arange(4), "flag": True}, 2, torch.device("cpu"), found)
    assert not found and parts is not None
    assert [p["pos"].tolist() for p in parts] == [[0, 1], [2, 3]] and parts[1]["flag"] is True


def test_the_context_shapes_are_part_of_the_signature() -> None:
    x = torch.ones(4, 3)
    plain = signature_of(x, 2)
    short = signature_of(x, 2, {"mask": torch.ones(4, 4)})
    longer = signature_of(x, 2, {"mask": torch.ones(4, 5)})
    assert len({plain.code, short.code, longer.code}) == 3
    assert short.boundary == plain.boundary  # stage 0's input is the inputs alone
    assert signature_from_text(short.text()) == short
    assert "with context" in describe_signature(longer.text())
    with pytest.raises(InputError, match="4 rows per microbatch but the inputs have 2"):
        signature_of(x, 2, {"mask": torch.ones(8, 5)})


def test_make_batch_returns_two_or_three_values(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\n"
        "def build_stages(n): return [torch.nn.Linear(2, 2) for _ in range(n)]\n"
        "def make_batch(rows, seed): return torch.ones(rows, 2), torch.ones(rows, 2), [1], 4\n"
    )
    with pytest.raises(InputError, match=r"\(inputs, targets\) or \(inputs, targets, context\)"):
        load_model(str(path)).batch(4, seed=0)


def test_a_context_without_the_inputs_rows_is_refused_on_every_rank() -> None:
    for found in _results(2, "context-rows"):
        assert found.get("error") == "SetupError", found
        assert "the context has 4 rows per microbatch but the inputs have 2" in found["message"]
