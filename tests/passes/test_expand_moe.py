"""MoE stages in the program (issue 33, docs/parallelism.md "Expert parallelism"): each F, B and
I of a MoE stage split into phases with an all_to_all over ep for every dispatch and combine,
DualPipe's interleave in a fused F&B, the sequential form, and the dense gradients' reduction
over ep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import compile_bundled, run_cli

from pipecc.driver.mesh import MeshOptions, MoeOptions, place_mesh, place_moe, whole_mesh
from pipecc.interop import json_program
from pipecc.ir.ops import Collective, CollectiveKind, Compute, Fused, Kind, Phase, Wait
from pipecc.ir.printer import describe
from pipecc.ir.program import Program
from pipecc.passes.expand_moe import all_to_alls, expand_moe
from pipecc.verify import verify


def _moe(name: str, p: int, m: int, mesh: str, k: int, *, overlap: bool = True) -> Program:
    options = MeshOptions(mesh, moe=MoeOptions(k, overlap=overlap))
    return place_moe(place_mesh(compile_bundled(name, p, m), options), options)


def test_dualpipev_p2_m8_with_two_moe_layers_has_128_all_to_alls_per_pipeline_rank(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "moe.json"
    flags = ("-P", "2", "-M", "8", "--mesh", "pp=2,ep=2", "--moe", "2", "-o", str(out))
    code, _, err = run_cli(capsys, "compile", "dualpipev", *flags)
    assert code == 0, err
    program = json_program.loads(out.read_text())
    # 2 stages × 8 microbatches × (F + its backward) × 2 layers × (dispatch + combine)
    assert all_to_alls(program) == [128, 128]
    assert program.moe == (2, 2, 2, 2) and program.num_ranks == 2
    a2a = [
        x for x in program.ranks[0] if isinstance(x, Collective) and x.kind.value == "all_to_all"
    ]
    assert all(x.dims == ("ep",) and x.ranks == (0,) and len(x.stages) == 1 for x in a2a)
    assert len({x.what for x in a2a}) == 128  # each names its layer, direction and microbatch
    text = out.read_text()
    assert json_program.dumps(json_program.loads(text)) == text  # phases, a2a's, "moe"


def test_a_plain_forward_and_backward_run_their_phases_with_blocking_all_to_alls() -> None:
    program = _moe("1f1b", 2, 2, "pp=2,ep=2", 2)
    rank = [describe(x) for x in program.ranks[1] if not isinstance(x, Wait)]
    start = rank.index("F0.0:pre0")
    assert rank[start : start + 9] == [
        "F0.0:pre0",
        "all_to_all dispatch L0 F0.0 over pipeline rank 1 × ep",
        "F0.0:experts0",
        "all_to_all combine L0 F0.0 over pipeline rank 1 × ep",
        "F0.0:pre1",
        "all_to_all dispatch L1 F0.0 over pipeline rank 1 × ep",
        "F0.0:experts1",
        "all_to_all combine L1 F0.0 over pipeline rank 1 × ep",
        "F0.0:post",
    ]
    start = rank.index("B0.0:post")
    assert rank[start : start + 9] == [
        "B0.0:post",
        "all_to_all combine-grad L1 B0.0 over pipeline rank 1 × ep",
        "B0.0:experts1",
        "all_to_all dispatch-grad L1 B0.0 over pipeline rank 1 × ep",
        "B0.0:pre1",
        "all_to_all combine-grad L0 B0.0 over pipeline rank 1 × ep",
        "B0.0:experts0",
        "all_to_all dispatch-grad L0 B0.0 over pipeline rank 1 × ep",
        "B0.0:pre0",
    ]


def _fields(program: Program) -> dict[str, object]:
    return {name: getattr(program, name) for name in program.__dataclass_fields__}


def test_a_fused_forward_and_backward_interleave_as_dualpipe() -> None:
    f, b = Compute(Kind.F, 0, 0, 0, 1), Compute(Kind.B, 0, 0, 0, 0)
    base = compile_bundled("1f1b", 1, 2)
    ranks = ((Compute(Kind.F, 0, 0, 0, 0), Fused(f, b), Compute(Kind.B, 0, 0, 0, 1)),)
    program = expand_moe(Program(**{**_fields(base), "ranks": ranks}), (1,))
    got = [describe(x) for x in program.ranks[0]]
    start = got.index("B0.0:post")
    assert got[start:] == [
        "B0.0:post",
        "all_to_all combine-grad L0 B0.0 over pipeline rank 0 × ep [async]",
        "F0.1:pre0",
        f"wait {start + 1}",
        "all_to_all dispatch L0 F0.1 over pipeline rank 0 × ep [async]",
        "B0.0:experts0",
        f"wait {start + 4}",
        "all_to_all dispatch-grad L0 B0.0 over pipeline rank 0 × ep [async]",
        "F0.1:experts0",
        f"wait {start + 7}",
        "all_to_all combine L0 F0.1 over pipeline rank 0 × ep [async]",
        "B0.0:pre0",
        f"wait {start + 10}",
        "F0.1:post",
        *got[start + 14 :],
    ]
    assert got[start + 14] == "B0.1:post"
    sequential = expand_moe(Program(**{**_fields(base), "ranks": ranks}), (1,), overlap=False)
    got = [describe(x) for x in sequential.ranks[0]]
    start = got.index("F0.1:pre0")
    assert got[start : start + 10] == [
        "F0.1:pre0",
        "all_to_all dispatch L0 F0.1 over pipeline rank 0 × ep",
        "F0.1:experts0",
        "all_to_all combine L0 F0.1 over pipeline rank 0 × ep",
        "F0.1:post",
        "B0.0:post",
        "all_to_all combine-grad L0 B0.0 over pipeline rank 0 × ep",
        "B0.0:experts0",
        "all_to_all dispatch-grad L0 B0.0 over pipeline rank 0 × ep",
        "B0.0:pre0",
    ]


def test_w_holds_no_all_to_all_and_split_backward_verifies() -> None:
    program = _moe("zbv", 2, 4, "pp=2,ep=2", 1)
    assert any(type(x) is Compute and x.kind is Kind.W for x in program.ranks[0])
    assert not any(type(x) is Phase and x.op.kind is Kind.W for r in program.ranks for x in r)
    at = [describe(x) for x in program.ranks[0]].index("I1.0:post")
    assert describe(program.ranks[0][at + 1]) == (
        "all_to_all combine-grad L0 B1.0 over pipeline rank 0 × ep"  # an I's are a B's
    )
    report = verify(place_mesh_whole(program))
    assert report.ok, report.violations


def place_mesh_whole(program: Program) -> Program:
    return whole_mesh(program)[0]


@pytest.mark.parametrize(
    ("mesh", "expected"),
    [
        ("pp=2,ep=2", [("dp-grad dense s0", ("ep",))]),
        (
            "pp=2,dp_replicate=2,ep=2",
            [
                ("dp-grad dense s0", ("dp_replicate", "ep")),
                ("dp-grad experts s0", ("dp_replicate",)),
            ],
        ),
        ("pp=2,dp_replicate=2", [("dp-grad s0", ("dp_replicate",))]),
    ],
)
def test_dense_gradients_are_reduced_over_ep_and_the_experts_not(
    mesh: str, expected: list[tuple[str, tuple[str, ...]]]
) -> None:
    program = _moe("1f1b", 2, 4, mesh, 1)
    found = [
        (x.what, x.dims)
        for x in program.ranks[0]
        if isinstance(x, Collective) and x.kind is CollectiveKind.ALL_REDUCE
    ]
    assert found == expected
    assert verify(place_mesh_whole(program)).ok


def test_ep_without_moe_reduces_every_gradient_over_ep() -> None:
    program = place_mesh(compile_bundled("1f1b", 2, 4), MeshOptions("pp=2,ep=2"))
    found = [(x.what, x.dims) for x in program.ranks[1] if isinstance(x, Collective)]
    assert found == [("dp-grad s1", ("ep",))]


def test_a_cost_files_moe_layers_override_moe_per_stage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    costs = tmp_path / "moe.toml"
    costs.write_text("[cost]\na2a = 0.1\n[cost.stage.1]\nmoe_layers = 0\n")
    out = tmp_path / "p.json"
    flags = ("-P", "2", "-M", "2", "--mesh", "pp=2,ep=2", "--moe", "2")
    code, _, err = run_cli(
        capsys, "compile", "1f1b", *flags, "--cost-file", str(costs), "-o", str(out)
    )
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["moe"] == [2, 0]
    assert all_to_alls(json_program.loads(out.read_text())) == [16, 0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--expand",), "error: --expand writes a program on a mesh for every rank: give --mesh\n"),
        (
            ("--moe-overlap", "off"),
            "error: --moe-overlap is for --moe K (the MoE layers of every stage)\n",
        ),
    ],
)
def test_moe_and_expand_flags_without_what_they_need_are_bad_input(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    code, out, err = run_cli(capsys, "compile", "1f1b", "-P", "2", "-M", "2", *flags)
    assert (code, out, err) == (2, "", message)
