"""On NCCL pipecc proves what its runtime runs: every point-to-point op of a rank through one
`batch_isend_irecv` on the group's communicator (runtime/comm/channel.py), so one stream per
rank, the `nccl-single` model. `verify --backend nccl`, `pipecc run` on NCCL, `--align` for
NCCL and `search --backend nccl` use it; every bundled schedule passes it at P 2..16, default
and aligned, and the single-stream example, which passes per-peer `nccl`, is refused.
"""

from __future__ import annotations

import argparse

import pytest
from helpers import run_cli

from pipecc.api import bundled_schedules
from pipecc.cli import build_parser
from pipecc.commands import run as run_command
from pipecc.commands import search
from pipecc.commands.common import comm_model, lowering
from pipecc.diagnostics import ProgramError, RequirementError
from pipecc.driver.compile import Alignment, Lowering
from pipecc.driver.load import Request, RunBackend, resolve
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel
from pipecc.verify import Options, verify

NCCL = RunBackend.NCCL
CYCLE = "docs/examples/verify/single_stream_cycle.sched"
MLP = "examples/mlp.py"


def test_nccl_means_one_stream_per_rank() -> None:
    assert NCCL.comm_model is CommModel.NCCL_SINGLE
    assert RunBackend.GLOO.comm_model is CommModel.RENDEZVOUS
    assert search.BACKEND_PLACING["nccl"].model is CommModel.NCCL_SINGLE
    assert Alignment(CostModel()).model is CommModel.NCCL_SINGLE


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_align_places_for_the_backends_model(backend: str) -> None:
    """`--align` without --comm aligns for the model the backend's runtime follows; --comm
    nccl (per-peer streams) stays a model one may ask for."""
    parser = build_parser()
    args = parser.parse_args(
        ["verify", "zb_h1", "-P", "2", "-M", "4", "--align", "--backend", backend]
    )
    align = lowering(args, RunBackend(backend)).align
    assert align is not None and align.model is RunBackend(backend).comm_model
    assert comm_model(args) is RunBackend(backend).comm_model
    asked = parser.parse_args(["verify", "zb_h1", "--align", "--comm", "nccl"])
    assert comm_model(asked) is CommModel.NCCL


def _aligned() -> Lowering:
    """`--align` with default costs, on nccl (commands/common.py `lowering`)."""
    return Lowering(align=Alignment(CostModel(), NCCL.comm_model))


# M per schedule: the smallest its `require` lines admit at every P (dualpipe: M >= 2P and
# even, P even; dualpipev: M >= 2P; zb_h2: M >= 2P - 1; the others: any M, or M % rounds == 0
# with one round at M = P)
MICROBATCHES = {"dualpipe": (2, 0), "dualpipev": (2, 0), "zb_h2": (2, -1)}


def test_every_bundled_schedule_passes_nccl_single_at_p_2_to_16() -> None:
    """Default and aligned programs, as `verify --backend nccl [--align]` resolves them, at
    every P from 2 to 16 (DualPipe's `require` refuses odd P): no process."""
    refused, failed = [], []
    for name in bundled_schedules():
        times, plus = MICROBATCHES.get(name, (1, 0))
        for ranks in range(2, 17):
            for placed in (Lowering(), _aligned()):
                request = Request(name, ranks, times * ranks + plus, backend=NCCL, lowering=placed)
                try:
                    program = resolve(request).program
                except RequirementError:
                    refused.append((name, ranks))
                    continue
                report = verify(program, Options(models=(NCCL.comm_model,)))
                if not report.ok:
                    failed.append((name, ranks, placed.align is not None, report.counts()))
    assert failed == []
    assert sorted(set(refused)) == [("dualpipe", p) for p in range(3, 17, 2)]


def test_the_single_stream_cycle_is_refused_on_nccl(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "verify", CYCLE, "-P", "3", "-M", "2", "--backend", "nccl")
    assert code == 1
    assert out.splitlines()[-2] == (
        f"{CYCLE} P=3 M=2: 1 violation(s) (deadlock 1); nccl-single deadlock"
    )
    code, out, _ = run_cli(capsys, "verify", CYCLE, "-P", "3", "-M", "2", "--comm", "nccl")
    assert code == 0
    assert out.splitlines()[0] == f"{CYCLE} P=3 M=2: ok (86 instructions on 3 ranks; nccl passes)"


def test_run_on_nccl_verifies_under_nccl_single_and_refuses_the_cycle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args: argparse.Namespace = build_parser().parse_args(
        ["run", CYCLE, "--nproc", "3", "-M", "2", "--model", MLP]
    )
    with pytest.raises(ProgramError) as err:
        run_command.program_to_run(args, lambda ranks: "nccl")
    assert str(err.value) == (
        f"error: {CYCLE} P=3 M=2: refused: it fails verification under nccl-single (nccl), as "
        "reported above; --unverified runs it anyway"
    )
    assert "deadlock under nccl-single" in capsys.readouterr().err
    verified = run_command.program_to_run(args, lambda ranks: "gloo")
    assert verified.ok and verified.model == "rendezvous (gloo)"
