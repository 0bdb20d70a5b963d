"""Split backward: is I + W as cheap as B? (target: I + W ≤ 1.10 × B at H=512 and on a GPT block)

    .venv/bin/python benchmarks/split_backward.py [--device cuda] [--rounds 15] [--profile DIR]

Two stages, one thread, a middle stage in both (its input needs a gradient):

* `mlp`: 4 blocks of Linear(H, H)+GELU on 32 rows, H = 16 (the fixed cost), 512, 1024, 2048;
* `gpt`: one pre-LN transformer block of examples/gpt.py (causal SDPA attention through
  Linear projections, GELU MLP), width D, 4 rows of 64 tokens.

A round steps three copies of the stage with the same weights, in turn, 4 microbatches
each, gradients zeroed first as in training, every forward first, then every backward:

* `B`: a plain forward, then `full_backward` per microbatch;
* `walk`: a plain forward; every I (`input_backward`: graph walk, anchor hooks, the
  input-gradient pass), then every W (the anchors' weight-gradient passes) — the general
  method, what every chunk got before the contract;
* `contract`: the forward inside `capturing()`; every I (one engine call, the contracted
  Linears defer their input and output gradient), then every W (one matmul and one sum per
  Linear, no engine) — what a chunk of Linear-based modules gets now.

Statistic: for each variant the median over the rounds of its per-microbatch backward time
(ms); each ratio is the median over the rounds of that round's ratio (the variants of a
round run back to back, so the ratio is paired against the same load). `F cap/plain`
is the same statistic for the forward: the price of the capture, paid in F.

The tables are printed twice on CPU: with glibc malloc as it is ("default", the target) and
with its mmap and trim thresholds raised, as `pipecc run` starts its ranks ("tuned",
docs/performance.md). `--profile DIR` writes a torch.profiler table of B and of the
contract's I and W for the mlp at H=512 and the GPT block (the aten ops' self CPU time).
"""

from __future__ import annotations

import argparse
import copy
import os
import runpy
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipecc.runtime.engine.split_backward import full_backward, input_backward  # noqa: E402
from pipecc.runtime.engine.weight_contract import Capture, capturing  # noqa: E402

ROWS = 32
BLOCKS = 4
MICROBATCHES = 4
GPT_ROWS, GPT_TOKENS, GPT_HEADS = 4, 64, 4
# glibc malloc returns blocks of MBs to the OS at once and faults them in again at the next
# allocation; W allocates one weight-gradient block per Linear.
TUNED = "MALLOC_MMAP_THRESHOLD_"
MALLOC_TUNING = {TUNED: str(1 << 28), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
VARIANTS = ("B", "walk", "contract")


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Stage:
    """One stage to time: a module, its microbatches and the output gradient."""

    def __init__(self, name: str, module: nn.Module, xs: list[torch.Tensor]) -> None:
        self.name = name
        self.copies = {v: copy.deepcopy(module) for v in VARIANTS}
        self.ids = {v: {id(p) for p in m.parameters()} for v, m in self.copies.items()}
        self.xs = xs
        self.g = torch.randn_like(xs[0])


def mlp(hidden: int, device: torch.device) -> Stage:
    torch.manual_seed(0)
    layers = [m for _ in range(BLOCKS) for m in (nn.Linear(hidden, hidden), nn.GELU())]
    xs = [torch.randn(ROWS, hidden, device=device) for _ in range(MICROBATCHES)]
    return Stage(f"mlp H={hidden}", nn.Sequential(*layers).to(device), xs)


def gpt(dim: int, device: torch.device) -> Stage:
    gpt_file = runpy.run_path(str(ROOT / "examples" / "gpt.py"))
    config = gpt_file["GPTConfig"](dim=dim, heads=GPT_HEADS, seq=GPT_TOKENS, dropout=0.0)
    torch.manual_seed(0)
    block = gpt_file["Block"](config).to(device)
    xs = [torch.randn(GPT_ROWS, GPT_TOKENS, dim, device=device) for _ in range(MICROBATCHES)]
    return Stage(f"gpt D={dim}", block, xs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(stage: Stage, variant: str) -> tuple[float, float]:
    """One step of one variant: ms per microbatch in the forwards and in the backwards."""
    module, ids, g = stage.copies[variant], stage.ids[variant], stage.g
    capture = Capture() if variant == "contract" else None
    module.zero_grad(set_to_none=True)
    leaves = [x.detach().requires_grad_(True) for x in stage.xs]
    sync(g.device)
    start = time.perf_counter()
    with capturing(module, capture) if capture is not None else nullcontext():
        graphs = [(leaf, module(leaf)) for leaf in leaves]
    sync(g.device)
    middle = time.perf_counter()
    if variant == "B":
        for leaf, out in graphs:
            full_backward((out,), (g,), (leaf,))
    else:
        pending = [input_backward((out,), (g,), (leaf,), ids, capture)[1] for leaf, out in graphs]
        for weight in pending:
            weight.run()
    sync(g.device)
    end = time.perf_counter()
    return (middle - start) * 1e3 / MICROBATCHES, (end - middle) * 1e3 / MICROBATCHES


def measure(stage: Stage, rounds: int) -> dict[str, float]:
    """Medians over rounds (see the module docstring), after two warm-up rounds."""
    fwd: dict[str, list[float]] = {v: [] for v in VARIANTS}
    bwd: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for index in range(rounds + 2):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]  # alternate who goes first
        for variant in order:
            f, b = step(stage, variant)
            if index >= 2:
                fwd[variant].append(f)
                bwd[variant].append(b)
    result = {v: statistics.median(bwd[v]) for v in VARIANTS}
    for v in ("walk", "contract"):
        result[v + "/B"] = paired(bwd[v], bwd["B"])
    result["F"] = paired(fwd["contract"], fwd["B"])
    return result


def paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def stages(device: torch.device) -> list[Callable[[], Stage]]:
    found: list[Callable[[], Stage]] = [
        lambda h=h: mlp(h, device)  # type: ignore[misc]
        for h in (16, 512, 1024, 2048)
    ]
    return found + [lambda d=d: gpt(d, device) for d in (256, 512)]  # type: ignore[misc]


def table(device: torch.device, rounds: int) -> None:
    allocator = "tuned" if TUNED in os.environ else "default"
    for make in stages(device):
        stage = make()
        r = measure(stage, rounds)
        print(f"{device.type:6} {allocator:9} {stage.name:12} {r['B']:8.3f} {r['walk']:8.3f} "
              f"{r['walk/B']:7.3f} {r['contract']:8.3f} {r['contract/B']:7.3f} "
              f"{r['F']:11.3f}", flush=True)  # fmt: skip


def matmul_counts(device: torch.device) -> str:
    stage = mlp(64, device)
    counts = {k: CountOps() for k in ("B", "walk I", "walk W", "contract I", "contract W")}
    x = stage.xs[0].detach().requires_grad_(True)
    with counts["B"]:
        full_backward((stage.copies["B"](x),), (stage.g,), (x,))
    for variant in ("walk", "contract"):
        module = stage.copies[variant]
        capture = Capture() if variant == "contract" else None
        with capturing(module, capture) if capture is not None else nullcontext():
            out = module(x)
        with counts[f"{variant} I"]:
            _, weight = input_backward((out,), (stage.g,), (x,), stage.ids[variant], capture)
        with counts[f"{variant} W"]:
            weight.run()
    return ", ".join(f"{k} {c.ops['mm']}" for k, c in counts.items())


def profile(stage: Stage, folder: Path, steps: int = 10) -> None:
    """torch.profiler over `steps` rounds of B then the contract (2 untimed rounds first);
    each microbatch's backward is labelled B, I or W, and every aten op's self CPU time is
    summed under its label, so the weight-gradient matmuls of W can be set beside the same
    matmuls inside B (same kernels, same shapes, same counts)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(2):
        step(stage, "B")
        step(stage, "contract")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            labelled_step(stage, "B", record_function)
            labelled_step(stage, "contract", record_function)
    totals: dict[tuple[str, str], list[float]] = {}
    for event in prof.events():
        if event.name in ("F", "F captured", "B", "I", "W"):
            stack = list(event.cpu_children)
            while stack:
                child = stack.pop()
                total = totals.setdefault((event.name, child.name), [0, 0.0])
                total[0] += 1
                total[1] += child.self_cpu_time_total
                stack.extend(child.cpu_children)
    calls = steps * MICROBATCHES
    lines = [f"{stage.name}: aten self CPU time per microbatch (µs), {steps} rounds, "
             f"allocator {'tuned' if TUNED in os.environ else 'default'}",
             f"{'label':10} {'op':36} {'calls':>6} {'µs':>9} {'µs/call':>9}"]  # fmt: skip
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])
    for (label, op), (count, micros) in ranked:
        if micros / calls >= 2.0:
            lines.append(f"{label:10} {op:36} {count / calls:6.1f} {micros / calls:9.1f} "
                         f"{micros / count:9.1f}")  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stage.name.replace(' ', '_').replace('=', '')}.txt").write_text(text + "\n")


def labelled_step(stage: Stage, variant: str, label: Callable[[str], object]) -> None:
    module, g = stage.copies[variant], stage.g
    module.zero_grad(set_to_none=True)
    leaves = [x.detach().requires_grad_(True) for x in stage.xs]
    forward = "F captured" if variant == "contract" else "F"
    capture = Capture() if variant == "contract" else None
    with label(forward), capturing(module, capture) if capture is not None else nullcontext():  # type: ignore[attr-defined]
        graphs = [(leaf, module(leaf)) for leaf in leaves]
    if variant == "B":
        for leaf, out in graphs:
            with label("B"):  # type: ignore[attr-defined]
                full_backward((out,), (g,), (leaf,))
        return
    pending = []
    for leaf, out in graphs:
        with label("I"):  # type: ignore[attr-defined]
            pending.append(input_backward((out,), (g,), (leaf,), stage.ids[variant], capture)[1])
    for weight in pending:
        with label("W"):  # type: ignore[attr-defined]
            weight.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", type=Path, help="write torch.profiler tables here")
    parser.add_argument("--table-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    if args.profile:
        for stage in (mlp(512, device), gpt(256, device)):
            profile(stage, args.profile)
        return
    if not args.table_only:
        print(f"matmuls for {BLOCKS} Linear layers: {matmul_counts(device)}")
        print(f"statistic: median over {args.rounds} rounds (ms per microbatch, backward only); "
              "ratios: median over the rounds of the round's ratio")  # fmt: skip
        print(f"{'device':6} {'allocator':9} {'stage':12} {'B ms':>8} {'walk ms':>8} "
              f"{'walk/B':>7} {'I+W ms':>8} {'I+W/B':>7} {'F cap/plain':>11}",
              flush=True)  # fmt: skip
    table(device, args.rounds)
    if device.type == "cpu" and TUNED not in os.environ:  # again, with glibc malloc tuned
        env = dict(os.environ, **MALLOC_TUNING)
        command = [sys.executable, __file__, "--table-only", "--rounds", str(args.rounds)]
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
