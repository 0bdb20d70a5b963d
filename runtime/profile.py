"""Measured costs: per-(stage, op) durations and message sizes, written as a cost file.

A `Recorder` collects, on one rank during real steps, the wall time of every compute
instruction and the post/complete times and sizes of every message. `write_cost_file` merges
the records of all ranks into the simulator's TOML cost format (DESIGN §6):

    [cost]            unit = "ms"; F, B, I, W, FB, FI (ms); comm (ms per message);
                      bytes (per message)
    [cost.stage.N]    the same durations measured on stage N alone

Stage N is the `stage` of the program (pipe 0's numbering); with two pipes (DualPipe) stage N
of both pipes is one model stage and their samples are merged. A fused op is recorded as FB
(F&B) or FI (F&I) under the stage of its forward, as the simulator looks it up. Every figure
is the median of its samples.

`comm` is a latency: from the post of a send to the completion of the matching receive, taken
only from messages whose receiver was already waiting when the send was posted (otherwise
the completion time says when the receiver arrived, not when the data did); if no message
qualifies, the median of completion − max(send post, receiver's wait) is used. Ranks of
`pipecc run` share one host, so their monotonic clocks agree.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MessageKey = tuple[str, int, int, int]  # (what, pipe, receiving stage, mb)
KEYS = ("F", "B", "I", "W", "FB", "FI")


@dataclass
class Recorder:
    """What one rank measured; plain data so that it can be pickled to the launcher."""

    step: int = 0
    computes: list[tuple[str, int, float]] = field(default_factory=list)  # (kind, stage, s)
    sends: list[tuple[int, MessageKey, float, int]] = field(default_factory=list)
    recvs: list[tuple[int, MessageKey, float, float, int]] = field(default_factory=list)

    def compute(self, kind: str, stage: int, seconds: float) -> None:
        self.computes.append((kind, stage, seconds))

    def send(self, key: MessageKey, posted: float, nbytes: int) -> None:
        self.sends.append((self.step, key, posted, nbytes))

    def recv(self, key: MessageKey, wait_start: float, done: float, nbytes: int) -> None:
        self.recvs.append((self.step, key, wait_start, done, nbytes))


def _median_ms(samples: Iterable[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def compute_costs(records: list[Recorder]) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """Median durations (ms) per op kind, overall and per stage."""
    overall: dict[str, list[float]] = defaultdict(list)
    staged: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        for kind, stage, seconds in record.computes:
            overall[kind].append(seconds)
            staged[stage][kind].append(seconds)
    top = {k: _median_ms(overall[k]) for k in KEYS if overall[k]}
    per_stage = {
        stage: {k: _median_ms(kinds[k]) for k in KEYS if kinds[k]}
        for stage, kinds in sorted(staged.items())
    }
    return top, per_stage


def comm_costs(records: list[Recorder]) -> dict[str, float]:
    """Latency per message (ms) and bytes per message, from matched send/recv records."""
    posted = {(step, key): (t, n) for r in records for step, key, t, n in r.sends}
    clean: list[float] = []
    fallback: list[float] = []
    sizes: list[int] = []
    for record in records:
        for step, key, wait_start, done, nbytes in record.recvs:
            sizes.append(nbytes)
            if (step, key) not in posted:
                continue
            send_time, _ = posted[(step, key)]
            if wait_start <= send_time:
                clean.append(done - send_time)
            fallback.append(max(done - max(send_time, wait_start), 0.0))
    result: dict[str, float] = {}
    if clean or fallback:
        result["comm"] = _median_ms(clean or fallback)
    if sizes:
        result["bytes"] = int(statistics.median(sizes))
    return result


def render_cost_file(records: list[Recorder], header: str) -> str:
    """The TOML text: a comment header, `[cost]`, then `[cost.stage.N]` tables."""
    top, per_stage = compute_costs(records)
    top.update(comm_costs(records))
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += ["", "[cost]", 'unit = "ms"', *_table(top)]
    for stage, costs in per_stage.items():
        lines += ["", f"[cost.stage.{stage}]", *_table(costs)]
    return "\n".join(lines) + "\n"


def _table(values: dict[str, float]) -> list[str]:
    return [f"{key} = {value}" for key, value in values.items()]


def write_cost_file(path: Path, records: list[Recorder], header: str) -> None:
    path.write_text(render_cost_file(records, header), encoding="utf-8")
