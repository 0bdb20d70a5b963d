"""The runtime on a device mesh (docs/parallelism.md): PP=2 × dp_replicate=2, PP=2 × tp=2 and
PP=2 × dp_shard=2 (FSDP2) on 4 gloo processes, one process group for every case
(mesh_cases.py). The GPT with tied embeddings on 1F1B, ZB-H1, ZBV and DualPipeV: loss and
every gradient within 1e-5 of one process training the whole batch, and 3 AdamW steps with
clipping matching; with a sequence-parallel tp plan (DTensor boundaries) within 1e-6;
untied on FSDP stages, also on interleaved 1F1B, within 1e-6, with the
split backward both by contract and by the graph walk, and no all-gather or reduce-scatter
but the program's; `pipecc run --mesh` with --check."""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli
from mesh_cases import MeshCase, run_mesh_cases
from moe_cases import (
    MOE_DP,
    MOE_FSDP,
    MOE_SCHEDULES,
    MoECase,
    moe_cases,
    moe_dp_program,
    reductions,
)
from pipecc.runtime.tools.spawn import spawn
from runtime_cases import compile_case

from pipecc.driver.mesh import MeshOptions, place_mesh
from pipecc.ir.ops import StageAction, StageOp
from pipecc.ir.program import Program
from pipecc.passes.insert_fsdp_actions import FsdpPolicy
from pipecc.passes.sum_shared import sum_shared

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("1f1b", "zb_h1", "zbv", "dualpipev")
TRAINING = ("zb_h1", "dualpipev")


DIMS = ("dp_replicate", "tp")
# FSDP2 stages (runtime/engine/stage_actions.py), full and split backwards; the split ones
# also by the graph walk (its weights are FSDP's unsharded parameters, not the module's
# sharded ones the runtime was given)
FSDP_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
FSDP_WALK = ("zb_h1", "dualpipev")
FSDP_TRAINING = ("1f1b", "zb_h1", "dualpipev")
# the tied embedding on FSDP stages: summed across ranks (1F1B, ZB-H1: stages 0 and 1 on two
# ranks) and on one rank (ZBV: stages 0 and 3 on rank 0, two sharded copies)
FSDP_TIED = ("1f1b", "zb_h1", "zbv")


def _program(name: str, dim: str, tied: bool = True) -> Program:
    program = compile_case(name, 2, 4)
    if dim != "dp_shard" or tied:  # the tied GPT: its sum placed (FSDP untied but for some)
        last = program.placement.num_stages(0) - 1
        program = sum_shared(program, shared=((0, last),))
    return place_mesh(program, MeshOptions(f"{dim}=2"))


def _unreduced() -> Program:
    """1F1B on FSDP stages without its REDUCE_GRADs: the gradients would stay unreduced."""
    program = _program("1f1b", "dp_shard", False)
    ranks = tuple(
        tuple(op for op in ops
              if not (isinstance(op, StageOp) and op.kind is StageAction.REDUCE_GRAD))
        for ops in program.ranks
    )  # fmt: skip
    return dataclasses.replace(program, ranks=ranks)


def _resident() -> Program:
    """ZBV with one stage unsharded at a time (--max-active-stages 1): each rank's two
    stages are gathered and freed again between their uses, RESHARDs between an F and its I
    or W (7 and 13 UNSHARDs per rank and step, not 2)."""
    program = compile_case("zbv", 2, 4)
    policy = FsdpPolicy(max_active_stages=1)
    return place_mesh(program, MeshOptions("dp_shard=2", policy=policy))


@functools.cache
def _cases() -> list[MeshCase | MoECase]:
    found = [MeshCase(f"{dim}-{n}", _program(n, dim), dim) for dim in DIMS for n in SCHEDULES]
    found += [
        MeshCase(f"dp_shard-{n}", _program(n, "dp_shard", False), "dp_shard")
        for n in FSDP_SCHEDULES
    ]
    found += [
        MeshCase(f"dp_shard-walk-{n}", _program(n, "dp_shard", False), "dp_shard", walk=True)
        for n in FSDP_WALK
    ]
    found += [
        MeshCase(
            f"train-dp_shard-{n}",
            _program(n, "dp_shard", False),
            "dp_shard",
            True,
            walk=n == "zb_h1",
        )
        for n in FSDP_TRAINING
    ]
    found.append(MeshCase("dp_shard-unreduced", _unreduced(), "dp_shard"))
    found.append(MeshCase("dp_shard-resident-zbv", _resident(), "dp_shard", walk=True))
    found += [
        MeshCase(f"dp_shard-tied-{n}", _program(n, "dp_shard"), "dp_shard", tied=True)
        for n in FSDP_TIED
    ]
    found.append(
        MeshCase(
            "train-dp_shard-tied-zbv", _program("zbv", "dp_shard"), "dp_shard", True, tied=True
        )
    )
    found += [MeshCase(f"sp-{n}", _program(n, "tp"), "tp", sp=True) for n in SCHEDULES]
    found.append(MeshCase("sp-walk-zb_h1", _program("zb_h1", "tp"), "tp", walk=True, sp=True))
    found.append(MeshCase("sp-no-mesh", _program("1f1b", "tp"), "tp", sp=True, no_mesh=True))
    found.append(MeshCase("sp-recompute-zb_h1", _program("zb_h1", "tp"), "tp", sp=True,
                          recompute=True))  # fmt: skip
    found.append(MeshCase("sp-partial", _program("1f1b", "tp"), "tp", sp=True, partial=True))
    found.append(MeshCase("train-sp-zb_h1", _program("zb_h1", "tp"), "tp", True, sp=True))
    found += moe_cases()
    return found + [
        MeshCase(f"train-{dim}-{n}", _program(n, dim), dim, True) for dim in DIMS for n in TRAINING
    ]


CHECKPOINTED = ("dp_replicate", "tp", "dp_shard")  # plain replicas, tp and FSDP2 DTensors


def _checkpoint_cases(folder: Path) -> list[MeshCase]:
    return [
        MeshCase(
            f"ckpt-{dim}", _program("1f1b", dim), dim, True, tied=True, folder=str(folder / dim)
        )  # fmt: skip
        for dim in CHECKPOINTED
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cases = _cases() + _checkpoint_cases(tmp_path_factory.mktemp("checkpoints"))
    return spawn(run_mesh_cases, 4, cases, timeout=300.0)  # type: ignore[no-any-return]


def _each(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    found = [r[name] for r in results]
    for result in found:
        assert "error" not in result, result
    return found


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", SCHEDULES)
def test_the_mesh_matches_one_process_on_the_whole_batch(
    results: list[dict[str, Any]], name: str, dim: str
) -> None:
    for result in _each(results, f"{dim}-{name}"):
        assert result["grad_rel"] <= 1e-5, result["grad_rel"]
        got, want = result["loss"]
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", TRAINING)
def test_adamw_steps_match(results: list[dict[str, Any]], name: str, dim: str) -> None:
    for result in _each(results, f"train-{dim}-{name}"):
        assert result["weight_rel"] <= 1e-5, result["weight_rel"]
        for got, want in (*result["losses"], *result["norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_pipecc_run_on_a_mesh_checks_against_the_whole_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`pipecc run --mesh dp_replicate=2 --nproc 4`: pp = 2, each replica its share of the
    batch, every rank's gradients against one process on the whole batch."""
    code, out, err = run_cli(
        capsys, "run", "zb_h1", "-M", "2", "--nproc", "4", "--mesh", "dp_replicate=2",
        "--model", str(ROOT / "examples" / "gpt.py"), "--check", "--json",
    )  # fmt: skip
    assert code == 0, err
    fields = json.loads(out)
    assert fields["mesh"] == "pp=2,dp_replicate=2" and fields["ranks"] == 2
    assert fields["max_rel_grad_diff"] <= 1e-5
    assert abs(fields["loss"] - fields["reference_loss"]) <= 1e-5 * fields["reference_loss"]


def test_pipecc_run_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(ROOT / "examples" / "gpt.py")
    for mesh, nproc, message in (
        ("cp=2", "4", "cp (context parallel) is compiled, verified and simulated"),
        ("pp=2,dp_replicate=2", "2", "the mesh has 4 processes, not --nproc 2"),
        ("dp_replicate=3", "4", "--nproc 4 is not a multiple of 3"),
    ):
        code, _, err = run_cli(
            capsys, "run", "1f1b", "-M", "2", "--nproc", nproc, "--mesh", mesh, "--model", model
        )
        assert code == 2 and message in err, err


def _fsdp_collectives_are_the_programs(result: dict[str, Any]) -> None:
    """Every step's all-gathers and reduce-scatters are the program's UNSHARDs and
    REDUCE_GRADs on this rank (one parameter group per stage): a backward neither
    reduce-scatters nor frees the gathered parameters by itself (before the runtime set
    FSDP's flags: 4 of each per step on 1F1B at M=4, not 1)."""
    for counts in result["collectives"]:
        assert counts == result["actions"], (counts, result["actions"])


@pytest.mark.parametrize("name", FSDP_SCHEDULES)
def test_fsdp_stages_match_one_process_on_the_whole_batch(
    results: list[dict[str, Any]], name: str
) -> None:
    """PP=2 × dp_shard=2, untied GPT: loss and every (gathered) gradient within 1e-6."""
    for result in _each(results, f"dp_shard-{name}"):
        assert result["grad_rel"] <= 1e-6, result["grad_rel"]
        got, want = result["loss"]
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
        _fsdp_collectives_are_the_programs(result)


@pytest.mark.parametrize("name", FSDP_WALK)
def test_fsdp_stages_split_by_the_graph_walk_match(
    results: list[dict[str, Any]], name: str
) -> None:
    """The graph walk's W on FSDP stages: its weights are the unsharded parameters FSDP
    computes with (taking the module's sharded ones gave no weight gradient: rel 1.0)."""
    for result in _each(results, f"dp_shard-walk-{name}"):
        assert result["grad_rel"] <= 1e-6, result["grad_rel"]
        _fsdp_collectives_are_the_programs(result)


@pytest.mark.parametrize("name", FSDP_TRAINING)
def test_fsdp_adamw_steps_match(results: list[dict[str, Any]], name: str) -> None:
    for result in _each(results, f"train-dp_shard-{name}"):
        assert result["weight_rel"] <= 1e-5, result["weight_rel"]
        for got, want in (*result["losses"], *result["norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)
        _fsdp_collectives_are_the_programs(result)


def test_fsdp_stages_without_their_reduction_are_refused(results: list[dict[str, Any]]) -> None:
    for result in (r["dp_shard-unreduced"] for r in results):
        assert result.get("error") == "SetupError", result
        assert "the program has no REDUCE_GRAD for it" in result["message"], result


@pytest.mark.parametrize("name", FSDP_TIED)
def test_tied_weights_on_fsdp_stages_match(results: list[dict[str, Any]], name: str) -> None:
    """The tied embedding's sharded copies summed shard by shard after their reduce-scatters
    (before: refused, the sum flattened whole DTensors)."""
    for result in _each(results, f"dp_shard-tied-{name}"):
        assert result["grad_rel"] <= 1e-6, result["grad_rel"]
        got, want = result["loss"]
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
        _fsdp_collectives_are_the_programs(result)
    for result in _each(results, "train-dp_shard-tied-zbv"):
        assert result["weight_rel"] <= 1e-5, result["weight_rel"]
        for got, want in (*result["losses"], *result["norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_fsdp_stages_freed_between_uses_match(results: list[dict[str, Any]]) -> None:
    """The residency policy at work (K=1) under the graph walk's split backward: the
    gradients W adds while its stage is resharded reach the reduction."""
    for result in _each(results, "dp_shard-resident-zbv"):
        unshards, reductions = result["actions"]
        assert unshards > 2 and reductions == 2, result["actions"]  # gathered again
        assert result["grad_rel"] <= 1e-6, result["grad_rel"]
        _fsdp_collectives_are_the_programs(result)


@pytest.mark.parametrize("name", (*SCHEDULES, "walk-zb_h1", "recompute-zb_h1"))
def test_dtensor_boundaries_match_one_process(results: list[dict[str, Any]], name: str) -> None:
    """PP=2 × tp=2 with examples/gpt.py's sequence-parallel plan: every stage boundary is a
    DTensor sharded along the tokens, sent as its local shard and rebuilt on the next stage;
    loss and every gathered gradient within 1e-6 (before: the receive buffers had the global
    shape, and nothing rebuilt the DTensor the next stage's blocks need)."""
    for result in _each(results, f"sp-{name}"):
        assert result["boundaries"], result  # the case crosses DTensor boundaries
        for text in result["boundaries"]:
            assert text.startswith("float32[2, 4, 16] of a DTensor(tp: S(1); global [2, 8, 16]")
        assert result["grad_rel"] <= 1e-6, result["grad_rel"]
        for got, want in (result["loss"], result["eval_loss"]):
            assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def test_adamw_steps_over_dtensor_boundaries_match(results: list[dict[str, Any]]) -> None:
    """3 AdamW steps with clipping on ZB-H1 with the sequence-parallel plan (the norm covers
    the LayerNorms' replicated DTensor parameters once): weights within 1e-5 (measured
    2.1e-6), losses and norms within 1e-5."""
    for result in _each(results, "train-sp-zb_h1"):
        assert result["weight_rel"] <= 1e-5, result["weight_rel"]
        for got, want in (*result["losses"], *result["norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_dtensor_boundaries_without_the_mesh_are_refused(results: list[dict[str, Any]]) -> None:
    """A pipeline given by its group, not the mesh, cannot rebuild a DTensor boundary: every
    rank stops before the first step, naming the stage and the leaf."""
    for result in (r["sp-no-mesh"] for r in results):
        assert result.get("error") == "SetupError", result
        assert "tensor 0 of stage 0's output is a DTensor(tp: S(1)" in result["message"], result
        assert "needs the device mesh, RuntimeConfig(mesh=...)" in result["message"], result


def test_partial_dtensor_boundaries_are_refused(results: list[dict[str, Any]]) -> None:
    """A stage returning an unreduced sum (a Partial DTensor) stops every rank before the
    first step, naming the stage and the leaf: one rank's addend would travel as the value."""
    for result in (r["sp-partial"] for r in results):
        assert result.get("error") in ("SetupError", "InstructionError"), result
        message = result["message"]
        assert "stage 0's forward on microbatch 0 failed" in message, result
        assert (
            "leaf 0: a DTensor with placement P(sum) at a stage boundary is not supported"
            in message
        ), result


MOE_RECOMPUTED = [f"recompute-{m}-{n}" for n in ("zbv", "dualpipev") for m in ("full", "mixer")]


@pytest.mark.parametrize("name", [*MOE_SCHEDULES, "sequential-dualpipev", *MOE_RECOMPUTED])
def test_expert_parallel_stages_match_one_process(results: list[dict[str, Any]], name: str) -> None:
    """PP=2 x EP=2 (examples/moe_ep.py): the program's MoE phases and all-to-alls, fused
    F&B interleaved (or in sequence), split backward on ZBV, duplicated stages on DualPipe,
    the stages recomputed in full or their dense sublayers (`mixer`) selectively:
    the loss and every gradient within 1e-5 of one process on the whole batch; each EP rank
    holds and compares its own half of every block's experts, by name."""
    found = _each(results, f"moe-{name}")
    for result in found:
        assert result["grad_rel"] <= 1e-5, result["grad_rel"]
        got, want = result["loss"]
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
        assert result["added"] > 0
    held = [set(result["experts"]) for result in found]
    assert held[0] == held[2] and held[1] == held[3] and not held[0] & held[1]
    assert {n.split(".experts.")[1].split(".")[0] for n in held[0] | held[1]} == set("0123")


@pytest.mark.parametrize("name", MOE_RECOMPUTED)
def test_recomputed_expert_parallel_stages_run_their_phases_again(
    results: list[dict[str, Any]], name: str
) -> None:
    """Every phase of a stage recomputed in full runs again before its backward (the
    experts on the rows received, the dense sublayers); selected sublayers alone run again."""
    plain = _each(results, "moe-" + name.rsplit("-", 1)[1])
    for result, once in zip(_each(results, f"moe-{name}"), plain, strict=True):
        assert result["mixer_calls"] > once["mixer_calls"], (result, once)
        got = {k: sorted(v) for k, v in result["received"].items()}
        want = {k: sorted(v + v if "-full-" in name else v) for k, v in once["received"].items()}
        assert got == want, (got, want)


@pytest.mark.parametrize("name", MOE_FSDP)
def test_moe_phases_on_fsdp_stages_match_one_process(
    results: list[dict[str, Any]], name: str
) -> None:
    """MoE stages under FSDP2 on dp_shard (PP=2 x dp_shard=2, every expert on each rank):
    the phases run on the parameters the program's UNSHARD gathered, REDUCE_GRAD reduces;
    the loss and every (gathered) gradient within 1e-5 of one process."""
    for result in _each(results, f"moe-fsdp-{name}"):
        assert result["grad_rel"] <= 1e-5, result["grad_rel"]
        got, want = result["loss"]
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)


@pytest.mark.parametrize("dim", MOE_DP)
def test_expert_parallel_with_data_parallel_matches_one_process(
    results: list[dict[str, Any]], dim: str
) -> None:
    """EP borrowed from data parallelism (pp=1 x <dim>=2 x ep=2, 1F1B): the program's
    reductions are FSDP2's reduce_scatter over dp_shard, then the dense parameters' over
    dp_replicate x ep and the experts' over dp_replicate; each rank holds its EP rank's
    experts (FSDP2-sharded over dp_shard: half of their elements), the same along `dim`;
    the loss and every gathered gradient within 1e-5 of one process on the whole batch.
    (Before: the dense parameters went with the last reduction naming their stage, the
    experts' one over dp_replicate alone: grad rel 2.4 on dp_replicate.)"""
    want = {
        "dp_shard": [("REDUCE_GRAD", ()), ("all_reduce dp-grad dense s0", ("ep",))],
        "dp_replicate": [("all_reduce dp-grad dense s0", ("dp_replicate", "ep")),
                         ("all_reduce dp-grad experts s0", ("dp_replicate",))],
    }[dim]  # fmt: skip
    assert reductions(moe_dp_program(dim)) == want
    found = _each(results, f"moe-{dim}-ep")
    for result in found:
        assert result["grad_rel"] <= 1e-5, result["grad_rel"]
        got, want_loss = result["loss"]
        assert abs(got - want_loss) <= 1e-5 * abs(want_loss), (got, want_loss)
        assert result["expert_share"] == (0.5 if dim == "dp_shard" else 1.0)
        carried = result["carried"]  # [dense reduced, experts reduced or scaled]
        dense, experts = carried["dp-grad dense s0"]
        assert dense > 0 and experts == 16, carried  # 2 blocks x 2 experts x 4 tensors
        assert carried.get("dp-grad experts s0", [0, 16]) == [0, 16], carried
        if dim == "dp_shard":  # FSDP2's only collectives: the program's UNSHARD, REDUCE_GRAD
            assert result["collectives"] == [1, 1], result["collectives"]
    held = [set(result["experts"]) for result in found]  # global rank g: ep = g % 2
    assert held[0] == held[2] and held[1] == held[3] and not held[0] & held[1]
    assert {n.split(".experts.")[1].split(".")[0] for n in held[0] | held[1]} == set("0123")


def test_fsdp_before_the_experts_are_kept_is_refused(results: list[dict[str, Any]]) -> None:
    """`fully_shard` on a MoE stage still holding every EP rank's experts: FSDP would gather
    and reduce them all every step; every rank stops before the first, naming the fix."""
    for rank, result in enumerate(r["moe-fsdp-before-ep"] for r in results):
        assert result.get("error") == "SetupError", result
        assert (
            f"stage 0 is under FSDP2 (fully_shard) with the experts of every EP rank: keep "
            f"EP rank {rank % 2}'s experts first, pipecc.runtime.keep_experts(modules, mesh)"
            in result["message"]
        ), result


def test_expert_ranks_without_tokens_take_part(results: list[dict[str, Any]]) -> None:
    """Layer 1 of every stage routes nothing to experts 2 and 3: EP rank 1 (global ranks 1
    and 3) runs its experts on zero rows there, in every all-to-all, and the run matches."""
    for rank, result in enumerate(_each(results, "moe-dualpipev")):
        for where, rows in result["received"].items():
            if where.endswith(".1"):
                assert rows and (max(rows) == 0) == (rank % 2 == 1), (rank, where, rows)


def test_an_expert_parallel_forward_only_step_matches(results: list[dict[str, Any]]) -> None:
    for result in _each(results, "moe-forward-dualpipev"):
        got, want = result["eval_loss"]
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_pipecc_run_checks_an_expert_parallel_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`pipecc run dualpipev --mesh pp=2,ep=2` on examples/moe_ep.py (no --moe: the model
    file's MoE blocks are placed, as --moe 2 would): the program split into MoE phases,
    each EP rank its experts and share of the batch, every gradient (each expert's by
    name) against one process on the whole batch. Profiled: every stage's
    phases add up to its F, I and B, its all-to-alls give `a2a`, its experts `moe_experts`,
    and `simulate` reads the file back."""
    profile = tmp_path / "moe.toml"
    code, out, err = run_cli(
        capsys, "run", "dualpipev", "-M", "8", "--nproc", "4", "--mesh", "pp=2,ep=2",
        "--model", str(ROOT / "examples" / "moe_ep.py"), "--check", "--json",
        "--profile", str(profile), "--steps", "2", "--warmup", "0", "--allow-noisy-profile",
    )  # fmt: skip
    assert code == 0, err
    assert "note: --moe from the model file: MoE layers by stage 2, 2, 2, 2" in err
    fields = json.loads(out)
    assert fields["mesh"] == "pp=2,ep=2" and fields["max_rel_grad_diff"] <= 1e-5
    assert abs(fields["loss"] - fields["reference_loss"]) <= 1e-5 * fields["reference_loss"]
    assert fields["aux_loss"] > 0
    costs = tomllib.loads(profile.read_text())["cost"]
    for stage in range(4):
        table = costs["stage"][str(stage)]
        assert all(table[key] > 0 for key in ("F", "B", "I", "W", "a2a")), table
        assert 0 < table["moe_experts"] < 1 and "moe_layers" not in table
        assert set(fields["profile_moe"][str(stage)]) >= {"F_experts", "I_pre", "a2a_exposed"}
    again = ("simulate", "dualpipev", "-P", "2", "-M", "8", "--mesh", "pp=2,ep=2", "--moe", "2")
    code, out, err = run_cli(capsys, *again, "--cost-file", str(profile), "--backend", "gloo")
    assert code == 0 and f"a2a={costs['a2a']:g}" in out, err


def test_moe_stages_with_fewer_blocks_than_the_program_are_refused(
    results: list[dict[str, Any]],
) -> None:
    """Every rank names its stages whose blocks are not the program's MoE layers, before any
    all-to-all (no rank is left waiting in one)."""
    for result in (r["moe-short"] for r in results):
        assert result == {
            "error": "SetupError",
            "message": "error: the pipeline cannot start:\n"
            + "\n".join(
                f"  rank {r}: stage {s} runs in 2 MoE layer(s), but its module has 1 moe_blocks"
                for r, s in ((0, 0), (0, 3), (1, 1), (1, 2))
            ),
        }


@pytest.mark.parametrize("dim", CHECKPOINTED)
def test_a_checkpoint_of_a_mesh_resumes_bitwise(results: list[dict[str, Any]], dim: str) -> None:
    """Replicas, tensor-parallel and FSDP2 stages (their parameters and AdamW states saved
    and read as shards): the resumed steps' losses are the uninterrupted run's."""
    for result in _each(results, f"ckpt-{dim}"):
        assert result["resumed"] == result["losses"], result
        assert result["sharded"] == (dim != "dp_replicate")


def test_a_moe_model_without_the_programs_phases_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --moe 0 the program `pipecc run` verified holds no all-to-all: the MoE stages run
    whole would leave each EP rank's experts unreduced over ep (a wrong gradient), and
    splitting them after the verification would run what the verifier never saw, so the
    run is refused (exit 2) before any process starts."""
    code, _, err = run_cli(
        capsys, "run", "dualpipev", "-M", "8", "--nproc", "4", "--mesh", "pp=2,ep=2",
        "--moe", "0", "--model", str(ROOT / "examples" / "moe_ep.py"),
    )  # fmt: skip
    assert code == 2, err
    assert "stage 0 (2), stage 1 (2), stage 2 (2), stage 3 (2); leave --moe out" in err
