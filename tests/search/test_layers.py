"""The layer search: the per-layer profile, the cut file, a cut's problem and bytes, and the
search over cuts (optimal on small cases, under the cap, recomputing where the cap needs it)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pipecc.diagnostics import InputError
from pipecc.search import exact
from pipecc.search.baseline import compiled_orders
from pipecc.search.engine import search
from pipecc.search.layers import (
    Cut,
    Layer,
    Profile,
    cut_layers,
    cut_of_counts,
    cut_toml,
    load_cut,
    load_layers,
    parse_size,
    uniform_cut,
)
from pipecc.search.lower import to_program
from pipecc.search.partition import (
    Setting,
    cut_problem,
    memory_peaks,
    search_cuts,
    stage_durations,
)
from pipecc.search.problem import evaluate, fits

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gpt_layers.toml"
MiB = 2**20


def _profile(head: float = 4.0, blocks: int = 4) -> Profile:
    """An embedding, `blocks` blocks, a head `head` times a block (F + I + W)."""
    layers = [Layer("embed", 0.3, 0.05, 0.3, 1 * MiB, 8 * MiB, 0, 0, 64 * 1024)]
    layers += [Layer(f"b{n}", 1, 1.1, 0.9, 8 * MiB, 8 * MiB, 0, 0, 1 * MiB) for n in range(blocks)]
    layers.append(Layer("head", head * 0.9, head * 1.1, head, 24 * MiB, 8 * MiB, 0, 0, 1 * MiB))
    return Profile(tuple(layers), comm=0.1, unit="ms", origin="test")


def test_the_example_profile_reads_as_documented() -> None:
    profile = load_layers(EXAMPLE)
    assert profile.names[0] == "embed" and profile.names[-1] == "head"
    assert len(profile.layers) == 10 and profile.unit == "ms" and profile.comm == 0.05
    block = profile.layers[1]
    assert (block.F, block.I, block.W) == (1.0, 1.1, 0.9)
    assert block.static_bytes == 64 * MiB and block.input_bytes == 2 * MiB


def test_b_alone_splits_in_halves_and_bytes_are_optional(tmp_path: Path) -> None:
    path = tmp_path / "l.toml"
    path.write_text(
        '[[layer]]\nname = "a"\nF = 1\nB = 3\n[[layer]]\nname = "b"\nF = 1\nB = 2\nI = 0.5\n'
    )
    profile = load_layers(path)
    assert (profile.layers[0].I, profile.layers[0].W) == (1.5, 1.5)
    assert (profile.layers[1].I, profile.layers[1].W) == (0.5, 1.5)
    assert not profile.has_bytes and profile.layers[0].input_bytes is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[[layer]]\nname = "a"\nF = 1\nI = 1\nW = 1\nact_byte = 3\n',
            r"layer 0 \(a\): unknown key 'act_byte'.*did you mean 'act_bytes'",
        ),
        ('[[layer]]\nname = "a"\nF = 1\nI = 1\n', r"layer 0 \(a\): needs B, or I and W"),
        ("[[layer]]\nF = 1\nB = 1\n", r"layer 0: needs a name"),
        ('[[layer]]\nname = "a"\nF = -1\nB = 1\n', r"F must be a finite number ≥ 0"),
        (
            '[[layer]]\nname = "a"\nF = 1\nB = 1\n[[layer]]\nname = "a"\nF = 1\nB = 1\n',
            r"layer 1: name 'a' is already layer 0",
        ),
        ('[[layer]]\nname = "a"\nF = 1\nB = 1\nI = 0.2\nW = 0.2\n', r"B=1 is not I \+ W"),
        ("comm = 0.1\n", r"expected \[\[layer\]\] tables"),
        ("[[layer]\n", r"malformed TOML"),
    ],
)
def test_bad_profiles_name_the_file_the_layer_and_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as caught:
        load_layers(path)
    assert str(path) in str(caught.value)


def test_sizes_take_binary_units_only() -> None:
    assert parse_size("40GiB") == 40 * 2**30
    assert parse_size("1.5TiB") == 1.5 * 2**40 and parse_size("65536") == 65536
    for bad in ("40GB", "-1MiB", "0", "lots"):
        with pytest.raises(InputError, match="--memory"):
            parse_size(bad)


def test_the_cut_file_round_trips(tmp_path: Path) -> None:
    profile = _profile()
    cut = cut_of_counts([2, 2, 2]).with_recompute((False, True, False))
    path = tmp_path / "cut.toml"
    path.write_text(cut_toml(cut, profile, "a header"))
    text = path.read_text()
    assert text.startswith("# a header\n") and 'recompute = "full"' in text
    assert 'index = 1\nlayers = ["b1", "b2"]' in text
    assert load_cut(path, profile.names) == (cut, profile.names)
    with pytest.raises(InputError, match="not the model's layers in order"):
        load_cut(path, tuple(reversed(profile.names)))


def test_a_cuts_stage_costs_are_sums_and_recomputation_runs_f_again() -> None:
    profile = _profile()
    cut = cut_of_counts([2, 3, 1]).with_recompute((False, True, False))
    (f0, i0, w0), (f1, i1, w1), (f2, _, _) = stage_durations(profile, cut)
    assert (f0, i0, w0) == pytest.approx((1.3, 1.15, 1.2))
    assert (f1, i1, w1) == pytest.approx((3.0, 3.3 + 3.0, 2.7))
    assert f2 == pytest.approx(3.6)


@pytest.mark.parametrize("placement", ["loop", "vshape"])
def test_the_problems_memory_is_the_byte_rule_of_the_lowered_program(
    placement: str,
) -> None:
    """The cap as the search sees it (headroom-scaled units) and the bytes predicted from
    the program by `pipecc.analysis.memory` are the same figures, recomputed stages too."""
    profile = _profile(blocks=6)
    stages = 2 if placement == "loop" else 4
    setting = Setting(profile, 2, 4, placement, 160 * MiB)
    for counts in ([3, 5], [4, 4]) if stages == 2 else ([1, 3, 2, 2], [2, 2, 2, 2]):
        for flags in itertools.product((False, True), repeat=stages):
            cut = cut_of_counts(counts).with_recompute(flags)
            problem = cut_problem(setting, cut)
            assert problem is not None
            for name, order, _ in compiled_orders(2, 4, placement):
                evaluation = evaluate(problem, order)
                assert evaluation is not None
                peaks = memory_peaks(to_program(problem, order), profile, cut)
                static = setting.static(cut)
                for rank, peak in enumerate(peaks):
                    scaled = static[rank] + evaluation.peak[rank] * (setting.cap - static[rank])
                    assert peak == pytest.approx(scaled), (name, counts, flags, rank)
                assert fits(problem, evaluation) == all(p <= setting.cap + 1 for p in peaks)


def test_static_bytes_above_the_cap_rule_the_cut_out() -> None:
    setting = Setting(_profile(), 2, 4, "loop", 20 * MiB)
    assert cut_problem(setting, cut_of_counts([3, 3])) is None  # 24 MiB of weights on each


def _all_cuts(layers: int, stages: int) -> list[Cut]:
    return [
        Cut((0, *starts), layers, (False,) * stages)
        for starts in itertools.combinations(range(1, layers), stages - 1)
    ]


@pytest.mark.skipif(not exact.available(), reason="OR-Tools is not installed")
@pytest.mark.parametrize(
    ("placement", "head", "cap", "microbatches"),
    [("loop", 4.0, None, 4), ("loop", 2.0, 120 * MiB, 4), ("vshape", 6.0, None, 4),
     ("loop", 4.0, None, 6)],
)  # fmt: skip
def test_the_layer_search_reaches_the_optimum_over_every_cut(
    placement: str, head: float, cap: float | None, microbatches: int
) -> None:
    """P=2, M=4 (and M=6 on the loop), 6 layers: CP-SAT's optimum on every cut (without
    recomputation; proven without a cap, where the problem's numbers are whole); the layer
    search's step is the least of them (or less, recomputing)."""
    profile = _profile(head=head)
    setting = Setting(profile, 2, microbatches, placement, cap)
    optima = []
    for cut in _all_cuts(len(profile.layers), setting.stages):
        problem = cut_problem(setting, cut)
        if problem is None:
            continue
        solved = exact.solve(problem, work=5)
        assert solved.optimal or cap is not None
        optima.append(solved.value)
    found = search_cuts(setting)
    assert found and found[0].result.score <= min(optima) + 1e-9
    assert found[0].result.score == pytest.approx(min(optima), abs=1e-9) or any(
        found[0].cut.recompute
    )


def test_recomputation_is_chosen_where_the_cap_needs_it() -> None:
    """A cap that lets rank 0 hold one microbatch's activations at a time: recomputing
    (keeping only a stage's input) lets it hold more, and the search finds that faster than
    the best plain cut; the lowered program's predicted peak is within the cap."""
    profile = _profile(blocks=4)
    cap = 58 * MiB  # cut 4|2: rank 0 holds 32 MiB of weights and 25 MiB per microbatch
    tight = Setting(profile, 2, 4, "loop", cap)
    plain = []
    for cut in _all_cuts(6, 2):
        problem = cut_problem(tight, cut)
        if problem is not None:
            result = search(problem, time_limit=5, exact_work=0)
            plain += [result.score] if result is not None else []
    found = search_cuts(tight)
    assert found, "some cut fits"
    best = found[0]
    assert any(best.cut.recompute)
    assert best.result.score < min(plain) - 1e-9
    peaks = memory_peaks(to_program(best.result.problem, best.result.order), profile, best.cut)
    assert max(peaks) <= cap


def test_the_search_is_never_slower_than_the_uniform_cut_with_a_bundled_schedule() -> None:
    profile = _profile(head=6.0, blocks=6)
    for placement in ("loop", "vshape"):
        setting = Setting(profile, 2, 8, placement, None)
        uniform = cut_problem(setting, uniform_cut(8, setting.stages))
        assert uniform is not None
        steps = [evaluate(uniform, order) for _, order, _ in compiled_orders(2, 8, placement)]
        best = min(e.makespan for e in steps if e is not None)
        found = search_cuts(setting)
        assert found[0].result.score < best - 1e-9


def test_a_cut_file_is_split_models_layers(tmp_path: Path) -> None:
    """A cut of a profile named by the model's modules cuts the model as written: each
    stage built by split_model holds exactly its layers' parameters."""
    torch = pytest.importorskip("torch")
    from pipecc.runtime import split_model

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    names = tuple(str(n) for n in range(5))
    layers = tuple(Layer(name, 1, 1, 1) for name in names)
    cut = cut_of_counts([1, 3, 1]).with_recompute((False, True, False))
    path = tmp_path / "cut.toml"
    path.write_text(cut_toml(cut, Profile(layers)))
    stages = cut_layers(path)
    assert stages == [["0"], ["1", "2", "3"], ["4"]]
    for index, expected in enumerate(stages):
        part = split_model(model, index, 3, layers=stages, init=None)
        held = {name.split(".")[0] for name, _ in part.named_parameters()}
        assert held == set(expected)


def test_the_profiles_f_fixed_is_added_to_every_stages_f(tmp_path: Path) -> None:
    """`F_fixed` (a stage's own work per F, as a run measured it) is in every stage's F and
    so in a recomputed stage's I, which runs F again."""
    text = EXAMPLE.read_text().replace("comm = 0.05", "comm = 0.05\nF_fixed = 0.25", 1)
    (tmp_path / "fixed.toml").write_text(text)
    plain, fixed = load_layers(EXAMPLE), load_layers(tmp_path / "fixed.toml")
    assert fixed.F_fixed == 0.25
    cut = uniform_cut(10, 4).with_recompute((True, False, False, False))
    for (f0, _, w0), (f1, _, w1) in zip(
        stage_durations(plain, cut), stage_durations(fixed, cut), strict=True
    ):
        assert f1 == pytest.approx(f0 + 0.25) and w1 == pytest.approx(w0)
    assert stage_durations(fixed, cut)[0][1] == pytest.approx(
        stage_durations(plain, cut)[0][1] + 0.25
    )
