"""`pipecc run`: the contract scripts depend on (DESIGN §7, §8).

Each run starts real processes (seconds each), so the cases are few and each checks much:
the JSON object and its fields, the cost file, exit code 2 for unusable input before any
process starts, exit code 1 for a failed check or a failing rank (the message names the rank
and the instruction), and a rank killed mid-step stopping the others, not hanging them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from pipecc.api import compile_schedule
from pipecc.cli import main
from pipecc.semantics.costs import Cut, load_cost_file
from pipecc.simulate.timeline import simulate

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")
FAULTY = str(Path(__file__).with_name("fault_model.py"))
MLP = str(ROOT / "examples" / "mlp.py")
FIELDS = {"schedule", "ranks", "microbatches", "loss", "max_abs_grad_diff", "max_rel_grad_diff",
          "step_ms", "steps"}  # fmt: skip


def pipecc(*args: str, fault: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIPECC_TEST_FAULT=fault, PIPECC_MLP_HIDDEN="16")
    return subprocess.run([PIPECC, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout, check=False)  # fmt: skip


def test_json_check_and_profile(tmp_path: Path) -> None:
    costs = tmp_path / "costs.toml"
    result = pipecc("run", "dualpipev", "--nproc", "2", "-M", "4", "--model", MLP, "--check",
                    "--json", "--steps", "2", "--warmup", "1", "--profile", str(costs),
                    "--allow-noisy-profile")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # exactly one JSON object, nothing else on stdout
    assert FIELDS <= set(report)
    assert report["schedule"] == "dualpipev"
    assert (report["comm"], report["comm_choice"]) == ("early-recv", "backend"), "gloo's policy"
    assert report["program"] == "dualpipev P=2 M=4, comm ops placed by early-recv (gloo's default)"
    assert (report["verified"], report["verified_ok"]) == ("rendezvous", True), "verified first"
    assert (report["ranks"], report["microbatches"], report["steps"]) == (2, 4, 2)
    assert report["batch_size"] == 32, "default batch size is 8·M"
    assert report["max_rel_grad_diff"] <= 1e-6
    assert abs(report["loss"] - report["reference_loss"]) <= 1e-6 * report["reference_loss"]
    assert report["step_ms"] > 0
    text = costs.read_text()
    assert text.startswith("# pipecc run --profile: dualpipev")
    assert "comm policy early-recv\n" in text, "the cost file says which policy it measured"
    model = load_cost_file(costs)  # the simulator's parser accepts it
    assert model.unit == "ms"
    for key in ("F", "B", "I", "W", "FB", "comm", "bytes"):
        assert getattr(model.base, key) is not None, f"{key} measured"
    assert model.host.post and model.host.wait is not None, "host time per post and wait"
    assert model.host.sync is None, "DualPipeV holds every stage once: nothing to sum"
    assert model.base.bytes == 8 * 16 * 4, "one microbatch: 8 rows × 16 fp32"
    assert [stage for stage, _ in model.stages] == [0, 1, 2, 3]
    assert model.measured == Cut(2, 4, "vshape"), "the file says what it was measured on"


@pytest.mark.parametrize(
    ("name", "shared", "summed"), [("1f1b", (0, 1), True), ("zbv", (0, 3), False)]
)
def test_profile_of_tied_weights_names_the_shared_stages(
    tmp_path: Path, name: str, shared: tuple[int, int], summed: bool
) -> None:
    """A tied GPT (the token embedding is the LM head): the cost file names the first and the
    last stage in `shared`. On 1F1B they are on ranks 0 and 1, so the run measures the sum as
    `sync` and the simulator adds it to the step; ZB-V's rank 0 holds both, so nothing is
    summed across ranks, nothing measured, nothing added."""
    costs = tmp_path / "costs.toml"
    env = dict(os.environ, PIPECC_GPT_TIED="1")
    gpt = str(ROOT / "examples" / "gpt.py")
    result = subprocess.run(
        [PIPECC, "run", name, "--nproc", "2", "-M", "2", "--model", gpt, "--steps", "1",
         "--warmup", "0", "--profile", str(costs), "--allow-noisy-profile"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    model = load_cost_file(costs)
    assert model.shared == (shared,), costs.read_text()
    assert (model.sync > 0) is summed, costs.read_text()
    program = compile_schedule(name, ranks=2, microbatches=2)
    timeline = simulate(program, model.for_program(program))
    assert timeline.sync == model.sync
    assert timeline.step == timeline.makespan + model.sync


def test_the_flag_or_a_compiled_program_chooses_the_policy(tmp_path: Path) -> None:
    result = pipecc("run", "zbv", "--nproc", "2", "-M", "4", "--model", MLP, "--check", "--json",
                    "--comm-policy", "default")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["comm"], report["comm_choice"]) == ("default", "flag")
    assert report["max_rel_grad_diff"] <= 1e-6
    compiled = tmp_path / "zbv.json"
    made = pipecc("compile", "zbv", "-P", "2", "-M", "4", "-o", str(compiled))
    assert made.returncode == 0, made.stderr
    result = pipecc("run", str(compiled), "--model", MLP, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["comm"], report["comm_choice"]) == ("default", "program"), "runs as compiled"


def run_inline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str, fault: str = ""
) -> tuple[int, str, str]:
    """`pipecc` in this process (its ranks are still spawned): exit code, stdout, stderr."""
    monkeypatch.setenv("PIPECC_TEST_FAULT", fault)
    monkeypatch.setenv("PIPECC_MLP_HIDDEN", "16")
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_recompute_checks_against_the_reference(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["run", "zb_h1", "--nproc", "2", "-M", "4", "--model", MLP, "--check"]
    code, out, err = run_inline(capsys, monkeypatch, *args, "--recompute", "0:full", "--json")
    assert code == 0, err
    assert json.loads(out)["max_rel_grad_diff"] <= 1e-5


def test_without_check_diffs_are_null(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_inline(capsys, monkeypatch, "run", "1f1b", "--nproc", "2", "-M", "2",
                                "--model", MLP, "--json")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["max_abs_grad_diff"] is None and report["max_rel_grad_diff"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "10"], "--batch-size 10 cannot be split into 4 equal microbatches"),
        (["--model", "no/such/model.py"], "no/such/model.py: no such model file"),
        (
            ["--model", __file__],
            "must define build_stage(stage, num_stages) (one stage) or "
            "build_stages(num_stages) (all of them)",
        ),
        (["--timeout", "0"], "--timeout must be positive"),
        (
            ["--recompute", "attn"],
            "recompute: 'attn' matches no submodule of the stages "
            "(module types there: GELU, Linear, Sequential)",
        ),
        (
            ["--recompute", "1:type=Attention"],
            "recompute of stage 1: 'type=Attention' matches no submodule of the stage",
        ),
        (["--recompute", "kind=Linear"], "'kind=Linear' is not a module selector"),
        (["--recompute", "0:full,2:none"], "recompute: stage 2 is not one of 0..1"),
        (["--recompute", "first:full"], "'first:full' is not stage:mode"),
    ],
)
def test_unusable_input_exits_2(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
) -> None:
    base = ["run", "1f1b", "--nproc", "2", "-M", "4", "--model", MLP]
    code, _, err = run_inline(capsys, monkeypatch, *base, *args)
    assert code == 2, err
    assert message in err


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("torch", "error: pipecc run needs torch (pip install 'pipecc[runtime]')"),
        ("pipecc.runtime.tools.launcher", "error: pipecc run: the runtime could not be imported: "
                                    "ModuleNotFoundError: import of pipecc.runtime.tools.launcher "
                                    "halted; None in sys.modules"),
    ],
)  # fmt: skip
def test_a_runtime_that_cannot_be_imported_says_why(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    missing: str,
    message: str,
) -> None:
    """Only a missing torch (or numpy) asks for the runtime extra; any other import failure
    inside the runtime is reported as it is, not as a missing torch."""
    if missing == "torch":  # the runtime imported afresh, torch not importable
        for name in [n for n in sys.modules if n.startswith("pipecc.runtime")]:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)
    code, _, err = run_inline(capsys, monkeypatch, "run", "1f1b", "--nproc", "2", "-M", "2",
                              "--model", MLP)  # fmt: skip
    assert code == 2
    assert err.startswith(message), err


def test_bad_flag_exits_2() -> None:
    result = pipecc("run", "1f1b", "--nproc", "0", "-M", "4", "--model", MLP)
    assert result.returncode == 2
    assert "expected a positive integer" in result.stderr


def test_failed_check_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_inline(capsys, monkeypatch, "run", "zb_h1", "--nproc", "2", "-M", "2",
                                "--model", FAULTY, "--check", "--json", fault="random")  # fmt: skip
    assert code == 1
    assert json.loads(out)["max_rel_grad_diff"] > 1e-5
    assert "check failed: max_rel_grad_diff" in err
    assert re.search(r"worst parameters:\n  stage \d '[\w.]+' on rank \d: max abs diff", err), err


def test_integer_targets_without_loss_fn_name_loss_fn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "classes.py"
    model.write_text(
        "import torch\n"
        "def build_stages(n):\n"
        "    return [torch.nn.Linear(4, 4) for _ in range(n)]\n"
        "def make_batch(rows, seed):\n"
        "    return torch.zeros(rows, 4), torch.zeros(rows, dtype=torch.int64)\n"
    )
    code, _, err = run_inline(capsys, monkeypatch, "run", "1f1b", "--nproc", "2", "-M", "2",
                              "--model", str(model))  # fmt: skip
    assert code == 2, err
    assert "make_batch returns int64 targets, but the model file defines no loss_fn" in err


def test_rank_error_names_rank_and_instruction(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the user's model: the line naming the rank, the step and the instruction,
    then the exception's full traceback, down to the user's file and line."""
    code, _, err = run_inline(capsys, monkeypatch, "run", "1f1b", "--nproc", "2", "-M", "4",
                              "--model", FAULTY, fault="raise")  # fmt: skip
    assert code == 1
    first, second, *rest = err.splitlines()
    assert re.fullmatch(
        r"error: rank 1, step 0: instruction \d+ \(F0\.\d\): ValueError: stage exploded on purpose",
        first,
    ), err
    assert second == "Traceback (most recent call last):", err
    line = _line_of(FAULTY, 'raise ValueError("stage exploded on purpose")')
    assert f'  File "{FAULTY}", line {line}, in forward' in rest, err
    assert "ValueError: stage exploded on purpose" in rest, "the traceback ends with the error"


def _line_of(path: str, text: str) -> int:
    lines = Path(path).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


def test_killed_rank_stops_the_others(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    start = time.monotonic()
    code, _, err = run_inline(capsys, monkeypatch, "run", "1f1b", "--nproc", "3", "-M", "6",
                              "--model", FAULTY, "--timeout", "100", fault="kill")  # fmt: skip
    assert code == 1
    assert err.splitlines()[0] == "error: rank 1: the process died (killed by SIGKILL)", err
    assert time.monotonic() - start < 60, "the others stopped long before their timeout"


def test_model_file_boundaries_and_autocast(tmp_path: Path) -> None:
    """A model file's boundaries(example_inputs) and autocast are used: the GPT under bf16
    autocast with explicit specs checks within the bf16 tolerance, which --json reports."""
    model = tmp_path / "gpt_bf16.py"
    model.write_text(
        "import runpy, torch\n"
        "from pipecc.runtime import TensorSpec\n"
        f"gpt = runpy.run_path({str(ROOT / 'examples' / 'gpt.py')!r})\n"
        "build_stages, make_batch = gpt['build_stages'], gpt['make_batch']\n"
        "loss_fn = gpt['loss_fn']\n"
        "autocast = torch.bfloat16\n"
        "def boundaries(example):\n"
        "    rows, seq = example.shape\n"
        "    hidden = TensorSpec((rows, seq, 32), torch.float32)\n"
        "    return {0: TensorSpec((rows, seq), torch.int64, False), 1: hidden, 2: hidden}\n"
    )
    result = pipecc("run", "zb_h1", "--nproc", "2", "-M", "4", "--model", str(model), "--check",
                    "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tolerance"] == 1e-2, "autocast: the bf16 tolerance"
    assert report["max_rel_grad_diff"] <= 1e-2
    wrong = model.read_text().replace("(rows, seq, 32)", "(rows, seq, 31)")
    model.write_text(wrong)
    result = pipecc("run", "zb_h1", "--nproc", "2", "-M", "4", "--model", str(model))
    assert result.returncode == 1, result.stderr
    assert "but stage 1 takes float32[8, 16, 31]" in result.stderr, result.stderr
    assert "note: the pipeline cannot start" not in result.stderr, "said once"


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("    raise RuntimeError('no shapes here')\n", "RuntimeError: no shapes here"),
        ("    return {1: 42}\n", "expected TensorSpec(s), got 42"),
    ],
    ids=["raises", "returns-no-boundaries"],
)
def test_a_failing_boundaries_function_is_named_on_every_rank(
    tmp_path: Path, body: str, said: str
) -> None:
    """A model file's boundaries() that raises or returns no boundaries: one error naming
    each rank, the step and the function, exit 1, no traceback."""
    model = tmp_path / "gpt_bad_boundaries.py"
    model.write_text(
        "import runpy\n"
        f"gpt = runpy.run_path({str(ROOT / 'examples' / 'gpt.py')!r})\n"
        "build_stages, make_batch, loss_fn = gpt['build_stages'], gpt['make_batch'], "
        "gpt['loss_fn']\n"
        "def boundaries(example):\n" + body
    )
    result = pipecc("run", "1f1b", "--nproc", "2", "-M", "4", "--model", str(model))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for rank in (0, 1):
        line = f"rank {rank}: step 0: the boundaries function failed on a sample microbatch"
        assert f"{line} int64[8, 16]: " in result.stderr, result.stderr
    assert said in result.stderr, result.stderr


def test_an_error_inside_an_instruction_names_rank_step_and_instruction(tmp_path: Path) -> None:
    """A pipecc error raised while an instruction runs (here: a loss that is not a scalar)
    names the rank, the step and the instruction, as any other exception there does."""
    model = tmp_path / "gpt_vector_loss.py"
    model.write_text(
        "import runpy\n"
        f"gpt = runpy.run_path({str(ROOT / 'examples' / 'gpt.py')!r})\n"
        "build_stages, make_batch = gpt['build_stages'], gpt['make_batch']\n"
        "def loss_fn(logits, targets):\n"
        "    return logits.sum(dim=(1, 2))\n"
    )
    result = pipecc("run", "1f1b", "--nproc", "2", "-M", "4", "--model", str(model))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    first = result.stderr.splitlines()[0]
    said = r"the loss function must return a scalar tensor, got a tensor of shape \[8\]$"
    assert re.match(r"error: rank 1, step 0: instruction \d+ \(F0\.0\): " + said, first), first


def test_explicit_boundaries_without_stage_0_still_check_stage_0(tmp_path: Path) -> None:
    """boundaries() may leave out stage 0's input (the step's inputs): right specs run and
    check; a wrong spec of stage 1 is found before the first step, on every rank, from stage
    0's output (it failed at the first send, with a closed connection on the peer)."""
    model = tmp_path / "gpt_specs.py"
    model.write_text(
        "import runpy, torch\n"
        f"gpt = runpy.run_path({str(ROOT / 'examples' / 'gpt.py')!r})\n"
        "build_stages, make_batch = gpt['build_stages'], gpt['make_batch']\n"
        "loss_fn = gpt['loss_fn']\n"
        "def boundaries(example):\n"
        "    rows, seq = example.shape\n"
        "    return {1: [((rows, seq, 32), torch.float32)]}\n"
    )
    result = pipecc("run", "1f1b", "--nproc", "2", "-M", "4", "--model", str(model), "--check")
    assert result.returncode == 0, result.stderr
    model.write_text(model.read_text().replace("seq, 32)", "seq, 31)"))
    result = pipecc("run", "1f1b", "--nproc", "2", "-M", "4", "--model", str(model))
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "error: the pipeline cannot start:",
        "  rank 0: chunk 0 (stage 0 of pipe 0) returns float32[8, 16, 32] for input "
        "int64[8, 16], but stage 1 takes (float32[8, 16, 31],)",
    ], result.stderr


def test_a_model_file_that_fails_to_load_shows_its_own_frames(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the model file at import: exit 2, the error, then the traceback from the
    file's first frame on (none of pipecc's or runpy's), down to the failing line."""
    model = tmp_path / "broken.py"
    model.write_text("def helper():\n    return {}['missing']\n\n\nVALUE = helper()\n")
    code, _, err = run_inline(capsys, monkeypatch, "run", "1f1b", "--nproc", "2", "-M", "2",
                              "--model", str(model))  # fmt: skip
    assert code == 2
    lines = err.splitlines()
    assert lines[0] == f"error: {model}: the model file fails to load: KeyError: 'missing'"
    assert lines[1] == "Traceback (most recent call last):"
    files = [line for line in lines if line.startswith("  File ")]
    assert files == [f'  File "{model}", line 5, in <module>',
                     f'  File "{model}", line 2, in helper'], err  # fmt: skip


def test_profile_with_recompute_measures_what_f_keeps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A recomputed stage's F keeps only its input: its act_bytes drop (examples/mlp.py at its
    default width, 1F1B: 8192 -> 2048 on stage 0), and the recomputed activations of one
    backward are its workspace_B; recomputing selected modules keeps an amount between."""
    found = {}
    for mode in ("none", "name=1", "full"):
        path = tmp_path / f"{mode}.toml"
        args = ["run", "1f1b", "--nproc", "2", "-M", "4", "--model", MLP, "--recompute", mode]
        code, _, err = run_inline(capsys, monkeypatch, *args, "--steps", "2",
                                  "--allow-noisy-profile", "--profile", str(path))  # fmt: skip
        assert code == 0, err
        found[mode] = tomllib.loads(path.read_text())["cost"]["stage"]
    for stage in ("0", "1"):
        none, full = found["none"][stage], found["full"][stage]
        assert full["act_bytes"] < none["act_bytes"], (stage, none, full)
        assert full["workspace_B"] > none["workspace_B"], (stage, none, full)
        # the second block of each stage (Linear, GELU) recomputed: its Linear's output
        # (GELU's saved input) is dropped, the rest kept
        some = found["name=1"][stage]
        assert full["act_bytes"] < some["act_bytes"] < none["act_bytes"], (stage, some)
        assert some["workspace_B"] > none["workspace_B"], (stage, none, some)
