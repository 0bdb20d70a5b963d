"""The GPT of examples/gpt.py through the runtime: every bundled schedule, the features a
real model needs on a loop placement, a V shape and the bidirectional one, and training.

One process group of 2 ranks runs every case (gpt_cases.py). Each compares every gradient
of this rank's stages with a single-process reference it computes itself: fp32 within 1e-5
of the largest reference gradient of each parameter, bf16 within 2e-2.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cases import CheckpointCase, run_all
from gpt_cases import GptCase
from pipecc.runtime.tools.spawn import spawn
from runtime_cases import SCHEDULES, compile_case, microbatch_counts

from pipecc.ir.ops import Collective, CollectiveKind
from pipecc.ir.program import Program
from pipecc.passes.sum_shared import sum_shared

Results = list[dict[str, dict[str, Any]]]
FEATURES = (
    "tied",
    "accumulate",
    "accumulate-mean",
    "dict",
    "dataclass",
    "shapes",
    "dropout",
    "bf16",
    "bf16-fp32",
    "autocast",
    "loaders",
    "static",
)
PLACEMENTS = {"loop": ("zb_h1", 4), "vshape": ("zbv", 4), "bidirectional": ("dualpipe", 4)}
TOLERANCE = {"bf16": 2e-2, "bf16-fp32": 2e-2}
TRAINING = ("1f1b", "zbv", "dualpipe")


@functools.cache
def cases() -> tuple[GptCase, ...]:
    found = [
        GptCase(f"{name}-M{m}", compile_case(name, 2, m))
        for name in SCHEDULES
        for m in (microbatch_counts(name, 2)[0],)
    ]
    for variant in FEATURES:
        for placement, (name, m) in PLACEMENTS.items():
            two = ("shapes", "accumulate", "accumulate-mean", "loaders", "static")
            steps = 2 if variant in two else 1
            program = tied(compile_case(name, 2, m))
            found.append(GptCase(f"{variant}-{placement}", program, variant, steps))
    found.append(GptCase("undeclared-dualpipe", compile_case("dualpipe", 2, 4), "undeclared"))
    for name in TRAINING:
        program = tied(compile_case(name, 2, 4))
        found.append(GptCase(f"train-{name}", program, "tied", 3, train=True))
    # a program compiled without its sums (before collectives, or without --shared): the
    # runtime still sums the tie after the program; one whose sums miss the tie stops
    found.append(GptCase("outside-zb_h1", compile_case("zb_h1", 2, 4), "tied"))
    found.append(GptCase("uncovered-zb_h1", _uncovered(), "tied"))
    return tuple(found)


def tied(program: Program) -> Program:
    """The GPT ties its first stage's embedding to its last stage's head: the program sums
    that parameter's gradients (`pipecc compile --shared 0+S`)."""
    last = program.placement.num_stages(0) - 1
    return sum_shared(program, shared=((0, last),))


def _uncovered() -> Program:
    """zb_h1 at P=2 with a sum over rank 0 alone: the program places sums, not the tie's."""
    program = compile_case("zb_h1", 2, 4)
    lone = Collective(CollectiveKind.ALL_REDUCE, (0,), "grad-sum s0")
    return replace(program, ranks=(program.ranks[0] + (lone,), program.ranks[1]))


def checkpoint_cases(folder: Path) -> list[CheckpointCase]:
    zbv, dualpipe = tied(compile_case("zbv", 2, 4)), tied(compile_case("dualpipe", 2, 4))
    one_f_one_b = tied(compile_case("1f1b", 2, 4))
    return [
        CheckpointCase("ckpt-same-dropout", zbv, zbv, str(folder / "same"), dropout=0.2),
        CheckpointCase("ckpt-dualpipe-to-zbv", dualpipe, zbv, str(folder / "dualpipe")),
        CheckpointCase("ckpt-zbv-to-1f1b", zbv, one_f_one_b, str(folder / "zbv")),
        CheckpointCase("ckpt-clash", one_f_one_b, one_f_one_b, str(folder / "clash"), mode="clash"),
        CheckpointCase("ckpt-missing", zbv, zbv, str(folder / "missing"), mode="missing"),
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    payload = (list(cases()), checkpoint_cases(tmp_path_factory.mktemp("checkpoints")))
    return spawn(run_all, 2, payload, timeout=300.0)  # type: ignore[no-any-return]


def _each(results: Results, name: str) -> list[dict[str, Any]]:
    found = [r[name] for r in results]
    for result in found:
        assert "error" not in result, result
    return found


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_trains_the_gpt_like_one_process(results: Results, name: str) -> None:
    (case,) = [c for c in cases() if c.name.startswith(f"{name}-M")]
    for result in _each(results, case.name):
        assert result["grad_rel"] <= 1e-5, result["grad_rel"]
        for got, want in result["losses"]:
            assert abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("variant", FEATURES)
def test_features_match_the_reference(results: Results, variant: str, placement: str) -> None:
    tolerance = TOLERANCE.get(variant, 1e-5)
    for result in _each(results, f"{variant}-{placement}"):
        assert result["grad_rel"] <= tolerance, result["grad_rel"]
        for got, want in result["losses"]:
            assert abs(got - want) <= tolerance * abs(want), (got, want)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_shape_change_between_steps_is_learned(results: Results, placement: str) -> None:
    for result in _each(results, f"shapes-{placement}"):
        first, second = result["boundaries"]
        assert "float32[2, 8, 16]" in first[1] and "float32[2, 6, 16]" in second[1], result


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_dict_boundaries_send_only_what_needs_a_gradient(results: Results, placement: str) -> None:
    (boundary,) = {r["boundaries"][0][1] for r in _each(results, f"dict-{placement}")}
    assert boundary == (
        "{'h': float32[2, 8, 16], 'mask': int64[2, 8], 'plain': float32[2, 8, 16], "
        "'none': None, 'k': 2}"
    )


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_dropout_is_active_and_reproduced(results: Results, placement: str) -> None:
    assert all(r["dropout_active"] for r in _each(results, f"dropout-{placement}"))


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_fp32_accumulation_keeps_the_fp32_sum(results: Results, placement: str) -> None:
    for result in _each(results, f"bf16-fp32-{placement}"):
        assert result["main_rel"] <= 1e-5, result["main_rel"]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_autocast_boundaries_are_bf16(results: Results, placement: str) -> None:
    for result in _each(results, f"autocast-{placement}"):
        assert "bfloat16[2, 8, 16]" in result["boundaries"][0][1], result["boundaries"]


@pytest.mark.parametrize("name", TRAINING)
def test_adamw_training_with_clipping_matches_one_process(results: Results, name: str) -> None:
    for result in _each(results, f"train-{name}"):
        # Adam's 1/sqrt(v) amplifies rounding differences of 1e-7 in small gradients: the
        # weights after 3 steps agree within 1e-4 of each parameter's largest weight
        assert result["weight_rel"] <= 1e-4, result["weight_rel"]
        for got, want in result["norms"]:
            assert abs(got - want) <= 1e-5 * want
        for got, want in result["losses"]:
            assert abs(got - want) <= 1e-5 * want
        assert result["optimized"] == result["distinct"], "each object once, the tied one too"


@pytest.mark.parametrize("placement", ["bidirectional", "loop"])  # the V puts the tie on rank 0
def test_the_programs_sum_leaves_every_copy_bitwise_equal(results: Results, placement: str) -> None:
    """The tie (and DualPipe's duplicated stages) summed by the program's all_reduce, inside
    the program: the copies on the two ranks are the same bits (and match the reference:
    test_features_match_the_reference)."""
    found = _each(results, f"tied-{placement}")
    assert all(r["inside"] for r in found), "the program holds the sum"
    copies: dict[Any, list[Any]] = {}
    for result in found:
        for key, grad in result["copies"].items():
            copies.setdefault(key, []).append(grad)
    shared = [key for key, grads in copies.items() if len(grads) == 2]
    assert shared, "some parameter lives on both ranks"
    for key in shared:
        first, second = copies[key]
        assert first.dtype == second.dtype and bool((first == second).all()), key


def test_a_program_without_its_sums_still_sums_after_it(results: Results) -> None:
    found = _each(results, "outside-zb_h1")
    assert not any(r["inside"] for r in found)
    for result in found:
        assert result["grad_rel"] <= 1e-5, result["grad_rel"]


def test_a_program_whose_sums_miss_a_tie_is_refused_on_every_rank_when_built(
    results: Results,
) -> None:
    """The program places a sum, but not the tie's: every rank refuses it when its runtime
    is built (before it makes a group or takes a step), naming the --shared that places it."""
    for rank, result in enumerate(r["uncovered-zb_h1"] for r in results):
        assert result["error"] == "InputError", result
        assert result["message"] == (
            f"error: rank {rank}: the program is refused before its first step: stages 0+1 "
            "hold one parameter on ranks 0, 1, but the program sums no gradients over ranks "
            "0, 1: compile it with --shared 0+1 (pipecc run --shared 0+1 places it too)"
        ), result["message"]


def test_an_undeclared_tie_across_ranks_stops_every_rank(results: Results) -> None:
    for result in (r["undeclared-dualpipe"] for r in results):
        assert result["error"] == "SetupError", result
        assert (
            "'head.lm.weight' of stage 1 is the same Parameter as 'embed.tokens.weight' of "
            "stage 0, but no declaration joins them"
        ) in result["message"]


NEEDS = {  # per placement, per rank: (needs_inputs, needs_targets)
    "loop": [(True, False), (False, True)],
    "vshape": [(True, True), (False, False)],
    "bidirectional": [(True, True), (True, True)],
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_only_the_ranks_that_need_the_data_load_it(results: Results, placement: str) -> None:
    """needs_inputs / needs_targets from the placement; ranks given only what they need
    (the shapes broadcast where they change, None under static_shapes) match the reference
    (test_features_match_the_reference[loaders-*], [static-*])."""
    for variant in ("loaders", "static"):
        found = [tuple(r["needs"]) for r in _each(results, f"{variant}-{placement}")]
        assert found == NEEDS[placement]
    first, second = _each(results, f"loaders-{placement}")[0]["boundaries"]
    assert first != second, "the shapes changed between the steps"


def test_a_resumed_run_continues_bitwise_with_dropout(results: Results) -> None:
    """Saved after step 2 of 4 on ZB-V with dropout 0.2, loaded into new stages, runtime,
    AdamW and LR schedule: steps 2 and 3 give the same losses, and every parameter the
    same bits, as the run that went on. Left at step 0, the runtime draws other masks."""
    for result in _each(results, "ckpt-same-dropout"):
        assert result["resumed"] == result["losses"], result
        assert result["unrestored"] != result["losses"][0], "dropout must matter"
        went_on, resumed = result["weights"]
        assert sorted(went_on) == sorted(resumed)
        for name, value in went_on.items():
            assert torch.equal(value, resumed[name]), name
        assert result["steps"] == 4
        assert result["lr"][0] == result["lr"][1]


@pytest.mark.parametrize("name", ["ckpt-dualpipe-to-zbv", "ckpt-zbv-to-1f1b"])
def test_a_checkpoint_resumes_into_another_schedule_and_cut(results: Results, name: str) -> None:
    """DualPipe (both stages on both ranks) into ZB-V (4 stages), ZB-V into 1F1B (2 stages
    of 2 blocks): by parameter name, each continued step's loss within 1e-5."""
    for result in _each(results, name):
        assert len(result["resumed"]) == len(result["losses"]) == 2
        for got, want in zip(result["resumed"], result["losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_load_checkpoint_returns_rank_0s_extra_on_every_rank(results: Results) -> None:
    found = [r["extra"] for r in _each(results, "ckpt-same-dropout")]
    assert found == [{"next_batch": 2, "rank": 0}] * 2


def test_a_tied_or_duplicated_parameter_is_saved_once(results: Results) -> None:
    """DualPipe holds every parameter on both ranks, the head is the embedding: one entry
    each, under the first key's name, plus the optimizer's and the runtime's."""
    (result, _) = _each(results, "ckpt-dualpipe-to-zbv")
    model = [k for k in result["keys"] if k.startswith("model.")]
    assert len(model) == result["distinct"]
    assert "model.embed.tokens.weight" in model and "model.head.lm.weight" not in model
    assert "optim.embed.tokens.weight.exp_avg" in result["keys"]
    assert {"runtime", "scheduler", "extra"} <= set(result["keys"])


def test_stage_local_names_that_collide_stop_the_save(results: Results) -> None:
    for result in (r["ckpt-clash"] for r in results):
        assert result == {
            "error": "InputError",
            "message": "error: checkpoint: 24 names stand for several parameters, e.g. "
            "'blocks.0.attn.proj.bias' in stages 0, 1: a checkpoint keys parameters by the "
            "whole model's names, so build the stages with them (split_model, or blocks "
            "numbered as in the whole model) or declare a tied weight in "
            "RuntimeConfig(shared=...)",
        }


def test_a_checkpoint_without_what_the_load_needs_is_named(results: Results) -> None:
    for result in (r["ckpt-missing"] for r in results):
        assert result["error"] == "InputError", result
        assert result["message"].endswith(
            "missing: the checkpoint has no optimizer state (156, e.g. "
            "'optim.blocks.0.attn.proj.bias.exp_avg'); no optimizer hyperparameters (52, e.g. "
            "'optim_group.blocks.0.attn.proj.bias'): it was saved without them, or from a model "
            "whose parameters have other names"
        ), result["message"]
