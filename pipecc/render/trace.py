"""A Chrome/Perfetto trace of a simulated step (opens in ui.perfetto.dev, chrome://tracing)."""

from __future__ import annotations

import json
from typing import Any

from pipecc.ir.ops import is_compute
from pipecc.ir.printer import describe, has_pipes
from pipecc.render.boxes import messages
from pipecc.simulate.timeline import Timeline


def render_trace(timeline: Timeline) -> str:
    """Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing): one process per
    rank, compute ops on thread 0, comm posts and waits on thread 1, flow arrows send→recv.
    One time unit of the cost model is written as one millisecond."""
    events: list[dict[str, Any]] = []
    for rank in range(timeline.program.num_ranks):
        events.append(
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "compute"}}
        )
        events.append(
            {"ph": "M", "pid": rank, "tid": 1, "name": "thread_name", "args": {"name": "comm"}}
        )
    pipes = has_pipes(timeline.program)
    for rank, index, instr, start, end in timeline.ops():
        if is_compute(instr):
            tid, name = 0, instr.label()
        else:
            tid, name = 1, describe(instr, pipes=pipes)
        events.append(
            {
                "ph": "X",
                "pid": rank,
                "tid": tid,
                "name": name,
                "ts": start * 1000,
                "dur": max(0.0, end - start) * 1000,
                "args": {"index": index},
            }
        )
    for flow_id, (src, sent, dst, arrived, label) in enumerate(messages(timeline)):
        events.append(
            {
                "ph": "s",
                "id": flow_id,
                "pid": src,
                "tid": 1,
                "ts": sent * 1000,
                "name": label,
                "cat": "message",
            }
        )
        events.append(
            {
                "ph": "f",
                "id": flow_id,
                "pid": dst,
                "tid": 1,
                "ts": arrived * 1000,
                "name": label,
                "cat": "message",
                "bp": "e",
            }
        )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=0) + "\n"
