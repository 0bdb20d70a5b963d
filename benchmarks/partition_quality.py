"""The layer search (`pipecc search --layers`) against the cuts users make today.

    .venv/bin/python benchmarks/partition_quality.py [--quick] [--exact SECONDS] [--seed N]

GPT-like profiles: an embedding (F 0.2-0.4 of a block's), 32 transformer blocks (F 1,
I 1.1, W 0.9, each ×(1 ± 5%) at random, seed `--seed`), and a head + loss whose F + I + W
is 2, 4 or 6 times a block's; bytes: a block keeps 1 MiB of activations per microbatch and
holds 48 MiB of parameters, gradients and optimizer state; the embedding and the head hold
4× that (the vocabulary), the head keeps 3× a block's activations (the logits); inputs
(what recomputation keeps) 1/16 of a block's activations. P ∈ {4, 8}, M ∈ {2P, 4P}; caps:
1F1B's predicted peak on the uniform cut, and 85% of it.

For each cell, the step in the latency model (every rank starting at 0, a message arriving
`comm` after its producer ends; what the search optimises and `pipecc simulate --comm
eager` gives) of

- the search: `pipecc search --layers --placement auto --comm eager` (both placements);
- (a) the uniform cut (equal layer counts, DeepSpeed's "uniform") with the best bundled
  schedule (1F1B, ZB-H1, ZB-H2, GPipe on the loop; ZB-V on the V shape);
- (b) torchtitan's rule: the embedding counts as `first_less` layers and the head as
  `last_less` layers of an even split (`pipeline_parallel_first/last_stage_less_layers`),
  every setting 0..8 of each, with every bundled schedule;
- (c) Megatron's `decoder_first/last_pipeline_num_layers`: every pair of first- and
  last-stage block counts whose remaining blocks split evenly over the middle stages (the
  embedding on the first stage, the head on the last), with every bundled schedule.

Every baseline cut is also tried with every stage recomputed (Megatron's full
recomputation), where that fits and the plain cut does not. With `--exact S`, CP-SAT (S
seconds of deterministic time, one worker) on the orders of the searched cut at P=4, M=8
(hinted with the search's order): its best order within the budget (it proves no optimum
on these profiles: their jittered durations and the cap's byte headroom do not scale to
whole numbers). Over every cut, CP-SAT's proven optimum is checked at P=2, M=4 by
tests/search/test_layers.py.

"x% faster" is the baseline's step over the search's, less one (the throughput gained); a
baseline none of whose cuts fits the cap leaves the cell out of its mean. The checks of
the issue's requirement 4: the search is never slower than (a), (b) or (c);
on average at least 15% faster than (a) and 3% faster than the best of (b) and (c); within
2% of CP-SAT's best.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipecc.search import exact  # noqa: E402
from pipecc.search.baseline import compiled_orders  # noqa: E402
from pipecc.search.layers import Cut, Layer, Profile, cut_of_counts, uniform_cut  # noqa: E402
from pipecc.search.partition import (  # noqa: E402
    Setting,
    cut_problem,
    memory_peaks,
)
from pipecc.search.partition_run import LayerOutcome, LayerRequest, run_layer_search  # noqa: E402
from pipecc.search.replay import OrderReplay  # noqa: E402
from pipecc.search.run import NoScheduleError  # noqa: E402
from pipecc.semantics import CommModel  # noqa: E402

MiB = 2**20
BLOCKS = 32
HEAD_RATIOS = (2, 4, 6)


def gpt_profile(head_ratio: float, seed: int, blocks: int = BLOCKS) -> Profile:
    """The module docstring's GPT-like profile."""
    rng = random.Random(seed * 1000 + int(head_ratio * 10))
    act, static = 1 * MiB, 48 * MiB
    embed = rng.uniform(0.2, 0.4)
    layers = [Layer("embed", embed, 0.05, embed, act // 8, 4 * static, 0, 0, act // 16)]
    for b in range(blocks):
        jitter = [rng.uniform(0.95, 1.05) for _ in range(3)]
        layers.append(Layer(f"block{b}", 1.0 * jitter[0], 1.1 * jitter[1], 0.9 * jitter[2],
                            act, static, 0, 0, act // 16))  # fmt: skip
    head = head_ratio * 3.0 / 3
    layers.append(Layer("head", head * 0.9, head * 1.1, head, 3 * act, 4 * static, 0, 0, act // 16))
    return Profile(tuple(layers), comm=0.05, unit="ms", origin=f"gpt-head{head_ratio:g}x")


def torchtitan_cuts(layers: int, stages: int) -> Iterator[tuple[str, Cut]]:
    """torchtitan's split: blocks + first_less + last_less "layers" over the stages, the
    earlier stages taking the extra ones; the first stage's share less first_less is its
    blocks (plus the embedding), the last's less last_less (plus the head)."""
    blocks = layers - 2
    for first_less in range(9):
        for last_less in range(9):
            effective = blocks + first_less + last_less
            base, extra = divmod(effective, stages)
            share = [base + (1 if s < extra else 0) for s in range(stages)]
            share[0] -= first_less
            share[-1] -= last_less
            if min(share) < 0 or (stages > 1 and min(share[1:-1], default=1) < 1):
                continue
            counts = [share[0] + 1, *share[1:-1], share[-1] + 1]
            yield f"first_less={first_less} last_less={last_less}", cut_of_counts(counts)


def megatron_cuts(layers: int, stages: int) -> Iterator[tuple[str, Cut]]:
    """Megatron's first/last-stage block counts, the middle stages taking equal counts."""
    blocks = layers - 2
    for first in range(blocks + 1):
        for last in range(blocks + 1 - first):
            middle = blocks - first - last
            if stages > 2 and (middle % (stages - 2) or middle == 0):
                continue
            if stages == 2 and middle:
                continue
            per = middle // (stages - 2) if stages > 2 else 0
            counts = [first + 1, *([per] * (stages - 2)), last + 1]
            yield f"first={first} last={last}", cut_of_counts(counts)


class Best(NamedTuple):
    step: float
    what: str


def best_bundled(setting: Setting, cuts: Iterator[tuple[str, Cut]], replays: list) -> Best:
    """The shortest step of any bundled schedule on any of the cuts (plain, or every stage
    recomputed where the plain cut does not fit)."""
    best = Best(float("inf"), "none fits")
    for label, cut in cuts:
        variants = [cut, cut.with_recompute((True,) * cut.stages)]
        for variant in variants:
            problem = cut_problem(setting, variant)
            if problem is None:
                continue
            fitted = False
            for name, replay in replays:
                if replay.fits(problem):
                    fitted = True
                    step = replay.makespan(problem)
                    if step < best.step:
                        what = f"{name} {variant.describe()} ({label})"
                        best = Best(step, what)
            if fitted:
                break  # recompute only where the plain cut does not fit
    return best


def _replays(setting: Setting) -> list[tuple[str, OrderReplay]]:
    free = Setting(setting.profile, setting.ranks, setting.microbatches, setting.placement, None)
    problem = cut_problem(free, uniform_cut(len(setting.profile.layers), setting.stages))
    assert problem is not None  # the structure of the orders only: no cap
    orders = compiled_orders(setting.ranks, setting.microbatches, setting.placement)
    return [(name, OrderReplay(problem, order)) for name, order, _ in orders]


def one_f_one_b_peak(profile: Profile, ranks: int, mbs: int) -> float:
    """1F1B's predicted peak bytes (largest rank) on the uniform cut."""
    cut = uniform_cut(len(profile.layers), ranks)
    program = next(p for n, _, p in compiled_orders(ranks, mbs, "loop") if n == "1f1b")
    return max(memory_peaks(program, profile, cut))


class Cell(NamedTuple):
    label: str
    search: float
    seconds: float
    a: Best
    b: Best
    c: Best
    exact: float | None


def run_cell(profile: Profile, ranks: int, mbs: int, cap: float, args: argparse.Namespace) -> Cell:
    request = LayerRequest(profile, ranks, mbs, cap, "auto", CommModel.EAGER, None, 0,
                           "aligned", "nccl")  # fmt: skip
    began = time.perf_counter()
    try:
        found: LayerOutcome | None = run_layer_search(request)
    except NoScheduleError:
        found = None
    seconds = time.perf_counter() - began
    baselines = {"a": Best(float("inf"), "none fits"), "b": Best(float("inf"), "none fits"),
                 "c": Best(float("inf"), "none fits")}  # fmt: skip
    layers = len(profile.layers)
    for placement in ("loop", "vshape"):
        setting = Setting(profile, ranks, mbs, placement, cap)
        replays = _replays(setting)
        for key, cuts in (
            ("a", iter([("uniform", uniform_cut(layers, setting.stages))])),
            ("b", torchtitan_cuts(layers, setting.stages)),
            ("c", megatron_cuts(layers, setting.stages)),
        ):
            best = best_bundled(setting, cuts, replays)
            if best.step < baselines[key].step:
                baselines[key] = Best(best.step, f"{placement}: {best.what}")
    best_exact = None
    if args.exact and ranks == 4 and mbs == 8 and found is not None:
        best_exact = _exact(found, profile, cap, args.exact)
    label = f"{profile.origin} P={ranks} M={mbs} cap={cap / MiB:.0f}MiB"
    step = float("inf") if found is None else found.outcome.lowered.eager_makespan
    return Cell(label, step, seconds, baselines["a"], baselines["b"], baselines["c"], best_exact)


def _exact(found: LayerOutcome, profile: Profile, cap: float, work: float) -> float | None:
    """CP-SAT's best order on the searched cut, replayed exactly (None: it found none). Its
    optimum is proven only where the profile's numbers are whole after scaling (never on
    these jittered profiles, nor under a cap, whose byte headroom the search scales by):
    the figure is CP-SAT's best within the budget, not a proof."""
    problem = found.outcome.problem
    setting = Setting(profile, problem.ranks, problem.microbatches, problem.placement, cap)
    cut_prob = cut_problem(setting, found.cut)
    assert cut_prob is not None
    solved = exact.solve(cut_prob, hint=found.outcome.order, work=work)
    return solved.value if solved.order is not None else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P=4 only, head 4x")
    parser.add_argument("--exact", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cells = []
    ratios = (4,) if args.quick else HEAD_RATIOS
    for ratio in ratios:
        profile = gpt_profile(ratio, args.seed)
        for ranks in (4,) if args.quick else (4, 8):
            for mbs in (2 * ranks, 4 * ranks):
                peak = one_f_one_b_peak(profile, ranks, mbs)
                for cap in (peak, 0.85 * peak):
                    cell = run_cell(profile, ranks, mbs, cap, args)
                    cells.append(cell)
                    _print_cell(cell)
    return _verdict(cells)


def _print_cell(cell: Cell) -> None:
    def lead(best: Best) -> str:
        return (
            f"{best.step:8.2f} ({best.step / cell.search - 1:+6.1%})"
            if best.step < 1e300
            else "   -"
        )

    print(f"{cell.label:<34} search {cell.search:8.2f} ({cell.seconds:4.1f}s)  (a) {lead(cell.a)}"
          f"  (b) {lead(cell.b)}  (c) {lead(cell.c)}"
          + (f"  CP-SAT {cell.exact:.2f}" if cell.exact is not None else ""))  # fmt: skip
    for key, best in (("a", cell.a), ("b", cell.b), ("c", cell.c)):
        print(f"    ({key}) {best.what}")
    sys.stdout.flush()


def _verdict(cells: list[Cell]) -> int:
    """The issue's targets; exit 1 when one fails."""
    slower = [c.label for c in cells if c.search > min(c.a.step, c.b.step, c.c.step) + 1e-6]
    vs_a = [c.a.step / c.search - 1 for c in cells if c.a.step < 1e300]
    vs_bc = [min(c.b.step, c.c.step) / c.search - 1 for c in cells
             if min(c.b.step, c.c.step) < 1e300]  # fmt: skip
    exact_gaps = [c.search / c.exact - 1 for c in cells if c.exact is not None]
    print(f"\ncells: {len(cells)}; slower than a baseline in {len(slower)}: {slower}")
    print(f"faster than (a) uniform x bundled: mean {statistics.mean(vs_a):.1%} "
          f"(min {min(vs_a):.1%}, max {max(vs_a):.1%}); target >= 15%")  # fmt: skip
    print(f"faster than the best of (b) torchtitan and (c) Megatron: mean "
          f"{statistics.mean(vs_bc):.1%} (min {min(vs_bc):.1%}); target >= 3%")  # fmt: skip
    if exact_gaps:
        print(f"above CP-SAT's best order on the searched cut (hinted; no optimum proven): "
              f"max {max(exact_gaps):.2%} over {len(exact_gaps)} cells; target <= 2%")  # fmt: skip
    ok = not slower and statistics.mean(vs_a) >= 0.15 and statistics.mean(vs_bc) >= 0.03
    ok = ok and all(g <= 0.02 for g in exact_gaps)
    print("verdict: " + ("every target met" if ok else "a target is missed"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
