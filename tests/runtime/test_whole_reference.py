"""`--reference whole`: the pipelined model against the unsplit one, by parameter name.

In this process: the stages of examples/decoder.py run one after another (what a pipelined
step equals, test_runtime_schedules.py) compare equal with its `build_model()`, and three
wrong splits (split_bugs.py) fail, each naming what differs, although the stage-by-stage
reference cannot tell. Through `pipecc run`: examples/moe.py (losses added in every stage)
passes on ZB-H1 with its added losses reported, and a split that forgets a layer exits 1
naming the layer.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import split_bugs
import torch
from pipecc.runtime.tools.model_file import load_model
from pipecc.runtime.tools.reference import Options, reference_step
from pipecc.runtime.tools.whole_reference import (
    Held,
    WholeStep,
    check_whole_run,
    compare_by_name,
    grad_diffs,
    held_grads,
    whole_step,
)
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")
DECODER = str(ROOT / "examples" / "decoder.py")
STAGES, MICROBATCHES, ROWS = 2, 4, 16


def _check(bug: str | None, stages: int = STAGES, path: str = DECODER) -> tuple[list[str], float]:
    """The stages of the split (with `bug`) stepped one after another, against the whole."""
    model = load_model(path)
    modules = [split_bugs.broken(model.build_stage(s, stages), bug) for s in range(stages)]  # type: ignore[misc]
    batch = model.batch(ROWS, seed=0)
    reference_step(modules, batch, MICROBATCHES, model.loss_fn)
    held = [[held_grads(dict(enumerate(modules)), 0)]]
    found = check_whole_run(model, [batch], MICROBATCHES, Options(), held)
    return list(found.failures), found.max_rel


@pytest.mark.parametrize("example", ["decoder.py", "titan_stages.py", "moe.py"])
def test_a_correct_split_equals_the_whole_model(example: str) -> None:
    for stages in (2, 4):
        failures, rel = _check(None, stages, str(ROOT / "examples" / example))
        assert failures == [] and rel <= 1e-5, (stages, failures, rel)


def test_a_split_that_drops_the_final_norm_fails_naming_it() -> None:
    failures, rel = _check("drop-norm")
    assert "the model's parameter 'norm.weight' is in no stage" in failures
    assert "the model's parameter 'norm.bias' is in no stage" in failures
    assert rel > 1e-3  # and every gradient upstream of it differs


def test_a_split_that_forgets_a_layer_fails_naming_it() -> None:
    failures, _ = _check("forget-layer")
    assert "the model's parameter 'layers.1.qkv.weight' is in no stage" in failures


def test_a_norm_held_but_never_applied_fails_naming_it() -> None:
    failures, rel = _check("unused-norm")
    assert any("holds 'norm.weight', but no stage uses it" in f for f in failures), failures
    assert rel > 1e-3


def test_the_whole_reference_needs_build_model(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text((ROOT / "examples" / "mlp.py").read_text())
    model = load_model(str(path))
    from pipecc.diagnostics import InputError

    with pytest.raises(InputError, match="needs build_model"):
        check_whole_run(model, [], 1, Options(), [])


def _run(*args: str, bug: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIPECC_SPLIT_BUG": bug or ""}
    return subprocess.run(
        [PIPECC, "run", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
        check=False, env=env,
    )  # fmt: skip


def test_pipecc_run_moe_against_the_whole_model_reports_the_added_losses() -> None:
    done = _run("zb_h1", "--nproc", "2", "-M", "4", "--model", "examples/moe.py", "--check",
                "--reference", "whole", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["reference"] == "whole" and report["check_failures"] == []
    assert report["max_rel_grad_diff"] <= 1e-5
    assert report["aux_loss"] > 0.1
    assert report["aux_loss"] == pytest.approx(report["reference_aux_loss"], rel=1e-6)
    assert sorted(report["aux_loss_by_stage"]) == ["0", "1"]
    assert sum(report["aux_loss_by_stage"].values()) == pytest.approx(report["aux_loss"])
    assert report["loss"] == pytest.approx(report["reference_loss"], rel=1e-6)


def test_pipecc_run_fails_a_split_that_forgets_a_layer() -> None:
    model = str(Path(__file__).with_name("split_bugs.py"))
    done = _run("1f1b", "--nproc", "2", "-M", "2", "--model", model, "--check",
                "--reference", "whole", bug="forget-layer")  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "the pipelined model is not the whole model" in done.stderr
    assert "'layers.1.qkv.weight' is in no stage" in done.stderr


def test_the_moe_example_trains_outside_pipecc_with_its_added_losses() -> None:
    """One model file for both: plain `loss.backward()` (add_loss adds with scale 1) gives
    the gradients of the whole-model step that adds the collected losses explicitly."""
    moe = runpy.run_path(str(ROOT / "examples" / "moe.py"))
    model = moe["build_model"]()
    tokens, targets = moe["make_batch"](4, seed=0)
    whole = whole_step(model, (tokens, targets), 1, moe["loss_fn"])
    assert whole.added > 0.1
    model.zero_grad(set_to_none=True)
    moe["loss_fn"](model(tokens), targets).backward()
    for name, param in model.named_parameters():
        want = whole.grads[name]
        assert want is not None and torch.allclose(param.grad, want, atol=1e-7), name


def test_a_parameter_of_another_shape_fails_naming_it() -> None:
    whole = WholeStep(1.0, 0.0, {"w": torch.ones(3, 2), "b": torch.ones(2)})
    held = [Held(0, 0, "w", torch.ones(2, 3)), Held(1, 1, "b", torch.ones(2))]
    found = compare_by_name(held, whole, (1.0, 0.0), 1e-5)
    assert "stage 0 'w' on rank 0 has shape [2, 3], the model's has [3, 2]" in found.failures
    lines = grad_diffs(held, whole)
    assert lines[0][0] == float("inf") and "shape [2, 3], the model's [3, 2]" in lines[0][1]
    assert lines[1] == (0.0, lines[1][1])  # 'b' equal


def test_the_losses_are_compared_too() -> None:
    whole = WholeStep(1.0, 0.5, {"w": torch.ones(2)})
    found = compare_by_name([Held(0, 0, "w", torch.ones(2))], whole, (1.0, 0.25), 1e-5)
    assert found.failures == ["the added loss 0.25 differs from the whole model's 0.5"]


def test_a_tied_weight_is_compared_under_both_names() -> None:
    """A head tied to the embedding: the stage holding the head names it `head.weight`,
    which the model lists only once unless asked for duplicates."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(x))

    model = Tied()
    tokens = torch.randint(0, 5, (4, 2))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 5), y.reshape(-1))

    whole = whole_step(model, (tokens, tokens), 2, loss_fn)
    assert whole.grads["head.weight"] is not None
    assert torch.equal(whole.grads["head.weight"], whole.grads["embed.weight"])
    held = [Held(0, 0, "embed.weight", whole.grads["embed.weight"]),
            Held(1, 1, "head.weight", whole.grads["head.weight"])]  # fmt: skip
    assert compare_by_name(held, whole, (whole.loss, 0.0), 1e-6).failures == []


TIED_STAGES = str(Path(__file__).with_name("tied_stages.py"))


def _tied(*args: str, declared: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIPECC_TIED_DECLARED": "1" if declared else "0"}
    return subprocess.run(
        [PIPECC, "run", "1f1b", "--nproc", "2", "-M", "4", "--model", TIED_STAGES, "--check",
         *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip


def test_check_compares_with_build_model_by_default_so_an_undeclared_tie_fails() -> None:
    """build_stage builds the tied head and embedding apart: undeclared, the run trains two
    parameters; --check (against build_model() by default) fails naming them."""
    done = _tied(declared=False)
    assert done.returncode == 1, done.stderr
    assert "gradients against the whole model: max abs diff 0.0231, max rel diff 1 " in done.stdout
    assert "stage 0 'embed.weight' on rank 0: max abs diff 0.0231, rel 1" in done.stderr


def test_a_tie_declared_by_the_model_file_passes_both_references() -> None:
    """`shared(num_stages)` in the model file: the run sums the copies' gradients, and the
    stage-by-stage reference ties them (dropout stays on there, off against the whole)."""
    for reference in ("auto", "stages"):
        done = _tied("--reference", reference, "--json", declared=True)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout.splitlines()[-1])
        assert report["reference"] == ("whole" if reference == "auto" else "stages")
        assert report["max_rel_grad_diff"] <= 1e-6, report
        # the tie's sum is an instruction of the program pipecc run verified (not a step
        # after it): the run resolved it as with --shared 0+1
        assert report["verified_ok"] is True
        assert report["gradient_sums"] == [{"what": "grad-sum s0+s1", "ranks": [0, 1]}]
        assert f"note: {TIED_STAGES}: stages 0+1 hold one parameter (tied weights)" in done.stderr


REAL_ONLY = str(Path(__file__).with_name("tied_real_only.py"))


def test_a_tie_found_only_by_the_ranks_is_refused_before_the_first_step() -> None:
    """A tie by Parameter identity in a model that cannot be built on the meta device is
    not found before the program is resolved: every rank refuses the program when its
    runtime is built (exit 2), naming the stages and the --shared that places the sum; with
    that --shared the run verifies the sum and --check passes."""
    args = [PIPECC, "run", "1f1b", "--nproc", "2", "-M", "2", "--model", REAL_ONLY, "--check"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    refused = (
        "the program is refused before its first step: stages 0+1 hold one parameter on ranks "
        "0, 1, but the program sums no gradients over ranks 0, 1: compile it with --shared 0+1 "
        "(pipecc run --shared 0+1 places it too)"
    )
    assert f"error: rank 0: {refused}\nnote: rank 1: {refused}\n" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([*args, "--shared", "0+1", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["gradient_sums"] == [{"what": "grad-sum s0+s1", "ranks": [0, 1]}]
    assert report["max_rel_grad_diff"] <= 1e-6, report


def test_the_model_files_shared_is_read_and_checked(tmp_path: Path) -> None:
    from pipecc.diagnostics import InputError

    path = tmp_path / "m.py"
    base = (ROOT / "examples" / "mlp.py").read_text()
    good = "\ndef shared(n):\n    return [((0, 'a.weight'), (n - 1, 'b.weight'))]\n"
    path.write_text(base + good)
    assert load_model(str(path)).declared_shared(3) == (((0, "a.weight"), (2, "b.weight")),)
    path.write_text(base + "\ndef shared(n):\n    return [((0, 'a.weight'),)]\n")
    with pytest.raises(InputError) as err:
        load_model(str(path)).declared_shared(2)
    assert err.value.message == (
        f"{path}: shared(2) must return groups of two or more (stage, parameter name) pairs "
        "with stages below 2, e.g. [((0, 'embed.weight'), (1, 'head.weight'))]; got "
        "[((0, 'a.weight'),)]"
    )
