"""Boundaries without a process group: pytrees, shape inference (real data, autocast, no
side effects), explicit specs, signatures from host metadata, the RNG derivation,
shared-parameter detection."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pipecc.runtime import TensorSpec, infer_boundaries, shared_parameters
from pipecc.runtime.boundaries.signatures import Signatures, signature_of
from pipecc.runtime.boundaries.specs import normalise_boundaries, run_stage
from pipecc.runtime.boundaries.trees import (
    Boundary,
    boundary_of,
    flatten,
    microbatch_boundary,
    split_tree,
)
from pipecc.runtime.engine.rng import ForwardRng, derive_seed
from torch import nn

from pipecc.diagnostics import InputError

F32, I64 = torch.float32, torch.int64


class Split(nn.Module):
    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(-1).to(torch.int64), x * 2


class ToDict(nn.Module):
    """Returns a dict with a mask, a detached float, None and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.linear(x)
        return {"h": h, "mask": h > 0, "plain": h.detach(), "none": None, "k": 3}


class DataDependent(nn.Module):
    """Dropout, running statistics and `.item()`: meta tracing fails on it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = int((x.abs() >= 0).sum().item()) // x.shape[1]  # all rows
        return self.drop(self.norm(x[:keep]))


def test_infer_boundaries_follows_pytrees_dtypes_and_gradients() -> None:
    found = infer_boundaries([nn.Linear(3, 5), ToDict(), nn.Identity()], torch.zeros(2, 3))
    assert found[0].tensors == (TensorSpec((2, 3), F32, False),)
    assert found[1].tensors == (TensorSpec((2, 5), F32, True),)
    leaves = found[2].leaves
    assert leaves == (
        TensorSpec((2, 5), F32, True), TensorSpec((2, 5), torch.bool, False),
        TensorSpec((2, 5), F32, False), None, 3,
    )  # fmt: skip
    assert found[2].grads == (TensorSpec((2, 5), F32, True),)
    value = found[2].rebuild(tuple(torch.zeros(s.shape, dtype=s.dtype) for s in found[2].tensors))
    assert set(value) == {"h", "mask", "plain", "none", "k"} and value["k"] == 3
    assert value["none"] is None
    tuples = infer_boundaries([nn.Linear(3, 5), Split()], torch.zeros(2, 3))
    assert tuples[2].tensors == (TensorSpec((2,), I64, False), TensorSpec((2, 5), F32, True))


@dataclasses.dataclass
class Output:
    """A model output that is not a pytree (as a user's own dataclass)."""

    logits: torch.Tensor


class ToOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> Output:
        return Output(x * 2)


def test_a_last_stage_may_return_what_only_the_loss_reads() -> None:
    found = infer_boundaries([nn.Linear(3, 5), ToOutput()], torch.zeros(2, 3))
    assert sorted(found) == [0, 1], "no entry for the model's output"
    assert found[1].tensors == (TensorSpec((2, 5), F32, True),)
    with pytest.raises(InputError, match="holds a Output"):  # between stages: refused
        infer_boundaries([ToOutput(), nn.Identity()], torch.zeros(2, 3))


def test_a_stage_run_leaves_the_module_and_the_rng_untouched() -> None:
    norm = nn.BatchNorm1d(4)
    x = torch.randn(3, 4)
    torch.manual_seed(3)
    expected = torch.rand(8)
    torch.manual_seed(3)
    run = run_stage(norm, x, torch.device("cpu"), seed=11)
    assert run.boundary.tensors == (TensorSpec((3, 4), F32, True),)
    assert not any(t.requires_grad for t in run.tensors), "the graph is dropped"
    assert int(norm.num_batches_tracked) == 0
    assert torch.equal(norm.running_mean, torch.zeros(4))
    assert torch.equal(torch.rand(8), expected), "the seeded run restored the stream"


def test_data_dependent_stages_run_for_real_without_side_effects() -> None:
    stage = DataDependent()
    stages = [nn.Linear(4, 4), stage]
    torch.manual_seed(5)
    expected = torch.rand(8)
    torch.manual_seed(5)
    found = infer_boundaries(stages, torch.zeros(3, 4))
    assert found[2].tensors == (TensorSpec((3, 4), F32, True),)
    assert torch.equal(torch.rand(8), expected), "the RNG stream is not consumed"
    assert int(stage.norm.num_batches_tracked) == 0
    assert torch.equal(stage.norm.running_mean, torch.zeros(4))


class MetaMask(nn.Module):
    """HF's pattern: a mask helper that returns None on real data (the model's own fast
    path) and a bool mask on the meta device; the stage passes it on."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool) if x.is_meta else None
        return x * 2, mask


class OwnAutocast(nn.Module):
    """Enters autocast(bfloat16) inside its own forward: a bf16 boundary for real."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.linear(x)


def test_boundaries_are_those_of_real_data() -> None:
    """A helper that branches on the meta device, an autocast region inside a stage:
    the boundaries are what the real forward returns."""
    found = infer_boundaries([MetaMask(), Split()], torch.randn(3, 4))
    assert found[1].leaves == (TensorSpec((3, 4), F32, False), None)
    found = infer_boundaries([OwnAutocast(), nn.Identity()], torch.randn(3, 4))
    assert found[1].tensors == (TensorSpec((3, 4), torch.bfloat16, True),)


def test_autocast_outputs_are_inferred_in_their_dtype() -> None:
    stages = [nn.Linear(4, 4), nn.Linear(4, 2)]
    found = infer_boundaries(stages, torch.zeros(3, 4), autocast=torch.bfloat16)
    assert found[1].tensors == (TensorSpec((3, 4), torch.bfloat16, True),)
    assert found[2].tensors == (TensorSpec((3, 2), torch.bfloat16, True),)
    plain = run_stage(stages[0], torch.zeros(3, 4), torch.device("cpu"))
    assert plain.boundary.tensors == (TensorSpec((3, 4), F32, True),)


def test_a_stage_that_fails_on_the_sample_is_named() -> None:
    with pytest.raises(InputError, match="stage 0 fails on the sample"):
        infer_boundaries([nn.Linear(3, 5)], torch.zeros(2, 4))


def test_boundaries_from_pairs_and_specs() -> None:
    found = normalise_boundaries({1: [((2, 3), torch.float16)], 2: TensorSpec((1,), torch.int32)})
    assert found[1].tensors == (TensorSpec((2, 3), torch.float16),)
    assert found[2].tensors == (TensorSpec((1,), torch.int32),)
    assert found[1].grads == found[1].tensors, "a floating spec without a flag carries one"
    assert found[2].grads == ()
    with pytest.raises(InputError, match="boundary of stage 1"):
        normalise_boundaries({1: "2x3"})


def test_a_leaf_that_is_neither_tensor_nor_constant_is_refused() -> None:
    class Opaque:
        pass

    with pytest.raises(InputError, match="the output of F0.0 holds a Opaque"):
        flatten({"x": torch.zeros(1), "o": Opaque()}, "the output of F0.0")


def test_boundary_text_round_trips_and_signatures_tell_shapes_apart() -> None:
    value = {"ids": torch.zeros(2, 8, dtype=I64), "mask": None, "scale": 0.5}
    boundary = boundary_of(value, "x")
    assert Boundary.from_text(boundary.text()) == boundary
    assert signature_of(value, 2) == signature_of({**value}, 2)
    other = {**value, "ids": torch.zeros(2, 6, dtype=I64)}
    assert signature_of(value, 2).code != signature_of(other, 2).code
    assert signature_of(value, 1).code != signature_of(value, 2).code
    assert boundary.describe() == "{'ids': int64[2, 8], 'mask': None, 'scale': 0.5}"


def test_a_signature_is_one_microbatch_read_from_metadata() -> None:
    """The signature's boundary is the first microbatch's, as split_tree cuts it, from
    the shapes alone (a meta tensor has no data to copy), with split_tree's errors."""
    value = {"x": torch.zeros(6, 3, device="meta"), "ids": torch.zeros(6, dtype=I64), "k": 1}
    want = boundary_of(split_tree(value, 3, "inputs", torch.device("meta"))[0], "x")
    assert microbatch_boundary(value, 3, "inputs") == want
    assert signature_of(value, 3).boundary == want
    with pytest.raises(InputError, match="6 rows cannot be split into 4"):
        signature_of(value, 4)
    with pytest.raises(InputError, match="different numbers of rows"):
        signature_of((torch.zeros(4), torch.zeros(2)), 2)


def test_split_tree_splits_tensor_leaves_and_repeats_constants() -> None:
    value = {"x": torch.arange(8).view(4, 2), "flag": True}
    parts = split_tree(value, 2, "inputs", torch.device("cpu"))
    assert [p["x"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(p["flag"] is True for p in parts)
    with pytest.raises(InputError, match="3 rows cannot be split into 2"):
        split_tree(torch.zeros(3), 2, "inputs", torch.device("cpu"))


def test_rng_derivation_is_a_function_of_seed_step_stage_and_microbatch() -> None:
    seeds = {derive_seed(0, t, s, m) for t in range(3) for s in range(4) for m in range(4)}
    assert len(seeds) == 48 and all(0 <= v < 2**63 for v in seeds)
    assert derive_seed(1, 0, 0, 0) != derive_seed(0, 0, 0, 0)
    rng = ForwardRng(torch.device("cpu"), 7, enabled=True)
    torch.manual_seed(3)
    expected = torch.rand(8)
    torch.manual_seed(3)
    with rng.step_scope():
        rng.seed(2, 1, 3)
        first = torch.rand(4)
        rng.seed(2, 1, 3)
        assert torch.equal(torch.rand(4), first)
    assert torch.equal(torch.rand(8), expected), "the caller's stream is restored"


def test_shared_parameters_are_found_by_identity() -> None:
    torch.manual_seed(0)
    embed, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    head.weight = embed.weight
    stages = [nn.Sequential(embed), nn.Linear(3, 3), nn.Sequential(head)]
    assert shared_parameters(stages) == (((0, "0.weight"), (2, "0.weight")),)
    assert shared_parameters([nn.Linear(2, 2), nn.Linear(2, 2)]) == ()


def test_a_remembered_signature_is_the_computed_one() -> None:
    """`Signatures.of` remembers a layout's signature: the same as computing it, another
    for other shapes, dtypes or constants, and an unusable batch is refused every time."""
    signatures = Signatures(2)
    values = [
        torch.zeros(4, 3), torch.zeros(4, 5), torch.zeros(4, 3, dtype=I64),
        {"x": torch.zeros(4, 3), "k": 1}, {"x": torch.zeros(4, 3), "k": 2},
    ]  # fmt: skip
    for _ in range(2):
        for value in values:
            assert signatures.of(value) == signature_of(value, 2)
    assert len({signatures.of(v).code for v in values}) == len(values)
    for _ in range(2):
        with pytest.raises(InputError, match="3 rows cannot be split into 2"):
            signatures.of(torch.zeros(3, 3))


def test_a_dtensor_leaf_keeps_its_layout_through_the_text() -> None:
    """A DTensor leaf's layout (mesh dims, placements, global shape and stride) travels in
    the boundary's text to every rank and is part of its identity: a receiver that rebuilt
    a sharded leaf as a plain one (or with other placements) would take the wrong value."""
    from pipecc.runtime.boundaries.placed import Placed
    from pipecc.runtime.boundaries.trees import Boundary

    placed = Placed(("tp",), ("S(1)",), (2, 8, 16), (128, 16, 1))
    spec = TensorSpec((2, 4, 16), torch.float32, True, placed)
    boundary = Boundary(torch.utils._pytree.tree_flatten(0)[1], (spec,))
    again = Boundary.from_text(boundary.text())
    assert again.tensors == (spec,)
    assert boundary.describe() == "float32[2, 4, 16] of a DTensor(tp: S(1); global [2, 8, 16])"
    plain = Boundary(boundary.tree, (spec._replace(placed=None),))
    replicated = Boundary(
        boundary.tree, (spec._replace(placed=placed._replace(placements=("R",))),)
    )
    assert not boundary.same_as(plain, grads=True)
    assert not boundary.same_as(replicated, grads=True)
    assert Boundary.from_text(plain.text()).tensors[0].placed is None
