"""The bundled schedules equal rule-based oracles written from their published definitions.

Each oracle states a schedule the way issue 2 §6 states it (DualPipe's eight steps, the ZB-H1
pattern, canonical 1F1B, our derived ZB-H2), as a per-rank list of symbolic ops: `Step("F", 0)`
is a forward of chunk 0, `Step("W")` the weight pass of the oldest pending `I` (FIFO), and
`Pair(f, b)` a fused F&B whose backward is a full `B`. `_number` then gives every op its stage
and microbatch the way the compiler must: one forward and one backward counter per chunk,
starting at the first microbatch of the chunk's pipe. The oracles are independent of the
`.sched` files; a schedule that drifts by one op fails here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import compile_bundled, compute_order

from pipecc.diagnostics import ScheduleError

Op = tuple[Any, ...]  # ("F", stage, mb), or ("OVERLAP", forward, backward)
Order = list[list[Op]]


@dataclass(frozen=True, slots=True)
class Step:
    """One compute op of a chunk: kind F, B (full backward), I (input grad) or W (weights)."""

    kind: str
    chunk: int = 0


@dataclass(frozen=True, slots=True)
class Pair:
    """A fused, overlapped pair: forward of one chunk with a full backward of another."""

    forward: int
    backward: int


Token = Step | Pair


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a rank's chunks live: stage index (within its pipe) and first microbatch."""

    stages: tuple[int, ...]
    first_mb: tuple[int, ...]


F0, F1 = Step("F", 0), Step("F", 1)
B0, B1 = Step("B", 0), Step("B", 1)
I0, I1 = Step("I", 0), Step("I", 1)
W = Step("W")


# ---------------------------------------------------------------------------------------------
# Numbering: symbolic ops -> (kind, stage, mb)


class _Counters:
    """Per-chunk forward and backward counters, and the FIFO of I's still waiting for a W."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.forward = list(layout.first_mb)
        self.backward = list(layout.first_mb)
        self.pending: deque[Op] = deque()

    def take(self, kind: str, chunk: int) -> Op:
        counters = self.forward if kind == "F" else self.backward
        mb = counters[chunk]
        counters[chunk] += 1
        op = (kind, self.layout.stages[chunk], mb)
        if kind == "I":
            self.pending.append(op)
        return op

    def weight(self) -> Op:
        _, stage, mb = self.pending.popleft()
        return ("W", stage, mb)


def _number(tokens: Sequence[Token], layout: Layout) -> list[Op]:
    """Give each symbolic op its stage and microbatch; every I must get its W."""
    counters = _Counters(layout)
    ops: list[Op] = []
    for token in tokens:
        match token:
            case Pair(forward=f, backward=b):
                ops.append(("OVERLAP", counters.take("F", f), counters.take("B", b)))
            case Step(kind="W"):
                ops.append(counters.weight())
            case Step(kind=kind, chunk=chunk):
                ops.append(counters.take(kind, chunk))
    assert not counters.pending, "oracle bug: an I without its W"
    return ops


# ---------------------------------------------------------------------------------------------
# DualPipe / DualPipeV: the eight steps (h = half-rank, H = half the ranks, m = per-pipe count)


def _main_step(h: int, halves: int, per_pipe: int) -> list[Token]:
    """Step 4, nF0&B1 F1&B0; the middle ranks do not overlap their first F0 with B1."""
    count = per_pipe - 2 * halves + h + 1
    first: list[Token] = [F0, B1] if h == halves - 1 else [Pair(0, 1)]
    return first + [Pair(1, 0)] + [Pair(0, 1), Pair(1, 0)] * (count - 1)


def _drain_step(h: int) -> list[Token]:
    """Step 6, nB1B0: zero bubble (I) from iteration (h+1)//2, before B1 if h odd, else B0."""
    switch = (h + 1) // 2
    ops: list[Token] = []
    for i in range(h + 1):
        zb1 = i > switch or (i == switch and h % 2 == 1)
        zb0 = i >= switch
        ops += [I1 if zb1 else B1, I0 if zb0 else B0]
    return ops


def dualpipe_steps(h: int, halves: int, per_pipe: int) -> list[Token]:
    """DeepSeek's eight DualPipe steps for one rank, as issue 2 §6 states them."""
    rest = halves - h - 1
    ops: list[Token] = [F0] * (2 * rest)  # 1: nF0
    ops += [F0, F1] * (h + 1)  # 2: nF0F1
    ops += [I1, W, F1] * rest  # 3: nI1 W F1
    ops += _main_step(h, halves, per_pipe)  # 4: nF0&B1 F1&B0
    ops += [B1, Pair(1, 0)] * rest  # 5: nB1 F1&B0
    ops += _drain_step(h)  # 6: nB1B0
    ops += [W, I0] * rest  # 7: nW I0
    ops += [W] * (h + 1)  # 8: nW
    return ops


def _dualpipe_layout(rank: int, ranks: int, microbatches: int) -> Layout:
    """Chunk 0 is the pipe in which the rank lies in the first half; pipe 1 runs reversed."""
    second_half = int(rank >= ranks // 2)
    stages, first = [], []
    for chunk in (0, 1):
        pipe = chunk ^ second_half
        stages.append(rank if pipe == 0 else ranks - 1 - rank)
        first.append(0 if pipe == 0 else microbatches // 2)
    return Layout(stages=tuple(stages), first_mb=tuple(first))


def expected_dualpipe(ranks: int, microbatches: int) -> Order:
    """DualPipe (P even, M even, M >= 2P), every rank."""
    order = []
    for rank in range(ranks):
        h = min(rank, ranks - 1 - rank)
        tokens = dualpipe_steps(h, ranks // 2, microbatches // 2)
        order.append(_number(tokens, _dualpipe_layout(rank, ranks, microbatches)))
    return order


def expected_dualpipev(ranks: int, microbatches: int) -> Order:
    """DualPipeV: the same steps with r, P, M for h, H, M/2; chunk 1 = stage 2P-1-r."""
    order = []
    for rank in range(ranks):
        layout = Layout(stages=(rank, 2 * ranks - 1 - rank), first_mb=(0, 0))
        order.append(_number(dualpipe_steps(rank, ranks, microbatches), layout))
    return order


# ---------------------------------------------------------------------------------------------
# Single-chunk schedules: ZB-H1, ZB-H2 (our derived form), canonical 1F1B; rank r = stage r


def _single(rank: int) -> Layout:
    return Layout(stages=(rank,), first_mb=(0,))


def _zero_bubble(warmup: int, paired: int, microbatches: int) -> list[Token]:
    """F×warmup, (I F)×paired, (I W F)×rest, (I W)×warmup, W×paired (rest = M-warmup-paired)."""
    rest = microbatches - warmup - paired
    ops: list[Token] = [F0] * warmup
    ops += [I0, F0] * paired + [I0, W, F0] * rest
    return ops + [I0, W] * warmup + [W] * paired


def expected_zb_h1(ranks: int, microbatches: int) -> Order:
    """ZB-H1: rank r = F×(P-r), (I F)×r, (I W F)×(M-P), (I W)×(P-r), W×r."""
    return [
        _number(_zero_bubble(ranks - rank, rank, microbatches), _single(rank))
        for rank in range(ranks)
    ]


def expected_zb_h2(ranks: int, microbatches: int) -> Order:
    """ZB-H2: rank r = F×(2P-2r-1), (I F)×2r, (I W F)×(M-2P+1), (I W)×(2P-2r-1), W×2r."""
    return [
        _number(_zero_bubble(2 * ranks - 2 * rank - 1, 2 * rank, microbatches), _single(rank))
        for rank in range(ranks)
    ]


def expected_1f1b(ranks: int, microbatches: int) -> Order:
    """Canonical 1F1B: min(P-1-r, M) warm-up forwards, then one F one B, then the rest B."""
    order = []
    for rank in range(ranks):
        warmup = min(ranks - 1 - rank, microbatches)
        tokens = [F0] * warmup + [F0, B0] * (microbatches - warmup) + [B0] * warmup
        order.append(_number(tokens, _single(rank)))
    return order


# ---------------------------------------------------------------------------------------------
# Comparison


def _first_difference(got: list[Op], expected: list[Op]) -> int:
    for pos, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return pos
    return min(len(got), len(expected))


def assert_same_order(schedule: str, ranks: int, microbatches: int, expected: Order) -> None:
    """Compile the bundled schedule and compare every rank's compute order op for op."""
    got = compute_order(compile_bundled(schedule, ranks, microbatches))
    assert len(got) == len(expected), f"{schedule} P={ranks} M={microbatches}: rank count"
    for rank, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        if ours != theirs:
            pos = _first_difference(ours, theirs)
            pytest.fail(
                f"{schedule} P={ranks} M={microbatches} rank {rank}, op {pos}: "
                f"pipecc {ours[pos : pos + 3]} vs rule {theirs[pos : pos + 3]} "
                f"(lengths {len(ours)} vs {len(theirs)})"
            )


def _dualpipe_sizes() -> list[tuple[int, int]]:
    sizes: list[tuple[int, int]] = []
    for ranks in (2, 4, 6, 8):
        counts = [*range(2 * ranks, 4 * ranks + 1, 2), 6 * ranks, 8 * ranks]
        sizes.extend((ranks, m) for m in counts)
    return sizes


def _dualpipev_sizes() -> list[tuple[int, int]]:
    sizes: list[tuple[int, int]] = []
    for ranks in range(1, 9):
        counts = [*range(2 * ranks, 4 * ranks + 1), 6 * ranks + 1]
        sizes.extend((ranks, m) for m in counts)
    return sizes


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize(("ranks", "microbatches"), _dualpipe_sizes())
def test_dualpipe_follows_the_eight_steps(ranks: int, microbatches: int) -> None:
    assert_same_order("dualpipe", ranks, microbatches, expected_dualpipe(ranks, microbatches))


@pytest.mark.parametrize(("ranks", "microbatches"), _dualpipev_sizes())
def test_dualpipev_follows_the_eight_steps(ranks: int, microbatches: int) -> None:
    assert_same_order("dualpipev", ranks, microbatches, expected_dualpipev(ranks, microbatches))


@pytest.mark.parametrize("ranks", range(2, 9))
def test_zb_h1_pattern(ranks: int) -> None:
    for microbatches in range(ranks, 4 * ranks + 1):
        assert_same_order("zb_h1", ranks, microbatches, expected_zb_h1(ranks, microbatches))


@pytest.mark.parametrize("ranks", range(2, 9))
def test_zb_h2_pattern(ranks: int) -> None:
    for microbatches in range(2 * ranks - 1, 4 * ranks + 1):
        assert_same_order("zb_h2", ranks, microbatches, expected_zb_h2(ranks, microbatches))


@pytest.mark.parametrize("ranks", range(2, 9))
def test_1f1b_canonical(ranks: int) -> None:
    for microbatches in range(1, 4 * ranks + 1):
        assert_same_order("1f1b", ranks, microbatches, expected_1f1b(ranks, microbatches))


def _activation_peak(order: list[Op]) -> int:
    """Peak live activations: +1 per F, -1 per full B or W (an I frees nothing whole)."""
    live = peak = 0
    for op in order:
        kinds = [op[1][0], op[2][0]] if op[0] == "OVERLAP" else [op[0]]
        for kind in kinds:
            live += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("ranks", range(2, 9))
def test_zb_activation_peaks(ranks: int) -> None:
    for microbatches in (2 * ranks - 1, 2 * ranks, 4 * ranks):
        h2 = compute_order(compile_bundled("zb_h2", ranks, microbatches))
        assert _activation_peak(h2[0]) == 2 * ranks - 1, f"ZB-H2 P={ranks} M={microbatches}"
        assert max(map(_activation_peak, h2)) == 2 * ranks - 1
        h1 = compute_order(compile_bundled("zb_h1", ranks, microbatches))
        assert _activation_peak(h1[0]) == ranks, f"ZB-H1 P={ranks} M={microbatches}"


def _shift_forwards(order: list[Op], by: int) -> list[Op]:
    return [
        (kind, stage, mb + by) if kind == "F" else (kind, stage, mb) for kind, stage, mb in order
    ]


def _torch_compute_ops(actions: list[Any]) -> list[Op]:
    """torch actions -> ("F", stage, mb), dropping idle slots and REDUCE_GRAD."""
    ops = []
    for action in actions:
        if action is not None and action.computation_type.value in ("F", "B", "I", "W"):
            ops.append((action.computation_type.value, action.stage_index, action.microbatch_index))
    return ops


def test_torch_1f1b_differs_only_by_the_last_rank_bug() -> None:
    """torch's Schedule1F1B.pipeline_order drops the last rank's F0 (its forwards run 1..M)."""
    oracle = pytest.importorskip("torch_oracle")
    for ranks in range(2, 9):
        for microbatches in range(ranks, 4 * ranks + 1):
            bare = oracle.bare_schedule("Schedule1F1B", ranks, microbatches, 1)
            raw = bare._get_pipeline_order()
            theirs = [_torch_compute_ops(raw[rank]) for rank in range(ranks)]
            ours = expected_1f1b(ranks, microbatches)
            assert theirs[:-1] == ours[:-1], f"P={ranks} M={microbatches}"
            last = theirs[-1]
            assert ("F", ranks - 1, 0) not in last
            assert last == _shift_forwards(ours[-1], 1), f"P={ranks} M={microbatches}"


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches"),
    [("dualpipe", 3, 6), ("dualpipe", 4, 9), ("dualpipe", 4, 6), ("dualpipev", 4, 7)],
)
def test_dualpipe_rejects_what_deepseek_rejects(
    schedule: str, ranks: int, microbatches: int
) -> None:
    """DualPipe needs P even, M even, M >= 2P; DualPipeV needs M >= 2P."""
    with pytest.raises(ScheduleError):
        compile_bundled(schedule, ranks, microbatches)


def test_oracles_are_complete() -> None:
    """Each oracle runs every (stage, mb) exactly once per kind: F, then B or I (+ W)."""
    cases = [
        (expected_dualpipe, 8, 20, 20),
        (expected_dualpipev, 4, 9, 18),
        (expected_zb_h2, 4, 8, 8),
        (expected_zb_h1, 4, 8, 8),
        (expected_1f1b, 4, 3, 3),
    ]
    for oracle, ranks, microbatches, per_rank in cases:
        for order in oracle(ranks, microbatches):
            flat = [x for op in order for x in (op[1:] if op[0] == "OVERLAP" else [op])]
            forwards = sorted(op[1:] for op in flat if op[0] == "F")
            backwards = sorted(op[1:] for op in flat if op[0] in ("B", "I"))
            weights = sorted(op[1:] for op in flat if op[0] == "W")
            inputs = sorted(op[1:] for op in flat if op[0] == "I")
            assert len(set(forwards)) == len(forwards) == per_rank
            assert forwards == backwards
            assert weights == inputs
