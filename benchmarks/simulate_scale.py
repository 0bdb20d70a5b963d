"""Simulation time at scale: pipecc's timed replay vs torch's `_simulate_comms_compute`.

    .venv/bin/python benchmarks/simulate_scale.py                       # P=64, M=1024, V=2
    .venv/bin/python benchmarks/simulate_scale.py --torch-microbatches 256

For DualPipeV, interleaved 1F1B and ZB-V it compiles the schedule (not timed), then times
`pipecc.simulate.timeline.simulate` with costs F=1, B=2, I=1, W=1 under the nccl model: the replay,
and the per-rank figures (busy, idle, stalls, peak memory). It prints the makespan and bubble
ratio next to the time, and pipecc's scaling from M/4 to M. torch's simulator decides only
eager semantics with unit steps and no durations; it runs on the schedule torch itself builds
(its generator and lowering, not timed); it cannot replay DualPipeV's fused ops, so the
comparison is on interleaved 1F1B and ZB-V. Ratios are measured in the same run.
"""

from __future__ import annotations

from scale import compile_case, median_time, parse_args, run
from torch_baseline import TORCH_CANNOT, torch_lowered, torch_simulate

from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import Timeline, simulate

CASES = (("dualpipev", {}), ("interleaved_1f1b", {"V": 2}), ("zbv", {}))
# torch's simulator rejects fused OVERLAP_F_B actions, so it cannot replay DualPipeV
# (DESIGN §6): the torch comparison runs on interleaved 1F1B and ZB-V.
COSTS = parse_cost_flag("F=1,B=2,I=1,W=1")


def _time_simulate(
    name: str, defines: dict[str, int], ranks: int, microbatches: int, repeat: int
) -> tuple[float, Timeline, int]:
    program = compile_case(name, defines, ranks, microbatches)
    seconds, timeline = median_time(repeat, lambda: simulate(program, COSTS))
    return seconds, timeline, program.num_instructions()


def main() -> None:
    args = parse_args(__doc__)
    P, M = args.ranks, args.microbatches
    print(f"simulate at P={P}, M={M}, costs F=1,B=2,I=1,W=1, nccl (median of {args.repeat})")
    for name, defines in CASES:
        seconds, timeline, count = _time_simulate(name, defines, P, M, args.repeat)
        print(
            f"  {name:18s} pipecc {seconds:6.2f} s  {count:>9,} instructions  makespan "
            f"{timeline.makespan:g}  bubble {timeline.bubble_ratio:.4f}"
        )
        quarter, _, _ = _time_simulate(name, defines, P, M // 4, args.repeat)
        print(f"  {'':18s} scaling M/4 → M: ×{seconds / quarter:.2f} time (linear: ×4)")
        if args.skip_torch:
            continue
        if name in TORCH_CANNOT:
            print(f"  {'':18s} torch  -- ({TORCH_CANNOT[name]})")
            continue
        tm = args.torch_microbatches or M
        _, lowered, mapping, stages = torch_lowered(name, P, tm)
        torch_seconds, steps = torch_simulate(lowered, mapping, stages)
        ours = seconds if tm == M else _time_simulate(name, defines, P, tm, args.repeat)[0]
        print(
            f"  {'':18s} torch  {torch_seconds:6.2f} s at M={tm} ({steps} unit steps)  "
            f"→ torch / pipecc = {torch_seconds / ours:.1f}×"
        )


if __name__ == "__main__":
    run(main)
