"""Own stages only: `split_model`, `build_stage` and the boundaries found along the pipeline.

In this process: a stage cut by `split_model` keeps the whole model's parameter names, takes
the whole model's checkpoint by name, and the stages in order compute what the whole model
does; its refusals. In two spawned ranks (one process group for every case,
own_stage_cases.py): each rank materializes only its own stages' parameters, the gradients of
a step equal the whole model's by name, the boundaries equal `infer_boundaries` of the whole
model, and a stage that raises gives the rank's error with the user's traceback. Through
`pipecc run` with a model file that defines only `build_stage`: each rank's process builds
only its stages, the launcher's reference all of them, and --check passes.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import own_stage_cases
import own_stage_model as model
import pytest
import torch
from pipecc.runtime import infer_boundaries, split_model
from pipecc.runtime.tools.reference import reference_step
from pipecc.runtime.tools.spawn import spawn
from pipecc.runtime.tools.split_model import stage_layers
from torch import nn

from pipecc.api import compile_schedule
from pipecc.diagnostics import InputError

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(Path(__file__).with_name("own_stage_model.py"))
PIPECC = str(Path(sys.executable).parent / "pipecc")


def whole_model() -> nn.Module:
    """The whole model on the CPU, initialised by name as every stage is."""
    net = model.Net()
    model.init(net)
    return net


def meta_model(blocks: int = model.BLOCKS) -> nn.Module:
    with torch.device("meta"):
        return model.Net(blocks=blocks)


class Nested(nn.Module):
    """Layers in a ModuleDict inside a submodule, a Sequential head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Module()
        self.trunk.layers = nn.ModuleDict({f"l{i}": nn.Linear(3, 3) for i in range(3)})
        self.head = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trunk is not None:
            for layer in self.trunk.layers.values():
                x = layer(x)
        for part in self.head:
            x = part(x)
        return x


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_stages_keep_the_whole_models_names_and_take_its_checkpoint(num_stages: int) -> None:
    whole = whole_model()
    checkpoint = whole.state_dict()
    names: list[str] = []
    x = torch.randn(5, 4)
    value = x
    for stage in range(num_stages):
        part = split_model(meta_model(), stage, num_stages, layers="blocks", init=None)
        mine = list(part.state_dict())
        assert mine and set(mine) <= set(checkpoint), "the whole model's names, kept"
        part.load_state_dict({name: checkpoint[name] for name in mine}, strict=True)
        names += mine
        with torch.no_grad():
            value = part(value)
    assert names == list(checkpoint), "every name once, in the whole model's order"
    with torch.no_grad():
        assert torch.equal(value, whole(x)), "the stages in order compute the whole model"


def test_a_stage_by_name_lists_in_nested_containers() -> None:
    with torch.device("meta"):
        meta = Nested()
    layers = [["trunk.layers.l0", "trunk.layers.l2"], ["head.0", "head.2"],
              ["trunk.layers.l1", "head.1"]]  # fmt: skip
    parts = [split_model(meta, s, 3, layers=layers, init=None) for s in range(3)]
    assert [list(p.state_dict()) for p in parts] == [
        ["trunk.layers.l0.weight", "trunk.layers.l0.bias", "trunk.layers.l2.weight",
         "trunk.layers.l2.bias"],
        ["head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias"],
        ["trunk.layers.l1.weight", "trunk.layers.l1.bias"],
    ]  # fmt: skip
    assert list(parts[0].trunk.layers) == ["l0", "l2"], "a ModuleDict keeps its keys"
    assert parts[1].trunk is None, "a module of no layer of the stage is None"
    assert [type(m).__name__ for m in parts[2].head] == ["Tanh"], "a Sequential keeps its keys"
    assert all(p.device.type == "meta" for p in meta.parameters()), "the model is untouched"


def test_the_cut_of_a_layer_container() -> None:
    """The first stages take one layer more; what is before the container goes to the
    first stage, what is after it to the last."""
    with torch.device("meta"):
        meta = model.Net()
    model_blocks = len(meta.blocks)
    cut = stage_layers(meta, 3, "blocks")
    sizes = [len([n for n in stage if n.startswith("blocks.")]) for stage in cut]
    assert sum(sizes) == model_blocks and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert cut[0][0] == "embed" and cut[-1][-1] == "head"


def test_init_runs_on_the_materialized_stage_only() -> None:
    seen: list[tuple[str, str]] = []

    def init(module: nn.Module) -> None:
        seen.extend((name, p.device.type) for name, p in module.named_parameters())
        model.init(module)

    part = split_model(meta_model(), 1, 2, layers="blocks", init=init)
    assert [name for name, _ in seen] == [name for name, _ in part.named_parameters()]
    assert {device for _, device in seen} == {"cpu"}
    assert not any(name.startswith("embed") for name, _ in seen)


@pytest.mark.parametrize(
    ("make", "layers", "said"),
    [
        (model.Net, "blocks", "takes a model built on the meta device"),
        (meta_model, "embed", "must name the model's ModuleList, ModuleDict or Sequential"),
        (meta_model, [["embed", "blocks.0"], ["blocks.9"]], "stage 1's layers name ['blocks.9']"),
        (meta_model, [["embed"], ["head"]], "blocks.0.linear.weight, blocks.0.linear.bias"),
        (meta_model, [["embed", "blocks", "head"]], "layers names 1 stages, but the model is"),
    ],
    ids=["not-meta", "not-a-container", "unknown-name", "homeless-parameters", "stage-count"],
)
def test_refusals_name_the_problem(make: Any, layers: Any, said: str) -> None:
    with pytest.raises(InputError, match=None) as caught:
        split_model(make(), 0, 2, layers=layers, init=None)
    assert said in caught.value.message, caught.value.message


# ---- two ranks, through the Python API -----------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn(own_stage_cases.run, 2, None, timeout=60.0)


def _stage_names(num_stages: int, stages: set[int], blocks: int = model.BLOCKS) -> set[str]:
    meta = meta_model(blocks)
    cut = stage_layers(meta, num_stages, "blocks")
    return {
        name
        for name, _ in meta.named_parameters()
        if any(name == held or name.startswith(held + ".") for s in stages for held in cut[s])
    }


@pytest.mark.parametrize("schedule", own_stage_cases.SCHEDULES)
def test_each_rank_materializes_only_its_stages(ranks: list[dict[str, Any]], schedule: str) -> None:
    program = compile_schedule(schedule, ranks=2, microbatches=own_stage_cases.MICROBATCHES)
    num_stages = program.placement.num_stages(0)
    for rank, result in enumerate(ranks):
        held = {slot.stage for slot in program.placement.chunks(rank)}
        got = result[schedule]["materialized"]
        assert len(got) == len(set(got)), "each parameter materialized once"
        assert set(got) == _stage_names(num_stages, held), f"rank {rank} holds {held}"


@pytest.mark.parametrize("schedule", own_stage_cases.SCHEDULES)
def test_own_stages_train_as_the_whole_model(ranks: list[dict[str, Any]], schedule: str) -> None:
    microbatches, rows = own_stage_cases.MICROBATCHES, own_stage_cases.ROWS
    whole = whole_model()
    batch = model.make_batch(rows * microbatches, seed=1)
    loss, want = reference_step([whole], batch, microbatches, nn.functional.mse_loss)
    seen = set()
    for rank, result in enumerate(ranks):
        for name, grad in result[schedule]["grads"].items():
            ref = want[(0, name)]
            diff = float((grad - ref).abs().max()) / float(ref.abs().max())
            assert diff <= 1e-6, f"rank {rank} {name}: off by {diff}"
            seen.add(name)
    assert seen == {name for _, name in want}, "every parameter on some rank"
    losses = {mb: v for result in ranks for mb, v in result[schedule]["losses"].items()}
    assert abs(sum(losses.values()) / microbatches - loss) <= 1e-6 * loss


@pytest.mark.parametrize("schedule", own_stage_cases.SCHEDULES)
def test_boundaries_along_the_pipeline_equal_the_whole_models(
    ranks: list[dict[str, Any]], schedule: str
) -> None:
    program = compile_schedule(schedule, ranks=2, microbatches=own_stage_cases.MICROBATCHES)
    num_stages = program.placement.num_stages(0)
    stages = [split_model(meta_model(), s, num_stages, layers="blocks", init=model.init)
              for s in range(num_stages)]  # fmt: skip
    sample = model.make_batch(own_stage_cases.ROWS, seed=1)[0]
    want = {s: b.text() for s, b in infer_boundaries(stages, sample).items()}
    for result in ranks:
        assert result[schedule]["boundaries"] == want


def test_a_stage_that_raises_keeps_the_users_traceback(ranks: list[dict[str, Any]]) -> None:
    """The one-line error names the rank, the step and the instruction; the cause is the
    user's exception, whose traceback ends in the user's file at the raising line."""
    result = ranks[1]["raise"]
    assert result["error"] == "InstructionError" and result["cause"] == "ValueError"
    first, *rest = result["details"].splitlines()
    assert first.startswith("rank 1, step 0: instruction ")
    assert first.endswith("(F0.0): ValueError: a bug in the user's block")
    assert result["message"] == "error: " + first, "str() is the one line"
    line = _line_of(MODEL, 'raise ValueError("a bug in the user\'s block")')
    assert f'  File "{MODEL}", line {line}, in forward' in rest, result["details"]
    # its peer stops with a pipecc error: told of the failure at once (runtime/comm/failure.py)
    assert ranks[0]["raise"]["error"] in ("RuntimeFailed", "RankError")
    assert "Traceback" not in ranks[0]["raise"]["message"]


def _line_of(path: str, text: str) -> int:
    lines = Path(path).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


# ---- pipecc run with a model file that defines only build_stage --------------------------------


@pytest.mark.parametrize("schedule", ["zbv", "dualpipe"])
def test_pipecc_run_builds_each_ranks_stages_only(tmp_path: Path, schedule: str) -> None:
    log = tmp_path / "built.jsonl"
    env = dict(os.environ, PIPECC_TEST_LOG=str(log), PIPECC_TEST_BLOCKS="8")
    result = subprocess.run(
        [PIPECC, "run", schedule, "--nproc", "2", "-M", "4", "--model", MODEL, "--check",
         "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["max_rel_grad_diff"] <= 1e-6
    program = compile_schedule(schedule, ranks=2, microbatches=4)
    num_stages = program.placement.num_stages(0)
    built: dict[Any, list[int]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        built.setdefault(record["rank"], []).append(record["stage"])
        assert record["whole_off_meta"] == 0, "the whole model stays on the meta device"
        assert set(record["params"]) == _stage_names(num_stages, {record["stage"]}, blocks=8)
    for rank in (0, 1):
        held = sorted({slot.stage for slot in program.placement.chunks(rank)})
        assert sorted(built[rank]) == held, f"rank {rank} built only its own stages"
    assert sorted(built[None]) == list(range(num_stages)), "the reference builds all"


def test_the_gpt_example_splits_with_the_whole_models_names() -> None:
    """examples/gpt_stages.py: for any number of stages, the stages hold the whole GPT's
    parameter names once each, in order, and in order compute what the whole model does
    (initialised by name, the whole model materialized here has the stages' weights)."""
    example = runpy.run_path(str(ROOT / "examples" / "gpt_stages.py"))
    tokens = example["make_batch"](3, seed=0)[0]
    for num_stages in (1, 2, 4):
        whole = example["whole_model"](num_stages).to_empty(device="cpu")
        example["init"](whole)
        stages = [example["build_stage"](s, num_stages) for s in range(num_stages)]
        names = [name for stage in stages for name, _ in stage.named_parameters()]
        assert names == [name for name, _ in whole.named_parameters()]
        value = tokens
        with torch.no_grad():
            for stage in stages:
                value = stage(value)
            assert torch.equal(value, whole(tokens)), f"{num_stages} stages"


def test_pipecc_run_checks_the_gpt_example(tmp_path: Path) -> None:
    result = subprocess.run(
        [PIPECC, "run", "dualpipe", "--nproc", "2", "-M", "4", "--model",
         str(ROOT / "examples" / "gpt_stages.py"), "--check", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["max_rel_grad_diff"] <= 1e-6
    assert abs(report["loss"] - report["reference_loss"]) <= 1e-6 * report["reference_loss"]


def test_a_container_a_stage_holds_nothing_of_stays_empty() -> None:
    """A stage of the embedding alone keeps `blocks` as an empty ModuleList, so the forward's
    loop over it runs no layer (torchtitan's choice), and computes the embedding."""
    layers = [["embed"], [f"blocks.{i}" for i in range(model.BLOCKS)] + ["head"]]
    first = split_model(meta_model(), 0, 2, layers=layers, init=model.init)
    assert isinstance(first.blocks, nn.ModuleList) and len(first.blocks) == 0
    assert first.head is None
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(first(x), first.embed(x))


def test_the_cut_of_a_nested_container() -> None:
    """HF's layout: the layers inside `model`, the embedding before them, the norm after,
    the LM head beside `model`: every part on a stage, each once."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
            self.norm = nn.LayerNorm(3)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(3, 5)

    with torch.device("meta"):
        meta = Outer()
    assert stage_layers(meta, 2, "model.layers") == [
        ["model.embed", "model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3", "model.norm", "lm_head"],
    ]
