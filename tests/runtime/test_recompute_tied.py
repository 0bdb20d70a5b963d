"""Recomputation with shared parameters: the GPT with its embedding tied to its head (held
by the first and last stage), dropout on, full and selective recomputation, `--check`
against single-process training (the shared gradient summed across its holders, the
recomputed forwards drawing the same masks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")


@pytest.mark.parametrize(("schedule", "mode"), [("zbv", "full"), ("dualpipe", "attn")])
def test_recomputed_stages_with_a_tied_embedding_match_the_reference(
    schedule: str, mode: str
) -> None:
    env = dict(os.environ, PIPECC_GPT_TIED="1", PIPECC_GPT_DROPOUT="0.2")
    result = subprocess.run(
        [PIPECC, "run", schedule, "--nproc", "2", "-M", "4", "--model",
         str(ROOT / "examples" / "gpt.py"), "--recompute", mode, "--check"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(tolerance 1e-05): ok" in result.stdout, result.stdout
