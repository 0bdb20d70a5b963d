"""Compile time at scale: pipecc vs torch.distributed.pipelining's generator + lowering.

    .venv/bin/python benchmarks/compile_scale.py                 # P=64, M=1024, V=2
    .venv/bin/python benchmarks/compile_scale.py --torch-microbatches 256   # quicker torch

For DualPipeV and interleaved 1F1B it prints pipecc's compile time (.sched → lowered
program with every send, recv and wait), its instructions per second, the whole command
`pipecc compile NAME -P P -M M -o x.json` (the file written, as the CLI resolves its input;
wall and this process's CPU time, the steadier figure on a shared machine) with its own
scaling, the time torch takes
to build `pipeline_order_with_comms` for the same schedule (its generator, then the lowering
`_PipelineScheduleRuntime` runs: `_add_unshard_reshard`, `_add_reduce_grad`,
`_add_send_recv`), and the ratio; then pipecc's scaling from M/4 to M microbatches (linear
means ×4; the target is ≤ ×4.5). Machines are noisy: compare the ratios, measured in one run.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

from scale import ROOT, compile_case, median_time, parse_args, run
from torch_baseline import torch_lowered

from pipecc.cli import main as pipecc

CASES = (("dualpipev", {}), ("interleaved_1f1b", {"V": 2}))


def _pipecc(
    name: str, defines: dict[str, int], ranks: int, microbatches: int, repeat: int
) -> tuple[float, int]:
    seconds, program = median_time(repeat, lambda: compile_case(name, defines, ranks, microbatches))
    return seconds, program.num_instructions()


def _command(
    name: str, defines: dict[str, int], ranks: int, microbatches: int, repeat: int
) -> tuple[float, float]:
    """The median wall and CPU time of `pipecc compile` writing the program to a .json file
    (on a shared machine the CPU time of this one process is the steadier figure)."""
    cpu: list[float] = []
    flags = [arg for key, value in defines.items() for arg in ("-D", f"{key}={value}")]
    path = str(ROOT / "schedules" / f"{name}.sched")
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "x.json")
        argv = ["compile", path, "-P", str(ranks), "-M", str(microbatches), *flags, "-o", out]

        def once() -> int:
            start = time.process_time()
            with contextlib.redirect_stdout(io.StringIO()):
                code = pipecc(argv)
            cpu.append(time.process_time() - start)
            assert code == 0, f"pipecc {' '.join(argv)}: exit {code}"
            return code

        seconds, _ = median_time(repeat, once)
    return seconds, statistics.median(cpu)


def main() -> None:
    args = parse_args(__doc__, torch_help="run torch at this M instead (it is quadratic in M)")
    P, M = args.ranks, args.microbatches
    compile_case("1f1b", {}, 2, 2)  # warm-up
    print(f"compile at P={P}, M={M} (median of {args.repeat})")
    for name, defines in CASES:
        seconds, count = _pipecc(name, defines, P, M, args.repeat)
        print(
            f"  {name:18s} pipecc {seconds:7.2f} s  {count:>9,} instructions  "
            f"{count / seconds / 1e6:5.2f} M instr/s"
        )
        quarter, _ = _pipecc(name, defines, P, M // 4, args.repeat)
        print(f"  {'':18s} scaling M/4 → M: ×{seconds / quarter:.2f} time (linear: ×4)")
        (wall, cpu), (wall_4, cpu_4) = (
            _command(name, defines, P, m, args.repeat) for m in (M, M // 4)
        )
        print(
            f"  {'':18s} pipecc compile -o x.json: {wall:.2f} s ({cpu:.2f} s CPU), "
            f"M/4 → M: ×{wall / wall_4:.2f} (×{cpu / cpu_4:.2f} CPU)"
        )
        if args.skip_torch:
            continue
        tm = args.torch_microbatches or M
        torch_seconds, lowered, _, _ = torch_lowered(name, P, tm)
        torch_count = sum(len(actions) for actions in lowered.values())
        ours = seconds if tm == M else _pipecc(name, defines, P, tm, args.repeat)[0]
        print(
            f"  {'':18s} torch  {torch_seconds:7.2f} s  {torch_count:>9,} actions at M={tm}"
            f"  → torch / pipecc = {torch_seconds / ours:.1f}×"
        )


if __name__ == "__main__":
    run(main)
