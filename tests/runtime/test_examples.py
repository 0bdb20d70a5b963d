"""examples/train_gpt.py and train_loader.py under torchrun: AdamW on the pipelined GPT, the loss
logged; checkpoints saved and resumed; data loaded where it is needed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def test_train_gpt_trains_under_torchrun() -> None:
    result = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "train_gpt.py",
         "--schedule", "dualpipe", "--microbatches", "4", "--tied", "--steps", "6", "--lr", "1e-2"],
        cwd=ROOT / "examples", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", result.stdout, re.M)]
    assert len(losses) == 6, result.stdout
    assert losses[0] < 4.3, "GPT-2's init: the first loss is near ln(vocab) = 4.16"
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True)), losses
    assert losses[-1] < 0.9 * losses[0], losses


def test_train_moe_checks_against_the_whole_model_after_training() -> None:
    """Each rank trains only its stages; check_against at the first and the last step still
    equals the whole model (it takes the stages' current weights), and the logged loss is
    the cross-entropy plus the balancing losses added in the stages."""
    result = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "train_moe.py",
         "--schedule", "zbv", "--microbatches", "4", "--steps", "3"],
        cwd=ROOT / "examples", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    checks = re.findall(r"^check against the whole model: (\S+)", result.stdout, re.M)
    assert checks == ["ok", "ok"], result.stdout
    steps = re.findall(r"^step +\d+ +loss ([\d.]+) = cross-entropy ([\d.]+) \+ balancing ([\d.]+)",
                       result.stdout, re.M)  # fmt: skip
    assert len(steps) == 3, result.stdout
    for total, main, added in steps:
        assert float(added) > 0.1
        assert abs(float(total) - float(main) - float(added)) < 2e-5


def test_train_gpt_on_a_mesh_trains_under_torchrun() -> None:
    """`--pp 2 --dp-shard 2 --tied` on 4 processes (gloo): ZBV's split backward on FSDP2
    stages with the tied embedding's sharded copies summed; the first step's loss equals one
    process on the whole batch (--check) and the loss goes down."""
    result = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "4", "train_gpt.py",
         "--schedule", "zbv", "--pp", "2", "--dp-shard", "2", "--tied", "--microbatches", "4",
         "--steps", "5", "--lr", "1e-2", "--check"],
        cwd=ROOT / "examples", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"^check: step 0 loss [\d.]+, one process on the whole batch [\d.]+: ok$",
                     result.stdout, re.M), result.stdout  # fmt: skip
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", result.stdout, re.M)]
    assert len(losses) == 5, result.stdout
    assert losses[0] < 4.3, "GPT-2's init: the first loss is near ln(vocab) = 4.16"
    assert losses[-1] < 0.95 * losses[0], losses


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", script, *args],
        cwd=ROOT / "examples", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _lines(stdout: str) -> list[str]:
    """The loss and gradient norm of each logged step (its time, throughput and memory cut)."""
    return [re.sub(r"  +[\d.]+ ms .*$", "", line) for line in stdout.splitlines() if "loss" in line]


def test_train_gpt_resumes_from_its_checkpoint_bitwise(tmp_path: Path) -> None:
    """--save-every 2 then --resume step_2, with dropout: the resumed steps log the same
    loss and gradient norm, digit for digit, as the run that went on."""
    common = ["--schedule", "zbv", "--microbatches", "4", "--tied", "--dropout", "0.1",
              "--steps", "4"]  # fmt: skip
    first = _torchrun("train_gpt.py", *common, "--save-every", "2", "--save-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert f"saved {tmp_path / 'step_2'}" in first.stdout
    second = _torchrun("train_gpt.py", *common, "--resume", str(tmp_path / "step_2"))
    assert second.returncode == 0, second.stderr
    assert f"resumed from {tmp_path / 'step_2'} at step 2" in second.stdout
    assert _lines(second.stdout) == _lines(first.stdout)[2:], (first.stdout, second.stdout)


def test_train_loader_loads_only_where_needed() -> None:
    """DualPipeV: rank 0 loads, rank 1 loads nothing and gets each step's changing shapes
    from rank 0; the loss goes down."""
    result = _torchrun("train_loader.py", "--schedule", "dualpipev", "--vary")
    assert result.returncode == 0, result.stderr
    assert "rank 1: needs_inputs False, needs_targets False: loads nothing" in result.stdout
    seqs = re.findall(r"^step \d+  loss [\d.]+  seq (\d+)$", result.stdout, re.M)
    assert seqs == ["16", "12", "8", "16", "12", "8"], result.stdout
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", result.stdout)]
    assert losses[-1] < 0.95 * losses[0], losses


def test_train_gpt_resumes_into_another_schedule_p_and_cut(tmp_path: Path) -> None:
    """Saved by ZB-V on 2 ranks (4 stages of one block), resumed by ZB-H1 on 4 ranks (4
    stages, other placement) and by 1F1B on 2 (2 stages of two blocks): by parameter name,
    the same losses (as printed, 5 decimals) and gradient norms."""
    common = ["--microbatches", "4", "--tied", "--layers", "4", "--steps", "4"]
    first = _torchrun("train_gpt.py", "--schedule", "zbv", *common, "--save-every", "2",
                      "--save-dir", str(tmp_path))  # fmt: skip
    assert first.returncode == 0, first.stderr
    want = _numbers(first.stdout)[2:]
    four = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "4", "train_gpt.py", "--schedule",
         "zb_h1", *common, "--resume", str(tmp_path / "step_2")],
        cwd=ROOT / "examples", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    two = _torchrun("train_gpt.py", "--schedule", "1f1b", *common, "--resume",
                    str(tmp_path / "step_2"))  # fmt: skip
    for done in (four, two):
        assert done.returncode == 0, done.stderr
        got = _numbers(done.stdout)
        assert len(got) == len(want) == 2, done.stdout
        for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
            assert abs(loss - want_loss) <= 2e-5 and abs(norm - want_norm) <= 2e-4


def _numbers(stdout: str) -> list[tuple[float, float]]:
    found = re.findall(r"^step +\d+ +loss ([\d.]+) +grad norm ([\d.]+)", stdout, re.M)
    return [(float(loss), float(norm)) for loss, norm in found]
