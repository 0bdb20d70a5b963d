"""The cost model's keys: parsing from --cost and TOML, validation, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipecc.diagnostics import CostModelError
from pipecc.semantics import Overhead
from pipecc.semantics.costs import Cut, HostCost, load_cost_file, parse_cost_flag


def test_host_keys_from_the_flag() -> None:
    model = parse_cost_flag("F=1,B=2,post=0.05,wait=0.01,sync=3")
    assert model.host == HostCost(post=0.05, wait=0.01, sync=3.0)
    assert model.overhead() == Overhead(0.05, 0.01)
    assert model.sync == 3.0
    assert "post=0.05, wait=0.01, sync=3" in model.describe()


def test_host_keys_default_to_zero() -> None:
    model = parse_cost_flag("F=1")
    assert model.host == HostCost()
    assert model.overhead() == Overhead(0.0, 0.0) and model.sync == 0.0
    assert "post" not in model.describe()


def test_host_keys_from_a_file_and_the_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cost]\nunit = "ms"\nF = 1.0\npost = 0.06\nwait = 0.004\nsync = 8.5\n')
    model = load_cost_file(path)
    assert model.host == HostCost(0.06, 0.004, 8.5)
    merged = model.overridden_by(parse_cost_flag("post=0.1"))
    assert merged.host == HostCost(0.1, 0.004, 8.5)
    v_cut = model.for_cut(Cut(ranks=2, stages=4))
    assert v_cut.host == model.host, "host time does not scale with the stages"
    assert v_cut.stage(0).F == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cost]\npost = -1\n", "c.toml: post must be a finite number ≥ 0, got -1"),
        ("[cost]\nwait = 'soon'\n", "c.toml: wait must be a number, got 'soon'"),
        ("[cost]\nsync = inf\n", "c.toml: sync must be a finite number ≥ 0, got inf"),
        (
            "[cost]\nF = 1\n[cost.stage.0]\npost = 0.1\n",
            "c.toml [cost.stage.0]: 'post' is global only: give it under [cost]",
        ),
        ("[cost]\npots = 1\n", "c.toml: unknown cost key 'pots'"),
    ],
)
def test_bad_host_keys(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(CostModelError) as err:
        load_cost_file(path)
    assert str(err.value).replace(str(tmp_path) + "/", "").startswith(f"error: {message}")


def test_bad_host_key_on_the_flag() -> None:
    with pytest.raises(CostModelError, match=r"--cost: post must be a finite number ≥ 0"):
        parse_cost_flag("post=-0.1")
    with pytest.raises(CostModelError, match=r"unknown cost key 'synk'.*did you mean 'sync'"):
        parse_cost_flag("synk=1")


def test_shared_stage_groups_from_the_flag_and_a_file(tmp_path: Path) -> None:
    assert parse_cost_flag("shared=7+0/1+6").shared == ((0, 7), (1, 6))
    path = tmp_path / "c.toml"
    path.write_text("[cost]\nsync = 2\nshared = [[0, 3]]\n")
    model = load_cost_file(path)
    assert (model.shared, model.sync) == (((0, 3),), 2.0)
    assert model.overridden_by(parse_cost_flag("F=2")).shared == ((0, 3),), "kept"
    assert "shared=0+3" in model.describe()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("shared=0", "error: --cost: shared: [0] must name two or more different stages"),
        ("shared=0+0", "error: --cost: shared: [0, 0] must name two or more different stages"),
        ("shared=a+1", "error: --cost: shared must be groups of stage numbers like 0+7 or 0+7/1+6, "
         "got 'a+1'"),
    ],
)  # fmt: skip
def test_bad_shared_on_the_flag(text: str, message: str) -> None:
    with pytest.raises(CostModelError) as err:
        parse_cost_flag(text)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("shared = 3", "shared must be a list of groups of stage numbers, e.g. [[0, 7]]"),
        ("shared = [[0, -1]]", "shared: [0, -1] must hold stage numbers ≥ 0"),
        ("shared = [[0, true]]", "shared: [0, True] must hold stage numbers ≥ 0"),
        ("[cost.stage.0]\nshared = [[0, 1]]", "'shared' is global only: give it under [cost]"),
    ],
)
def test_bad_shared_in_a_file(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[cost]\n{body}\n")
    with pytest.raises(CostModelError) as err:
        load_cost_file(path)
    assert message in str(err.value)
