"""`pipecc run --partition cut.toml`: the stages are built from a cut `pipecc search --layers`
chose (the model file's `build_layers_model` and `init_stage`, through `split_model`), the
gradients match the single-process reference built from the same cut, and a cut that does
not fit the program or the model is refused (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pipecc.runtime.tools.model_file import load_model

from pipecc.cli import main
from pipecc.search.layers import cut_layers, load_layers

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")
MODEL = str(ROOT / "examples" / "gpt_stages.py")
NAMES = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]


def _profile(path: Path) -> None:
    """A profile of examples/gpt_stages.py's layers whose head is 3x a block."""
    lines = ['unit = "ms"', "comm = 0.05"]
    for name in NAMES:
        scale = 3.0 if name == "head" else 0.3 if name == "embed" else 1.0
        lines += ["[[layer]]", f'name = "{name}"', f"F = {scale}", f"B = {2 * scale}"]
        lines += ["act_bytes = 1000"]
    path.write_text("\n".join(lines) + "\n")


def _pipecc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PIPECC, *args], capture_output=True, text=True, cwd=ROOT, timeout=180, check=False
    )


def _cut(path: Path, stages: list[list[str]], recompute: int | None = None) -> None:
    lines = []
    for index, layers in enumerate(stages):
        names = ", ".join(f'"{n}"' for n in layers)
        lines += ["[[stage]]", f"index = {index}", f"layers = [{names}]"]
        lines += ['recompute = "full"'] if index == recompute else []
    path.write_text("\n".join(lines) + "\n")


def test_the_stages_hold_the_cuts_layers() -> None:
    """Built in process: each stage holds exactly its layers of the cut (not the even split
    build_stage would give), with the whole model's names and weights of any cut."""
    cut = (("embed", "blocks.0", "blocks.1", "blocks.2"), ("blocks.3", "head"))
    model = load_model(MODEL).with_cut(cut)
    model.check_cut(2)
    stages = model.all_stages(2)
    held = [{name.split(".weight")[0].split(".bias")[0] for name, _ in s.named_parameters()}
            for s in stages]  # fmt: skip
    assert any(n.startswith("blocks.2.") for n in held[0])
    assert not any(n.startswith("blocks.2.") for n in held[1])
    assert any(n.startswith("head.") for n in held[1])
    even = load_model(MODEL).with_cut((cut[0][:3], cut[0][3:] + cut[1])).all_stages(2)
    weights = dict(stages[0].named_parameters())
    for name, value in even[1].named_parameters():
        if name in weights:
            assert weights[name].equal(value), f"{name}: the same weight in every cut"


def test_a_cut_that_recomputes_a_stage_runs_and_checks(tmp_path: Path) -> None:
    """`recompute = "full"` in a cut is the runtime's recomputation of that stage, checked
    against the single-process reference."""
    _cut(tmp_path / "cut.toml", [NAMES[:3], NAMES[3:]], recompute=1)
    ran = _pipecc(
        "run", "zb_h1", "--nproc", "2", "-M", "4", "--model", MODEL,
        "--partition", str(tmp_path / "cut.toml"), "--check", "--json",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["max_rel_grad_diff"] <= 1e-5


@pytest.mark.parametrize(("placement", "schedule"), [("loop", "1f1b"), ("vshape", "zbv")])
def test_a_searched_cut_runs_and_checks(tmp_path: Path, placement: str, schedule: str) -> None:
    _profile(tmp_path / "layers.toml")
    cut = tmp_path / "cut.toml"
    searched = _pipecc(
        "search", "-P", "2", "-M", "4", "--layers", str(tmp_path / "layers.toml"),
        "--placement", placement, "--partition", str(cut),
    )  # fmt: skip
    assert searched.returncode == 0, searched.stderr
    assert "head" in cut.read_text()
    ran = _pipecc(
        "run", schedule, "--nproc", "2", "-M", "4", "--model", MODEL, "--partition", str(cut),
        "--check", "--json",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    fields = json.loads(ran.stdout)
    assert fields["max_rel_grad_diff"] <= 1e-5
    assert fields["reference_loss"] == pytest.approx(fields["loss"], rel=1e-5)


@pytest.mark.parametrize(
    ("stages", "recompute", "said"),
    [
        ([NAMES], None, "the cut has 1 stages, but the program (1f1b) has 2"),
        ([NAMES[:3], NAMES[3:-1] + ["haed"]], None, "which the model does not have"),
        ([NAMES[:3], NAMES[3:-1]], None, "head"),  # the head's weights belong to no stage
    ],
)
def test_a_bad_cut_is_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    stages: list[list[str]],
    recompute: int | None,
    said: str,
) -> None:
    """Refused before any process starts (in process here: the same `main`)."""
    _cut(tmp_path / "cut.toml", stages, recompute)
    code = main(
        ["run", "1f1b", "--nproc", "2", "-M", "4", "--model", MODEL,
         "--partition", str(tmp_path / "cut.toml")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert said in err


def test_a_model_file_without_the_layers_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cut(tmp_path / "cut.toml", [NAMES[:3], NAMES[3:]])
    code = main(
        ["run", "1f1b", "--nproc", "2", "-M", "4", "--model", str(ROOT / "examples" / "gpt.py"),
         "--partition", str(tmp_path / "cut.toml")]
    )  # fmt: skip
    assert code == 2
    assert "needs build_layers_model and init_stage" in capsys.readouterr().err


def test_the_layer_profile_round_trips_into_search(tmp_path: Path) -> None:
    """`pipecc run --profile-layers` writes every layer of the model file, in order, with
    measured durations and bytes; `pipecc search --layers` reads it and writes a cut of those
    layers, which `pipecc run --partition` runs (the whole loop)."""
    profile, costs = tmp_path / "layers.toml", tmp_path / "costs.toml"
    ran = _pipecc(
        "run", "1f1b", "--nproc", "2", "-M", "4", "--model", MODEL,
        "--profile-layers", str(profile), "--profile", str(costs), "--allow-noisy-profile",
        "--steps", "3", "--warmup", "1",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    layers = load_layers(profile)
    assert list(layers.names) == NAMES
    assert layers.post > 0 and layers.wait > 0  # the run's host time, as its cost file's
    # each stage of the run (the layers' uniform cut: embed and 2 blocks | 2 blocks and the
    # head) sums to what the same run measured for it: I + W to its B (1f1b does not split);
    # F is each layer's timed inside the run, with the stages' own work per F as F_fixed
    measured = tomllib.loads(costs.read_text())["cost"]["stage"]
    spans = (("0", layers.layers[:3]), ("1", layers.layers[3:]))
    for stage, span in spans:
        assert sum(x.I + x.W for x in span) == pytest.approx(measured[stage]["B"], rel=1e-3)
        assert sum(x.F for x in span) < measured[stage]["F"]  # the layers run inside F
    assert layers.F_fixed > 0
    whole = sum(sum(x.F for x in span) + layers.F_fixed for _, span in spans)
    assert whole == pytest.approx(measured["0"]["F"] + measured["1"]["F"], rel=0.1)
    blocks = [layer for layer in layers.layers if layer.name.startswith("blocks.")]
    assert all(layer.F > 0 and layer.I > 0 and layer.W > 0 for layer in layers.layers)
    assert all(layer.act_bytes > 0 and layer.param_bytes > 0 for layer in blocks)
    assert blocks[0].param_bytes == sum(
        p.numel() * 4
        for p in load_model(MODEL).layers_model().get_submodule("blocks.0").parameters()
    )
    cut = tmp_path / "cut.toml"
    searched = _pipecc(
        "search", "-P", "2", "-M", "4", "--layers", str(profile), "--placement", "loop",
        "--partition", str(cut),
    )  # fmt: skip
    assert searched.returncode == 0, searched.stderr
    assert [n for stage in cut_layers(cut) for n in stage] == NAMES


def _recomputing_program(path: Path, stages: list[int]) -> None:
    """zb_h1 P=2 M=4 as a JSON program whose recompute field names `stages`."""
    assert main(["compile", "zb_h1", "-P", "2", "-M", "4", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    data["recompute"] = [{"stage": s, "mode": "full"} for s in stages]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("flag", "cut_stage", "said"),
    [
        (["--recompute", "none"], None, "--recompute none conflicts with the program"),
        (["--recompute", "0:full"], None, "--recompute 0:full conflicts with the program"),
        ([], 0, "the cut's recompute conflicts with the program"),
    ],
)
def test_a_recompute_that_contradicts_the_program_is_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flag: list[str],
    cut_stage: int | None,
    said: str,
) -> None:
    """The program recomputes stage 1: --recompute or a cut saying otherwise is exit 2,
    before any process starts."""
    program = tmp_path / "p.json"
    _recomputing_program(program, [1])
    _cut(tmp_path / "cut.toml", [NAMES[:3], NAMES[3:]], recompute=cut_stage)
    capsys.readouterr()
    code = main(
        ["run", str(program), "--model", MODEL, "--partition", str(tmp_path / "cut.toml"),
         *flag]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert said in err and "recomputes stage(s) 1" in err


def test_a_program_that_recomputes_a_stage_runs_it_recomputed(tmp_path: Path) -> None:
    """The program's recompute field alone (no flag, no cut line) recomputes stage 0: the
    gradients match the reference, and rank 0, which holds two microbatches' activations
    at once on zb_h1, keeps only their inputs (its measured peak is lower)."""
    peaks = []
    for stages in ([0], []):
        program = tmp_path / f"p{len(stages)}.json"
        _recomputing_program(program, stages)
        ran = _pipecc("run", str(program), "--model", MODEL, "--check", "--memory", "--json")
        assert ran.returncode == 0, ran.stderr
        fields = json.loads(ran.stdout)
        assert fields["max_rel_grad_diff"] <= 1e-5
        peaks.append(fields["memory"][0]["measured_bytes"])
    assert peaks[0] < peaks[1]


def test_profiling_the_layers_of_a_recomputed_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recomputed stage's I holds its F again: scaling the layers to it would count F
    twice once the search adds recomputation itself; refused before any process starts."""
    code = main(
        ["run", "zb_h1", "--nproc", "2", "-M", "4", "--model", MODEL, "--recompute", "1:full",
         "--profile-layers", str(tmp_path / "layers.toml")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "recomputes stage(s) 1: profile without recomputation" in err
    assert not (tmp_path / "layers.toml").exists()


def test_selections_beside_the_programs_full_stages_are_kept() -> None:
    """A program recomputing stage 1 in full and `--recompute 1:full,0:attn`: the selection
    on stage 0 runs too (it was dropped, silently, for the program's field alone)."""
    import argparse
    from types import SimpleNamespace

    from pipecc.runtime.engine.recompute import parse_spec

    from pipecc.commands.run import _recompute

    program = SimpleNamespace(recompute=(1,), placement=SimpleNamespace(num_stages=lambda p: 2))
    args = argparse.Namespace(recompute="1:full,0:attn")
    assert _recompute(args, program, {}, parse_spec) == {1: "full", 0: "attn"}  # type: ignore[arg-type]
    args = argparse.Namespace(recompute=None)
    assert _recompute(args, program, {}, parse_spec) == {1: "full"}  # type: ignore[arg-type]
