"""`pipecc run --profile-layers`' parts in process: each layer timed alone as the runtime
splits its backward (I and W measured apart), the stages of the run found from the
parameter names each held, and the layer times scaled to the stage times the run measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pipecc.runtime.profiling import layers as layers_module
from pipecc.runtime.profiling.layers import (
    calibrate,
    profile_layers,
    render_layers,
    stage_of_layers,
)
from torch import nn

from pipecc.search.layers import load_layers


def _entry(name: str, f: float, i: float, w: float) -> dict[str, Any]:
    return {"name": name, "F": f, "I": i, "W": w, "act_bytes": 8, "param_bytes": 4,
            "input_bytes": 2}  # fmt: skip


ENTRIES = [_entry("embed", 1, 0.5, 1), _entry("b0", 2, 2, 1), _entry("b1", 2, 2, 1),
           _entry("head", 4, 3, 3)]  # fmt: skip


def test_each_stage_of_the_run_sums_to_what_the_run_measured() -> None:
    measured = {0: {"F": 10.0, "I": 9.0, "W": 6.0}, 1: {"F": 6.0, "I": 4.0, "W": 5.0}}
    found, fixed = calibrate(ENTRIES, [0, 0, 1, 1], measured)
    assert fixed == 0.0  # nothing timed in the run
    for stage, layers in ((0, found[:2]), (1, found[2:])):
        for kind in "FIW":
            assert sum(e[kind] for e in layers) == pytest.approx(measured[stage][kind])
    assert found[0]["F"] / found[1]["F"] == pytest.approx(1 / 2)  # the shares alone stay
    assert found[0]["alone"] == {"F": 1, "I": 0.5, "W": 1}
    assert found[0]["scale"]["F"] == pytest.approx(10 / 3)


def test_a_run_that_did_not_split_scales_I_and_W_by_its_B() -> None:
    found, _ = calibrate(ENTRIES, [0, 0, 1, 1], {0: {"F": 3.0, "B": 9.0}})
    assert found[0]["I"] + found[0]["W"] + found[1]["I"] + found[1]["W"] == pytest.approx(9.0)
    assert found[1]["I"] / found[1]["W"] == pytest.approx(2.0)
    assert [found[n][k] for n in (2, 3) for k in "FIW"] == [2, 2, 1, 4, 3, 3]  # not measured


def test_layers_timed_in_the_run_keep_their_f_and_the_rest_is_the_stages_own() -> None:
    """With each layer's F timed inside the run, a stage's layers take those, and what the
    stage's measured F has beyond their sum is F_fixed (the mean over the stages timed);
    I and W are scaled as before."""
    measured = {0: {"F": 10.0, "I": 9.0, "W": 6.0}, 1: {"F": 9.0, "I": 4.0, "W": 5.0}}
    in_run = {"embed": 1.5, "b0": 6.5, "b1": 3.0, "head": 5.0}
    entries = [*ENTRIES[:3], {**ENTRIES[3], "loss": 0.5}]  # the hooks do not see the loss
    found, fixed = calibrate(entries, [0, 0, 1, 1], measured, in_run)
    assert [e["F"] for e in found] == [1.5, 6.5, 3.0, 5.5]
    assert fixed == pytest.approx(((10 - 8) + (9 - 8.5)) / 2)
    assert sum(e["I"] for e in found[:2]) == pytest.approx(9.0)
    partial, fixed = calibrate(ENTRIES, [0, 0, 1, 1], measured, {"embed": 1.5})
    assert fixed == 0.0 and partial[0]["F"] == pytest.approx(10 / 3)  # b0 untimed: scaled


def test_the_stage_of_each_layer_comes_from_the_parameters_it_held() -> None:
    held = {0: ["embed.weight", "blocks.0.fc.weight"], 1: ["blocks.1.fc.weight", "head.w"]}
    names = ["embed", "blocks.0", "drop", "blocks.1", "head"]
    assert stage_of_layers(names, held) == [0, 0, 0, 1, 1]
    assert stage_of_layers(["blocks.1"], {0: ["blocks.10.w"], 1: ["blocks.1.w"]}) == [1]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)
        )
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_the_layers_are_timed_in_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer once a round, not one layer's repeats after another: a slow stretch of
    the machine then lands on all layers of a round, not on the few timed during it (which
    calibration would pass on to the other layers of their stage)."""
    timed: list[int] = []
    split_once = layers_module._split_once

    def recorded(module: nn.Module, args: Any, finish: Any) -> Any:
        timed.append(id(module))
        return split_once(module, args, finish)

    monkeypatch.setattr(layers_module, "_split_once", recorded)
    model = _Model()
    x = torch.randint(0, 16, (4, 8))
    names = ["embed", "blocks.0", "blocks.1", "head"]
    loss = lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    profile_layers(model, names, (x, x), loss, repeats=3)
    order = [id(dict(model.named_modules())[n]) for n in names]
    assert timed == order * 4, "a warm-up round, then 3 rounds of every layer"


def test_each_layer_is_timed_with_its_backward_split(tmp_path: Any) -> None:
    """I and W are measured apart (not halves of B): a layer with Linear weights has both;
    the embedding, whose input needs no gradient, has only its weight work in W."""
    torch.manual_seed(0)
    model = _Model()
    x = torch.randint(0, 16, (4, 8))
    names = ["embed", "blocks.0", "blocks.1", "head"]
    entries = profile_layers(
        model, names, (x, x), lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1),
                                                                         y.flatten()), repeats=3
    )  # fmt: skip
    assert [e["name"] for e in entries] == names
    assert all(e["F"] > 0 and e["I"] > 0 and e["W"] > 0 for e in entries)
    assert entries[1]["I"] != entries[1]["W"]
    assert entries[-1]["loss"] > 0 and "loss" not in entries[0]
    assert all(p.grad is None for p in model.parameters())  # nothing left behind
    assert entries[1]["param_bytes"] == (32 * 64 + 64 + 64 * 32 + 32) * 4
    found, _ = calibrate(entries, [0, 0, 1, 1], {0: {"F": 5.0, "I": 4.0, "W": 3.0}})
    path = tmp_path / "layers.toml"
    path.write_text(render_layers(found, {"comm": 0.5, "post": 0.25, "wait": 0.125}, "test"))
    profile = load_layers(path)
    assert (profile.comm, profile.post, profile.wait) == (0.5, 0.25, 0.125)
    assert sum(layer.F for layer in profile.layers[:2]) == pytest.approx(5.0, rel=1e-3)
    assert sum(layer.W for layer in profile.layers[:2]) == pytest.approx(3.0, rel=1e-3)
