"""Expert-parallel overlap: how much all-to-all time does DualPipe's interleave hide?
(targets: exposed a2a overlapped / sequential <= 0.3; each step predicted within 15%)

    .venv/bin/python benchmarks/ep_overlap.py [--rounds 7] [--microbatches 24]
        [--size DIM,HIDDEN,TOKENS ...] [--device cpu|cuda]

PP=2 x EP=2 on 4 processes, `init_device_mesh(device, (2, 2), ("pp", "ep"))`: gloo on CPU,
NCCL with one GPU per rank (`--device cuda`). Every stage is a `MoEStage` of two `MoEBlock`s
(a dense sublayer standing in for attention, dim -> 2·dim -> dim: attention's 4·dim²
multiply-adds per token of its Q, K, V and output projections; a top-2 router over 4
experts; experts dim -> hidden -> dim); the last stage's loss is the mean squared error. Each router
is balanced once, before the run, by an offset of its logits fitted on a calibration batch
(DeepSeek-V3's balancing bias): a trained router spreads its tokens evenly, and an EP rank
that waits for a peer with more tokens waits for compute, which no overlap can hide.

For DualPipeV and DualPipe (P=2, M microbatches) the program is what `pipecc run <schedule>
--mesh ep=2 --moe 2` resolves and verifies on this backend, in two forms: *overlapped* (each
fused F&B as DualPipe's interleave, each all-to-all posted async while the other half
computes) and *sequential* (`--moe-overlap off`: the fused op's halves one after the other,
every all-to-all blocking). One process group runs both, alternating: a round is one step
of each, in turn, after a warm-up step each.

Measured per rank and step: the seconds its compute thread blocked on all-to-alls
(`MoEOps.waited`: the waits of the async ones, the blocking ones whole) and the step's wall
time; beside them the seconds the poster thread spent exchanging the dispatches' token
counts (`MoEOps.counted`: not exposed to the compute thread unless a wait covers it). On
CUDA the waits are host time (a wait queues the stream's wait on the host and returns): the
step times are the figure there.

The prediction: two more steps of the sequential form are profiled (what `pipecc run
--profile` records: every phase and all-to-all; runtime/profiling/moe_costs.py) and written
as a cost file (F, B, I, W of each stage, `a2a`, `moe_experts`, `comm` calibrated as the run
does); `pipecc simulate` replays both forms of the whole mesh under it. Printed beside the
measured medians: the predicted step and exposed a2a of each form, and the step's error.

The size: the script steps the sequential DualPipeV program once at each candidate size and
keeps the largest whose all-to-alls are at least 15% of that step (printed, with every
candidate's share), so that there is something to hide on this machine and each phase is
long against the scheduler's time slice (4 ranks share 2 cores here: a rank descheduled
for a slice holds its EP peer's all-to-all, in both forms). Statistic: per schedule and form,
the median over rounds of the mean over ranks; the ratio is the median over rounds of that
round's overlapped / sequential exposed time (beside it the part of the all-to-alls that
are blocking in both forms, those of the ops that are not fused: the least it can be), and
the last line gives the median of all rounds of both schedules.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, NamedTuple

import torch
from pipecc.runtime import MoEBlock, MoEStage, PipelineRuntime, RuntimeConfig
from pipecc.runtime.profiling.recorder import Recorder, render_cost_file
from pipecc.runtime.tools.spawn import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipecc.driver.compile import Lowering
from pipecc.driver.load import Request, RunBackend, resolve
from pipecc.driver.mesh import MeshOptions, MoeOptions, whole_mesh
from pipecc.ir.ops import Collective, CollectiveKind
from pipecc.ir.program import Program
from pipecc.semantics.costs.parse import parse_cost_text
from pipecc.simulate.timeline import simulate

SCHEDULES = ("dualpipev", "dualpipe")
FORMS = ("overlapped", "sequential")
# (dim, hidden, tokens per microbatch): candidates, smallest compute first
SIZES = ((256, 128, 512), (512, 256, 256))
EXPERTS, TOP, LAYERS = 4, 2, 2
REAL_SHARE = 0.15  # the all-to-alls' least part of the sequential step at the size picked
PROFILED = 2  # profiled steps of the sequential form, for the prediction


class Size(NamedTuple):
    dim: int
    hidden: int
    tokens: int


class Job(NamedTuple):
    rounds: int
    microbatches: int
    sizes: tuple[Size, ...]
    device: str


def stages(size: Size, count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    found: list[nn.Module] = []
    for stage in range(count):
        blocks = [
            MoEBlock(
                size.dim,
                size.hidden,
                EXPERTS,
                TOP,
                mixer=nn.Sequential(
                    nn.Linear(size.dim, 2 * size.dim), nn.GELU(), nn.Linear(2 * size.dim, size.dim)
                ),
            )  # fmt: skip
            for _ in range(LAYERS)
        ]
        tail = nn.Linear(size.dim, size.dim) if stage == count - 1 else None
        found.append(MoEStage(None, blocks, tail))
    balance(found, batch(size, 4, -1, "cpu")[0])
    return found


def balance(built: list[nn.Module], rows: torch.Tensor, rounds: int = 30) -> None:
    """Each router's logits offset so that every expert takes the same share of `rows`'
    tokens (module docstring), block after block as the tokens flow."""
    h = rows
    with torch.no_grad():
        for stage in built:
            for block in stage.moe_blocks:
                assert isinstance(block, MoEBlock)
                offset = torch.zeros(block.num_experts)
                for _ in range(rounds):
                    block.offset = offset
                    share = block.route(h).counts.float() / (h.shape[0] * block.top)
                    fair = torch.full_like(share, 1 / block.num_experts)
                    offset = offset + 0.5 * torch.log(fair / share.clamp_min(1e-3))
                block.offset = offset
                h = block(h)


def backend(job: Job) -> RunBackend:
    return RunBackend.NCCL if job.device == "cuda" else RunBackend.GLOO


def program(name: str, microbatches: int, overlap: bool, on: RunBackend) -> Program:
    """What `pipecc run name -P 2 -M microbatches --mesh ep=2 --moe 2 [--moe-overlap off]`
    resolves on `on` (and verifies before it runs it)."""
    options = MeshOptions("ep=2", moe=MoeOptions(LAYERS, overlap=overlap))
    request = Request(name, 2, microbatches, backend=on, lowering=Lowering(mesh=options))
    return resolve(request).program


def floor(name: str, microbatches: int, on: RunBackend) -> float:
    """The part of the overlapped program's all-to-alls that are blocking (those of the ops
    that are not fused): exposed in both forms, the least the ratio can be."""
    instrs = program(name, microbatches, True, on).ranks[0]
    a2a = [x for x in instrs if type(x) is Collective and x.kind is CollectiveKind.ALL_TO_ALL]
    return sum(not x.asynchronous for x in a2a) / len(a2a)


def runtime(mesh: Any, prog: Program, size: Size, device: torch.device) -> PipelineRuntime:
    built = stages(size, prog.placement.num_stages(0))
    chunks = prog.placement.chunks(mesh.get_coordinate()[0])
    modules = {slot.chunk: built[slot.stage].to(device) for slot in chunks}
    return PipelineRuntime(prog, modules, config=RuntimeConfig(mesh=mesh, device=device))


def batch(
    size: Size, microbatches: int, step: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    rows = torch.randn(microbatches * size.tokens, size.dim, generator=generator)
    return rows.to(device), torch.tanh(rows).to(device)


def timed(
    run: PipelineRuntime, data: tuple[torch.Tensor, torch.Tensor], recorder: Recorder | None = None
) -> tuple[float, float, float]:
    """(exposed all-to-all seconds, step seconds, of the first the count exchanges') of one
    step on this rank."""
    moe = run.interpreter.moe
    assert moe is not None
    for param in run.parameters():
        param.grad = None
    torch.distributed.barrier()
    before, counted, start = moe.waited, moe.counted, time.perf_counter()
    run.step(*data, recorder=recorder)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return moe.waited - before, time.perf_counter() - start, moe.counted - counted


def pick(mesh: Any, job: Job, device: torch.device) -> tuple[Size, list[tuple[Size, float]]]:
    """The largest candidate at which the all-to-alls are a real part of the sequential
    DualPipeV step (module docstring); with none, the one where they weigh most."""
    shares = []
    for size in job.sizes:
        prog = program("dualpipev", job.microbatches, False, backend(job))
        run = runtime(mesh, prog, size, device)
        data = batch(size, job.microbatches, 0, device)
        timed(run, data)
        exposed, step, _ = timed(run, data)
        share = torch.tensor([exposed / step], device=device)
        torch.distributed.all_reduce(share)
        shares.append((size, float(share) / 4))
    real = [s for s in shares if s[1] >= REAL_SHARE]
    return (real[-1] if real else max(shares, key=lambda s: s[1]))[0], shares


def worker(rank: int, world: int, job: Job) -> dict[str, Any]:
    del world
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if job.device == "cuda" else "cpu")
    mesh = init_device_mesh(job.device, (2, 2), mesh_dim_names=("pp", "ep"))
    size, shares = pick(mesh, job, device)
    found: dict[str, Any] = {"size": size, "shares": shares}
    for name in SCHEDULES:
        runs = {
            form: runtime(
                mesh, program(name, job.microbatches, form == FORMS[0], backend(job)), size, device
            )
            for form in FORMS
        }
        data = batch(size, job.microbatches, 1, device)
        for run in runs.values():
            timed(run, data)  # warm-up: the signature learned, the plans bound
        for form in runs:
            found[(name, form)] = []
        for _ in range(job.rounds):
            for form, run in runs.items():
                found[(name, form)].append(timed(run, data))
        records = [Recorder(step=i) for i in range(PROFILED)]
        for record in records:
            timed(runs["sequential"], data, record)
        found[(name, "profile")] = records
    return found


def predicted(name: str, records: list[Recorder], job: Job) -> dict[str, tuple[float, float]]:
    """Per form, the simulated (step ms, mean exposed a2a ms over ranks) of the whole mesh
    under the cost file the sequential form's profile gives (as `pipecc run --profile`
    writes it, `comm` calibrated on the profiled program)."""
    on = backend(job)
    measured, _ = whole_mesh(program(name, job.microbatches, False, on))

    def replay(text: str) -> float:
        costs = parse_cost_text(text, "the profile").for_program(measured)
        return simulate(measured, costs, model=on.comm_model).makespan

    text = render_cost_file(
        records, "ep_overlap", measured_on=program(name, job.microbatches, False, on),
        replay=replay,
    )  # fmt: skip
    found = {}
    for form in FORMS:
        whole, _ = whole_mesh(program(name, job.microbatches, form == FORMS[0], on))
        timeline = simulate(
            whole, parse_cost_text(text, "the profile").for_program(whole), model=on.comm_model
        )
        exposed = statistics.mean(r.a2a_exposed for r in timeline.ranks)
        found[form] = (timeline.step, exposed)
    return found


def report(results: list[dict[str, Any]], job: Job) -> float:
    size = results[0]["size"]
    for candidate, share in results[0]["shares"]:
        print(f"size dim={candidate.dim} hidden={candidate.hidden} tokens/mb={candidate.tokens}: "
              f"a2a {100 * share:.0f}% of the sequential DualPipeV step")  # fmt: skip
    print(f"picked dim={size.dim} hidden={size.hidden} tokens/mb={size.tokens}, "
          f"M={job.microbatches}, {job.rounds} rounds, {job.device}; per rank: mean over "
          "ranks; predicted: simulate under the sequential form's profile")  # fmt: skip
    ratios = []
    print(f"{'schedule':10} {'form':11} {'exposed a2a ms':>15} {'counts (poster)':>16} "
          f"{'step ms':>9} {'predicted step':>15} {'error':>7} {'predicted a2a':>14}")  # fmt: skip
    for name in SCHEDULES:
        rounds = {
            form: [
                tuple(statistics.mean(r[(name, form)][i][k] for r in results) for k in range(3))
                for i in range(job.rounds)
            ]
            for form in FORMS
        }
        records = [record for r in results for record in r[(name, "profile")]]
        prediction = predicted(name, records, job)
        for form, values in rounds.items():
            exposed = statistics.median(v[0] for v in values) * 1e3
            step = statistics.median(v[1] for v in values) * 1e3
            counts = statistics.median(v[2] for v in values) * 1e3
            guess, guessed_a2a = prediction[form]
            error = f"{100 * (guess - step) / step:+.0f}%"
            print(f"{name:10} {form:11} {exposed:15.1f} {counts:16.1f} {step:9.1f} "
                  f"{guess:15.1f} {error:>7} {guessed_a2a:14.1f}")  # fmt: skip
        mine = [
            o[0] / s[0] for o, s in zip(rounds[FORMS[0]], rounds[FORMS[1]], strict=True) if s[0]
        ]
        least = floor(name, job.microbatches, backend(job))
        print(f"{name:10} exposed overlapped / sequential = {statistics.median(mine):.3f} "
              f"(blocking in both forms: {least:.3f} of the all-to-alls)")  # fmt: skip
        ratios += mine
    return statistics.median(ratios)


def size_arg(text: str) -> Size:
    try:
        dim, hidden, tokens = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DIM,HIDDEN,TOKENS, got {text!r}") from None
    return Size(dim, hidden, tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--microbatches", type=int, default=24)
    parser.add_argument(
        "--size", type=size_arg, action="append", default=[], metavar="DIM,HIDDEN,TOKENS",
        help="a candidate size (repeatable; default: the built-in candidates)",
    )  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 4:
        print(f"ep overlap: needs 4 GPUs, this host has {torch.cuda.device_count()}")
        return 1
    sizes = tuple(args.size) or tuple(Size(*s) for s in SIZES)
    job = Job(args.rounds, args.microbatches, sizes, args.device)
    kind = "nccl" if args.device == "cuda" else "gloo"
    results = spawn(worker, 4, job, backend=kind, timeout=600.0, deadline=560.0)
    ratio = report(results, job)
    print(f"ep overlap: exposed a2a overlapped / sequential = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
