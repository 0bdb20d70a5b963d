"""`pipecc run` puts the gradient sum of every tie of its model file in the program it
verifies: the class, not the case. For every bundled schedule at P=2 and P=4 on both
backends, for a .json compiled before collectives, torch CSVs with and without comm cells,
each way of placing the comm ops and a mesh, the program `pipecc run` would execute (its
resolution with the model file's ties: no process starts) verifies, and no set of ranks
holding one parameter lacks its sum (`unplaced_sums`, what every rank checks when its
runtime is built). The ties are found as the command finds them: a model file's `shared()`
without building, `build_stages`' `Parameter` identity on the meta device.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pipecc.runtime.comm.shared import GradientSums, ParamGrads, local_groups, unplaced_sums
from pipecc.runtime.tools.ties import model_ties
from runtime_cases import SCHEDULES, compile_case, microbatch_counts

from pipecc.cli import build_parser
from pipecc.commands import run as run_command
from pipecc.commands import run_model
from pipecc.commands.common import lowering
from pipecc.driver.check import Resolution, verify_source
from pipecc.driver.load import RunBackend, read_source
from pipecc.interop import json_program, torch_csv
from pipecc.ir.ops import Collective
from pipecc.ir.program import Program
from pipecc.verify import Options

ROOT = Path(__file__).resolve().parents[2]
TIED_STAGES = str(Path(__file__).with_name("tied_stages.py"))
GPT = str(ROOT / "examples" / "gpt.py")
REAL_ONLY = str(Path(__file__).with_name("tied_real_only.py"))


def _verified(path: str, args: tuple[str, ...], backend: RunBackend) -> run_command.Verified:
    """What `pipecc run PATH ARGS --model tied_stages.py` runs on `backend`, verified."""
    parsed = build_parser().parse_args(["run", path, "--model", TIED_STAGES, *args])
    model = functools.partial(run_model.from_model, parsed, model_ties, _no_moe)
    return run_command.program_to_run(parsed, lambda ranks: backend.value, model)


def _no_moe(path: str, stages: int) -> tuple[int, ...]:
    return (0,) * stages


def _tie(program: Program) -> list[tuple[tuple[int, str], ...]]:
    """tied_stages.py's declared tie: the first stage's embedding is the last's head."""
    return [((0, "embed.weight"), (program.placement.num_stages(0) - 1, "head.weight"))]


def _no_sums(program: Program) -> Program:
    """The program as compiled before collectives existed: its sums taken out."""
    ranks = tuple(tuple(i for i in rank if type(i) is not Collective) for rank in program.ranks)
    return replace(program, ranks=ranks)


@pytest.fixture(autouse=True)
def _declared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPECC_TIED_DECLARED", "1")  # tied_stages.py declares its tie


@pytest.mark.parametrize("backend", list(RunBackend))
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_run_on_a_tied_model_verifies_with_all_its_sums(
    name: str, backend: RunBackend
) -> None:
    for ranks in (2, 4):
        microbatches = microbatch_counts(name, ranks)[0]
        sizes = ("--nproc", str(ranks), "-M", str(microbatches))
        verified = _verified(name, sizes, backend)
        program = verified.resolved.program
        assert verified.ok, (name, ranks)
        assert unplaced_sums(program, _tie(program), required=True) == [], (name, ranks)


INPUTS = {
    "json-before-collectives": lambda: json_program.dumps(_no_sums(compile_case("dualpipe", 2, 4))),
    "csv": lambda: torch_csv.dumps(compile_case("zb_h1", 2, 4)),
    "csv-comms": lambda: torch_csv.dumps(compile_case("zb_h1", 2, 4), with_comms=True),
}
FLAGS = {
    "none": (),
    "default": ("--comm-policy", "default"),
    "align": ("--align", "--cost", "F=1,B=2,I=1,W=1,comm=0.25"),
    "mesh": ("--mesh", "dp_replicate=2", "--nproc", "4"),
}


@pytest.mark.parametrize("flag", sorted(FLAGS))
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_every_input_and_placement_run_on_a_tied_model_gets_its_sums(
    kind: str, flag: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{kind}.{'csv' if kind.startswith('csv') else 'json'}"
    path.write_text(INPUTS[kind]())
    for backend in RunBackend:
        program = _verified(str(path), FLAGS[flag], backend).resolved.program
        assert unplaced_sums(program, _tie(program), required=True) == [], (kind, flag)
        sums = {op.what for rank in program.ranks for op in rank if type(op) is Collective}
        assert "grad-sum s0+s1" in sums, sums


def test_the_run_says_which_ties_it_placed(capsys: pytest.CaptureFixture[str]) -> None:
    program = _verified("1f1b", ("--nproc", "2", "-M", "4"), RunBackend.GLOO).resolved.program
    sums = [(op.what, op.ranks) for op in program.ranks[0] if type(op) is Collective]
    assert sums == [("grad-sum s0+s1", (0, 1))]
    assert capsys.readouterr().err == (
        f"note: {TIED_STAGES}: stages 0+1 hold one parameter (tied weights): resolved as with "
        "--shared 0+1, so the program holds the gradient sum of each one held on two or more "
        "ranks\n"
    )


@pytest.mark.parametrize("backend", list(RunBackend))
def test_verify_with_shared_proves_the_program_run_executes(backend: RunBackend) -> None:
    """`pipecc verify X --backend B --shared 0+S` checks byte for byte the program `pipecc
    run X` runs on B for a model file tying stages 0 and S (its note says so)."""
    for name, ranks in (("zb_h1", 2), ("interleaved_1f1b", 4), ("dualpipe", 4)):
        microbatches = microbatch_counts(name, ranks)[0]
        sizes = ("--nproc", str(ranks), "-M", str(microbatches))
        ran = _verified(name, sizes, backend).resolved.program
        last = ran.placement.num_stages(0) - 1
        flags = ["-P", str(ranks), "-M", str(microbatches), "--backend", backend.value]
        args = build_parser().parse_args(["verify", name, *flags, "--shared", f"0+{last}"])
        resolution = Resolution(backend, lowering(args, backend))
        source = read_source(name, ranks=ranks, microbatches=microbatches)
        _, resolved = verify_source(source, Options(models=(backend.comm_model,)), resolution)
        assert resolved is not None and resolved.program == ran, (name, ranks)


def test_ties_are_found_without_building_or_on_the_meta_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert model_ties(TIED_STAGES, 4, None) == ((0, 3),)  # shared(): nothing built
    monkeypatch.setenv("PIPECC_TIED_DECLARED", "0")
    assert model_ties(TIED_STAGES, 4, None) == ()
    monkeypatch.setenv("PIPECC_GPT_TIED", "1")  # build_stages: one Parameter in two stages
    assert model_ties(GPT, 4, None) == ((0, 3),)
    monkeypatch.setenv("PIPECC_GPT_TIED", "0")
    assert model_ties(GPT, 4, None) == ()
    # a model that cannot be built on the meta device: its ties are left to the ranks
    assert model_ties(REAL_ONLY, 2, None) == ()


def test_unplaced_sums_name_each_set_of_holders_and_what_places_it() -> None:
    plain = compile_case("1f1b", 2, 4)  # no collective: the library keeps the path after it
    tie = [((0, "embed.weight"), (1, "head.weight"))]
    assert unplaced_sums(plain, tie, required=False) == []
    assert unplaced_sums(plain, tie, required=True) == [
        "stages 0+1 hold one parameter on ranks 0, 1, but the program sums no gradients over "
        "ranks 0, 1: compile it with --shared 0+1 (pipecc run --shared 0+1 places it too)"
    ]
    old = _no_sums(compile_case("dualpipe", 2, 4))  # each stage held twice, no sum
    assert unplaced_sums(old, (), required=True) == [
        "stage(s) 0+1 are held by ranks 0, 1, but the program sums no gradients over ranks "
        "0, 1: compile it again with pipecc compile, which places the sum of every stage held "
        "twice"
    ]
    assert unplaced_sums(compile_case("dualpipe", 2, 4), (), required=True) == []


def test_a_ranks_own_copies_are_added_after_a_program_that_places_other_sums() -> None:
    """Two objects of one parameter on one rank (a tie built apart, both stages on it) are
    added after the program, exchanging nothing, also when the program places the sums of
    other parameters: those alone run at the program's collectives."""
    program = compile_case("dualpipe", 2, 4)  # places the sum over ranks 0 and 1
    lone = ((0,), torch.float32)
    both = ((0, 1), torch.float32)
    sums = GradientSums(program, 0, {lone: [], both: []}, ParamGrads(), device=torch.device("cpu"))
    assert not sums.outside
    assert list(sums.after_program()) == [lone]
    outside = GradientSums(
        _no_sums(program), 0, {lone: [], both: []}, ParamGrads(), device=torch.device("cpu")
    )
    assert list(outside.after_program()) == [lone, both]


def test_a_chain_of_ties_is_one_parameter_summed_over_all_its_holders() -> None:
    """A with B and B with C is one parameter: the runtime's groups merge the chain as the
    compiler's one sum over all their holders does (before, stage 0's key kept only (A, B),
    so its bucket's holders missed stage 2's rank and the sum did not match the program)."""
    program = compile_case("1f1b", 3, 3)
    chain = [((0, "weight"), (1, "weight")), ((1, "weight"), (2, "weight"))]
    modules = {0: torch.nn.Linear(2, 2, bias=False)}
    (group,) = local_groups(program.placement, 0, modules, chain)
    assert group.keys == ((0, "weight"), (1, "weight"), (2, "weight"))
    assert group.ranks == (0, 1, 2)
