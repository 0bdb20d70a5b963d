"""The verifier on MoE programs (issue 33 part 2, docs/verify.md): the expert-parallel
all-to-alls are checked as every collective, on the whole mesh `compile --expand` writes and
`verify` reads back (a hand edit that swaps two of them on one rank, or skips one, is
rejected with a witness), and an op's phases count as the op only all together and in order."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import SCHEDULES, compile_bundled, run_cli

from pipecc.driver.mesh import MeshOptions, MoeOptions, place_mesh, place_moe, whole_mesh
from pipecc.interop import json_program
from pipecc.ir.mesh import parse_mesh
from pipecc.ir.ops import Collective, CollectiveKind, Phase, PhasePart, Wait
from pipecc.ir.program import Program
from pipecc.passes.splice import splice
from pipecc.verify import ALL_MODELS, Options, verify

SIZES = ("-P", "2", "-M", "2", "--mesh", "pp=2,ep=2", "--moe", "1")
WARMUP = "\n   14 | phase warmup   {{ repeat warmup {{ F }} }}\n      |" + " " * 34 + "^"
MISMATCH = (
    "{loc}error[mismatch]: collectives over ranks 0, 1: the 1st is all_to_all dispatch L0 "
    "F0.0 over ranks 0, 1 on rank 0 (@1) but all_to_all combine L0 F0.0 over ranks 0, 1 on "
    "rank 1 (@{at}); the k-th collective of one set of ranks meets the k-th of every member, so "
    "they exchange the wrong data or hang inside the library" + WARMUP + "\n{loc}note: rank 1 "
    "issues its 1st one here" + WARMUP
)


def _whole(name: str = "1f1b", k: int = 1, overlap: bool = True, m: int = 2) -> Program:
    options = MeshOptions("pp=2,ep=2", moe=MoeOptions(k, overlap=overlap))
    return whole_mesh(place_moe(place_mesh(compile_bundled(name, 2, m), options), options))[0]


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev"])
@pytest.mark.parametrize("overlap", [True, False])
def test_moe_programs_verify_under_every_comm_model(name: str, overlap: bool) -> None:
    report = verify(_whole(name, 2, overlap, m=4), Options(models=ALL_MODELS))
    assert report.ok, report.violations


def test_the_expanded_program_round_trips_and_verifies(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "whole.json"
    code, _, err = run_cli(capsys, "compile", "1f1b", *SIZES, "--expand", "-o", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["ranks"] == 4 and data["mesh"] == {"pp": 2, "ep": 2} and data["moe"] == [1, 1]
    a2a = [e for e in data["programs"][1] if e.get("kind") == "all_to_all"]
    assert a2a[0] == {
        "op": "collective",
        "kind": "all_to_all",
        "ranks": [0, 1],
        "what": "dispatch L0 F0.0",
        "stages": [0],
        "line": 14,
        "col": 34,
    }
    code, text, _ = run_cli(capsys, "verify", str(out), "--comm", "all")
    assert code == 0 and "on 4 ranks" in text


def test_two_all_to_alls_swapped_on_one_rank_are_a_mismatch_with_a_witness(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "whole.json"
    assert run_cli(capsys, "compile", "1f1b", *SIZES, "--expand", "-o", str(out))[0] == 0
    data = json.loads(out.read_text())
    rank = data["programs"][1]
    first, second = [i for i, e in enumerate(rank) if e.get("kind") == "all_to_all"][:2]
    rank[first], rank[second] = rank[second], rank[first]
    out.write_text(json.dumps(data))
    code, _, _ = run_cli(capsys, "verify", str(out))
    assert code == 1
    report = verify(json_program.loads(out.read_text()))
    loc = f"{SCHEDULES}/1f1b.sched:14:34: "
    assert [str(v) for v in report.violations] == [
        MISMATCH.format(loc=loc, at=1),
        f"{loc}error[coverage]: rank 1: F0.2:experts0 @2 needs the all-to-all 'dispatch L0 "
        "F0.0' after F0.2:pre0 @0, completed before it: no such all-to-all" + WARMUP.format(),
    ]


def test_a_rank_skipping_an_all_to_all_another_posts_is_rejected() -> None:
    program = _whole()
    skipped = next(x for x in program.ranks[1] if type(x) is Collective)
    ranks = list(program.ranks)
    ranks[1] = splice(program.ranks[1], drop=lambda x: x is skipped)
    edited = json_program.loads(json_program.dumps(replace(program, ranks=tuple(ranks))))
    report = verify(edited, Options(models=ALL_MODELS))
    loc = f"{SCHEDULES}/1f1b.sched:14:34: "
    assert str(report.violations[0]) == MISMATCH.format(loc=loc, at=2)
    assert {v.status.value for v in report.verdicts} == {"deadlock"}


def _edited(drop: bool) -> Program:
    program = _whole()
    ranks = list(program.ranks)
    experts = next(x for x in ranks[2] if type(x) is Phase and x.part is PhasePart.EXPERTS)
    if drop:
        ranks[2] = splice(ranks[2], drop=lambda x: x is experts)
    else:  # experts0 and post swapped
        r = list(ranks[2])
        i = r.index(experts)
        r[i], r[i + 2] = r[i + 2], r[i]
        ranks[2] = tuple(r)
    return replace(program, ranks=tuple(ranks))


@pytest.mark.parametrize(
    ("drop", "phases"),
    [
        (True, "F0.0:pre0 @3, F0.0:post @6"),
        (False, "F0.0:pre0 @3, F0.0:post @5, F0.0:experts0 @7"),
    ],
)
def test_an_op_with_a_phase_missing_or_out_of_order_is_not_covered(drop: bool, phases: str) -> None:
    report = verify(_edited(drop))
    messages = [str(v) for v in report.violations if v.code == "coverage"]
    assert messages[0].splitlines()[0] == (
        f"{SCHEDULES}/1f1b.sched:15:38: error[coverage]: rank 2: F0.0 (stage 1 mb 0) runs "
        f"the phases {phases}; a stage of 1 "
        "MoE layer runs F0.0:pre0, F0.0:experts0, F0.0:post, each once and in this order, so "
        "the op is not covered as a whole"
    )


def test_phases_keep_the_activation_peak_of_their_ops() -> None:
    options = MeshOptions("pp=2,ep=2")
    plain = whole_mesh(place_mesh(compile_bundled("dualpipev", 2, 8), options))[0]
    assert [p.peak for p in verify(_whole("dualpipev", 2, m=8)).peaks] == [
        p.peak for p in verify(plain).peaks
    ]


def test_an_all_to_all_dropped_on_every_member_or_not_waited_is_reported() -> None:
    """Removed from the whole EP group alike, the collectives still match: the phases'
    check sees that the experts would run on tokens that never arrived."""
    program = _whole(overlap=True)
    ranks = list(program.ranks)
    for r in (2, 3):  # pipeline rank 1 of both pipelines: its first forward's dispatch
        dispatch = next(x for x in ranks[r] if type(x) is Collective)
        ranks[r] = splice(ranks[r], drop=lambda x, d=dispatch: x is d)
    report = verify(replace(program, ranks=tuple(ranks)))
    assert [str(v).split(": ", 1)[1].splitlines()[0] for v in report.violations] == [
        "error[coverage]: rank 2: F0.0:experts0 @4 needs the all-to-all 'dispatch L0 F0.0' "
        "after F0.0:pre0 @3, completed before it: no such all-to-all",
        "error[coverage]: rank 3: F0.2:experts0 @4 needs the all-to-all 'dispatch L0 F0.0' "
        "after F0.2:pre0 @3, completed before it: no such all-to-all",
    ]


def test_an_async_all_to_all_not_waited_before_its_consumer_is_reported() -> None:
    options = MeshOptions("pp=2,ep=2", moe=MoeOptions(1))
    program = whole_mesh(
        place_moe(place_mesh(compile_bundled("dualpipev", 2, 4), options), options)
    )[0]
    ranks = list(program.ranks)
    for r in (0, 1):  # the first wait on an all-to-all of pipeline rank 0, on both members
        wait = next(
            x for x in ranks[r] if type(x) is Wait and type(ranks[r][x.ops[0]]) is Collective
        )
        ranks[r] = splice(ranks[r], drop=lambda x, w=wait: x is w)
    report = verify(replace(program, ranks=tuple(ranks)))
    found = [str(v).split(": ", 1)[1].splitlines()[0] for v in report.violations]
    assert found[-2:] == [
        "error[coverage]: rank 0: B1.1:experts0 @43 needs the all-to-all 'combine-grad L0 B1.1' "
        "after B1.1:post @39, completed before it: @40 is not waited before it",
        "error[coverage]: rank 1: B1.5:experts0 @43 needs the all-to-all 'combine-grad L0 B1.1' "
        "after B1.5:post @39, completed before it: @40 is not waited before it",
    ]
    assert [v.code for v in report.violations[:2]] == ["unwaited", "unwaited"]


@pytest.mark.parametrize("mesh", ["pp=2,dp_shard=2,ep=2", "pp=2,dp_replicate=2,dp_shard=2,ep=2"])
def test_ep_with_fsdp_verifies_and_reduces_dense_and_experts_over_their_dims(
    capsys: pytest.CaptureFixture[str], mesh: str
) -> None:
    """EP composed with FSDP2 (and replicas), DualPipeV with 2 MoE layers a stage, 8 and 16
    ranks, no process: `verify` and `simulate` pass, and on the whole mesh every stage's
    gradients are reduce-scattered over its dp_shard group, then its dense parameters'
    all-reduced over its dp_replicate × ep group and its experts' over its dp_replicate
    group alone (none without replicas: each expert lives on one EP rank)."""
    flags = ("-P", "2", "-M", "8", "--mesh", mesh, "--moe", "2")
    for command in ("verify", "simulate"):
        code, _, err = run_cli(capsys, command, "dualpipev", *flags)
        assert code == 0, err
    options = MeshOptions(mesh, moe=MoeOptions(2))
    program = place_moe(place_mesh(compile_bundled("dualpipev", 2, 8), options), options)
    whole = whole_mesh(program)[0]
    assert verify(whole, Options(models=ALL_MODELS)).ok
    layout = parse_mesh(mesh)
    for rank, instrs in enumerate(whole.ranks):
        groups = {
            "reduce-grad": layout.group(rank, ("dp_shard",)),
            "dp-grad dense": layout.group(rank, ("dp_replicate", "ep")),
            "dp-grad experts": layout.group(rank, ("dp_replicate",)),
        }
        wanted = ["reduce-grad", "dp-grad dense"]
        wanted += ["dp-grad experts"] if layout.dp_replicate > 1 else []
        stages = {x.stages[0] for x in instrs if type(x) is Collective and x.what.startswith("dp")}
        assert len(stages) == 2  # two stages a rank, on the V
        for stage in stages:
            found = [
                (x.what.rsplit(" ", 1)[0], x.ranks)
                for x in instrs
                if type(x) is Collective
                and x.kind is not CollectiveKind.ALL_TO_ALL
                and x.stages == (stage,)
                and not x.what.startswith("unshard")
            ]
            assert found == [(what, groups[what]) for what in wanted], (rank, stage, found)
