"""The MoE phases `pipecc run` splits a program into (runtime/tools/moe_program.py), as the
contract of issue 33 writes them (pipecc/passes/expand_moe.py), and the forward-only plan the
runtime takes from them (runtime/plan/plan.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pipecc.runtime import MoEBlock, MoEStage
from pipecc.runtime.engine.moe_ops import stage_problems, unsplit_problems
from pipecc.runtime.plan.plan import forward_only, mailbox
from pipecc.runtime.tools import moe_program
from pipecc.runtime.tools.moe_program import refuse_unsplit
from runtime_cases import compile_case
from torch import nn

from pipecc.diagnostics import InputError
from pipecc.driver.mesh import MeshOptions, MoeOptions, place_mesh, place_moe
from pipecc.ir.ops import Collective, CollectiveKind, Fused, Instr, Kind, Phase, Wait
from pipecc.ir.printer import describe
from pipecc.ir.program import Program

A2A = CollectiveKind.ALL_TO_ALL
ROOT = Path(__file__).resolve().parents[2]


def _split(name: str, layers: int, microbatches: int = 8, overlap: bool = True) -> Program:
    options = MeshOptions("ep=2", moe=MoeOptions(layers, overlap=overlap))
    return place_moe(place_mesh(compile_case(name, 2, microbatches), options), options)


def _a2a(instrs: tuple[Instr, ...]) -> list[Collective]:
    return [x for x in instrs if type(x) is Collective and x.kind is A2A]


def _short(instr: Instr) -> str:
    if type(instr) is Collective and instr.kind is A2A:
        return instr.what + (" async" if instr.asynchronous else "")
    return "wait" if type(instr) is Wait else describe(instr)


def test_dualpipev_with_two_moe_layers_has_128_all_to_alls_per_rank() -> None:
    program = _split("dualpipev", 2)
    assert [len(_a2a(instrs)) for instrs in program.ranks] == [128, 128]
    assert program.moe == (2, 2, 2, 2)


def test_a_fused_op_is_dualpipes_interleave_and_a_plain_op_its_phases_in_turn() -> None:
    program = _split("dualpipev", 1)
    instrs = program.ranks[0]
    fused = compile_case("dualpipev", 2, 8).ranks[0]
    first = next(x for x in fused if type(x) is Fused)
    f, b = first.forward.label(), first.backward.label()
    start = next(i for i, x in enumerate(instrs) if type(x) is Phase and x.op == first.backward)
    assert [_short(x) for x in instrs[start : start + 14]] == [
        f"{b}:post", f"combine-grad L0 {b} async", f"{f}:pre0", "wait",
        f"dispatch L0 {f} async", f"{b}:experts0", "wait", f"dispatch-grad L0 {b} async",
        f"{f}:experts0", "wait", f"combine L0 {f} async", f"{b}:pre0", "wait", f"{f}:post",
    ]  # fmt: skip
    assert [_short(x) for x in instrs[:6]][1:] == [
        "dispatch L0 F0.0",
        "F0.0:experts0",
        "combine L0 F0.0",
        "F0.0:post",
        "send act pipe 0 stage 1 mb 0 to rank 1",
    ]


def test_every_async_all_to_all_is_waited_once_after_it_is_posted() -> None:
    for name in ("dualpipev", "dualpipe", "zbv"):
        for instrs in _split(name, 2).ranks:
            waited = [i for x in instrs if type(x) is Wait for i in x.ops]
            posted = [i for i, x in enumerate(instrs) if type(x) is Collective and x.asynchronous]
            assert sorted(i for i in waited if i in set(posted)) == posted
            for index, x in enumerate(instrs):
                if type(x) is Wait:
                    assert all(i < index for i in x.ops)


def test_the_sequential_form_blocks_and_the_dense_gradients_are_reduced_over_ep() -> None:
    program = _split("dualpipev", 2, overlap=False)
    for rank, instrs in enumerate(program.ranks):
        assert not any(x.asynchronous for x in _a2a(instrs))
        reduced = [x for x in instrs if type(x) is Collective and x.kind is not A2A]
        # the dense gradients reduced over ep (the experts' are each on one EP rank)
        assert {(x.what, x.dims) for x in reduced[-2:]} == {
            (f"dp-grad dense s{s}", ("ep",)) for s in (rank, 3 - rank)
        }


def test_the_forward_only_plan_keeps_the_forward_phases_and_their_all_to_alls() -> None:
    instrs = _split("zbv", 2).ranks[1]
    kept = [x for _, x in forward_only(instrs)]
    phases = [x for x in kept if type(x) is Phase]
    assert phases and all(x.op.kind is Kind.F for x in phases)
    assert {x.what.split()[0] for x in _a2a(tuple(kept))} == {"dispatch", "combine"}
    assert len(phases) == 5 * sum(
        1 for x in instrs if type(x) is Phase and x.op.kind is Kind.F and x.is_last
    )
    assert mailbox(instrs)  # every phase's op has its messages' slots


def test_a_stage_run_in_phases_must_be_a_moe_stage() -> None:
    instrs = _split("1f1b", 2).ranks[1]
    stage: Any = SimpleNamespace(chunks={0: SimpleNamespace(module=nn.Linear(2, 2))})
    assert stage_problems(instrs, stage) == [
        "stage 1 runs in MoE phases, but its module (Linear) has no moe_blocks "
        "(docs/runtime.md, MoE stages in phases)"
    ]


def test_without_moe_layers_an_ep_rank_is_a_plain_replica() -> None:
    """A model without MoE stages on ep: no phase, each stage's gradients reduced over ep."""
    split = place_mesh(compile_case("1f1b", 2, 4), MeshOptions("ep=2"))
    assert split.moe is None and not any(type(x) is Phase for r in split.ranks for x in r)
    assert [[(x.what, x.dims) for x in r if type(x) is Collective] for r in split.ranks] == [
        [("dp-grad s0", ("ep",))],
        [("dp-grad s1", ("ep",))],
    ]


class _Mesh:
    """A stand-in DeviceMesh with an `ep` dimension of `size`."""

    def __init__(self, size: int) -> None:
        self.mesh_dim_names = ("pp", "ep")
        self.size = size

    def __getitem__(self, name: str) -> Any:
        return SimpleNamespace(size=lambda: self.size)


def _moe_stage(blocks: int) -> nn.Module:
    return MoEStage(None, [MoEBlock(4, 8, 2, 1) for _ in range(blocks)], None)


def test_moe_blocks_run_without_phases_on_an_ep_mesh_are_refused() -> None:
    """Run whole on ep > 1, an EP rank's experts would see its own tokens only and their
    gradients would not be reduced over ep: a wrong gradient, refused at set-up (each chunk
    named); with its phases, with ep = 1, or without MoE blocks, nothing to say."""
    plain = place_mesh(compile_case("1f1b", 2, 4), MeshOptions("ep=2")).ranks[0]
    assert unsplit_problems(plain, {0: _moe_stage(2)}, _Mesh(2)) == [
        "chunk 0 holds 2 MoE block(s) and the program runs it without MoE phases on a mesh "
        "with ep=2: compile it with --moe K (pipecc run places the model file's layers; "
        "docs/parallelism.md)"
    ]
    assert unsplit_problems(_split("1f1b", 2).ranks[0], {0: _moe_stage(2)}, _Mesh(2)) == []
    assert unsplit_problems(plain, {0: _moe_stage(2)}, _Mesh(1)) == []
    assert unsplit_problems(plain, {0: nn.Linear(2, 2)}, _Mesh(2)) == []
    assert unsplit_problems(plain, {0: _moe_stage(2)}, None) == []


def test_pipecc_run_refuses_a_program_that_leaves_moe_stages_unsplit() -> None:
    """The launcher's check before any process starts: every stage holding MoE blocks must
    be split in the program (--moe 0 leaves them whole), per stage."""
    mesh = SimpleNamespace(ep=2)
    plain = place_mesh(compile_case("1f1b", 2, 4), MeshOptions("ep=2"))
    with pytest.raises(InputError, match=r"stage 0 \(2\), stage 1 \(2\); leave --moe out"):
        refuse_unsplit(plain, mesh, (2, 2), "moe.py")
    refuse_unsplit(_split("1f1b", 2), mesh, (2, 2), "moe.py")  # split: runs
    refuse_unsplit(plain, SimpleNamespace(ep=1), (2, 2), "moe.py")  # no ep: a replica
    refuse_unsplit(plain, mesh, (0, 0), "moe.py")  # no MoE blocks


def test_the_launcher_counts_moe_blocks_on_the_meta_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pipecc run` counts a model file's MoE blocks in its own process without building the
    model for real (a rank builds only its own stages): the stages it counts hold meta
    tensors."""
    built: list[nn.Module] = []
    original = moe_program.moe_layers

    def counting(stages: Any) -> tuple[int, ...]:
        built.extend(stages)
        return original(stages)

    monkeypatch.setattr(moe_program, "moe_layers", counting)
    assert moe_program.moe_layers_of(str(ROOT / "examples" / "moe_ep.py"), 4) == (2, 2, 2, 2)
    assert built and all(p.is_meta for stage in built for p in stage.parameters())
