"""Placement: which (pipe, stage) each (rank, chunk) holds (DESIGN §2).

A placement is a bijection between the chunks of the ranks and the stages of the pipes; the
stages of each pipe are numbered 0..S-1 in the direction data flows. The named placements are
built here; a schedule's explicit table goes through the same validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlacementError(ValueError):
    """The entries do not form a valid placement (the message says why)."""


@dataclass(frozen=True, slots=True)
class StageSlot:
    """One entry of a placement: chunk `chunk` of rank `rank` is stage `stage` of `pipe`."""

    rank: int
    chunk: int
    pipe: int
    stage: int


@dataclass(frozen=True, slots=True)
class Placement:
    """The validated placement of a program, with the lookups the passes need.

    Ensures: every rank 0..P-1 holds chunks 0..C_r-1 with C_r ≥ 1; every pipe p holds stages
    0..S_p-1, each on exactly one (rank, chunk).
    """

    name: str
    slots: tuple[StageSlot, ...]
    _by_rank: tuple[tuple[StageSlot, ...], ...] = field(init=False, repr=False, compare=False)
    _by_stage: dict[tuple[int, int], StageSlot] = field(init=False, repr=False, compare=False)
    _num_stages: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_stage: dict[tuple[int, int], StageSlot] = {}
        ranks: dict[int, dict[int, StageSlot]] = {}
        for slot in self.slots:
            key = (slot.pipe, slot.stage)
            if key in by_stage:
                other = by_stage[key]
                raise PlacementError(
                    f"stage {slot.stage} of pipe {slot.pipe} is placed twice: on rank "
                    f"{other.rank} chunk {other.chunk} and on rank {slot.rank} chunk {slot.chunk}"
                )
            if slot.chunk in ranks.setdefault(slot.rank, {}):
                raise PlacementError(f"rank {slot.rank} chunk {slot.chunk} is placed twice")
            by_stage[key] = slot
            ranks[slot.rank][slot.chunk] = slot
        num_ranks = len(ranks)
        _check_dense("rank", sorted(ranks), "placement")
        by_rank = []
        for rank in range(num_ranks):
            _check_dense("chunk", sorted(ranks[rank]), f"rank {rank}")
            by_rank.append(tuple(ranks[rank][c] for c in range(len(ranks[rank]))))
        pipes = sorted({pipe for pipe, _ in by_stage})
        _check_dense("pipe", pipes, "placement")
        num_stages = []
        for pipe in pipes:
            stages = sorted(stage for p, stage in by_stage if p == pipe)
            _check_dense("stage", stages, f"pipe {pipe}")
            num_stages.append(len(stages))
        object.__setattr__(self, "_by_rank", tuple(by_rank))
        object.__setattr__(self, "_by_stage", by_stage)
        object.__setattr__(self, "_num_stages", tuple(num_stages))

    @property
    def num_ranks(self) -> int:
        return len(self._by_rank)

    @property
    def num_pipes(self) -> int:
        return len(self._num_stages)

    def num_stages(self, pipe: int) -> int:
        return self._num_stages[pipe]

    def num_chunks(self, rank: int) -> int:
        return len(self._by_rank[rank])

    def chunks(self, rank: int) -> tuple[StageSlot, ...]:
        return self._by_rank[rank]

    def slot(self, rank: int, chunk: int) -> StageSlot:
        return self._by_rank[rank][chunk]

    def holder(self, pipe: int, stage: int) -> StageSlot:
        """The (rank, chunk) that holds `stage` of `pipe`."""
        return self._by_stage[(pipe, stage)]

    def has_chunk(self, rank: int, chunk: int) -> bool:
        return 0 <= rank < len(self._by_rank) and 0 <= chunk < len(self._by_rank[rank])

    def is_last_stage(self, pipe: int, stage: int) -> bool:
        return stage == self._num_stages[pipe] - 1

    def microbatches(self, pipe: int, num_microbatches: int) -> range:
        """The global microbatch numbers that flow through `pipe`: M split evenly over pipes,
        in pipe order (DualPipe: pipe 0 takes 0..M/2-1, pipe 1 takes M/2..M-1)."""
        per_pipe = num_microbatches // self.num_pipes
        return range(pipe * per_pipe, (pipe + 1) * per_pipe)


def _check_dense(what: str, values: list[int], where: str) -> None:
    if values != list(range(len(values))) or not values:
        raise PlacementError(f"{where}: {what} numbers must be 0..N-1, got {values}")


def loop_placement(num_ranks: int, chunks: int) -> Placement:
    """Chunk c of rank r is stage c·P + r of pipe 0 (1F1B, GPipe, interleaved)."""
    slots = tuple(
        StageSlot(rank, chunk, 0, chunk * num_ranks + rank)
        for rank in range(num_ranks)
        for chunk in range(chunks)
    )
    return Placement("loop" if chunks == 1 else f"loop({chunks})", slots)


def vshape_placement(num_ranks: int) -> Placement:
    """Chunk 0 of rank r is stage r, chunk 1 is stage 2P-1-r, of one pipe (ZB-V, DualPipeV)."""
    slots = tuple(
        StageSlot(rank, chunk, 0, rank if chunk == 0 else 2 * num_ranks - 1 - rank)
        for rank in range(num_ranks)
        for chunk in range(2)
    )
    return Placement("vshape", slots)


def bidirectional_placement(num_ranks: int) -> Placement:
    """Two pipes over P stages in opposite directions (DualPipe).

    Pipe 0 puts stage s on rank s, pipe 1 puts stage s on rank P-1-s. A rank's chunk 0 is the
    pipe in which it lies in the first half, so ranks r and P-1-r run the same program.
    """
    slots = []
    for rank in range(num_ranks):
        second_half = 2 * rank >= num_ranks
        pipes = (1, 0) if second_half else (0, 1)
        for chunk, pipe in enumerate(pipes):
            stage = rank if pipe == 0 else num_ranks - 1 - rank
            slots.append(StageSlot(rank, chunk, pipe, stage))
    return Placement("bidirectional", tuple(slots))
