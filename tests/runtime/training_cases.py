"""Cases of `add_loss` and context inputs, run inside one spawned process group per size.

Each rank runs one step of a case and compares its own chunks' gradients with a reference
it computes itself, written without pipecc's mechanism: the stages in order, each microbatch
by hand, the added losses read from an attribute the module sets (`record`) and added to
the loss before the 1/M scaling, the context passed as keywords. Functions here run in the
spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pipecc.runtime import PipelineRuntime, RuntimeConfig, add_loss, infer_boundaries
from torch import nn

from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

HIDDEN = 6
EXPERTS = 3
ROWS = 2  # rows per microbatch
TOLERANCE = 1e-6
COEF = 0.7  # the balancing loss's weight, large enough to move every gradient


class MoEBlock(nn.Module):
    """A dense soft mixture of experts whose router's balancing loss is added in place.

    `raw`: the router and experts are bare parameters (no `nn.Linear`), so a split backward
    walks the graph instead of using the Linear weight contract. `record`: keep the added
    loss in `self.added` instead of calling `add_loss` (the hand-written reference)."""

    def __init__(self, raw: bool = False) -> None:
        super().__init__()
        self.raw = raw
        self.record = False
        self.added: list[torch.Tensor] = []
        if raw:
            self.router_w = nn.Parameter(torch.randn(EXPERTS, HIDDEN) * 0.3)
            self.expert_w = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) * 0.3)
        else:
            self.router = nn.Linear(HIDDEN, EXPERTS)
            self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.raw:
            logits = x @ self.router_w.t()
            outs = [x @ self.expert_w[e].t() for e in range(EXPERTS)]
        else:
            logits = self.router(x)
            outs = [expert(x) for expert in self.experts]
        probs = logits.softmax(-1)
        out = sum(probs[:, e : e + 1] * nn.functional.gelu(o) for e, o in enumerate(outs))
        balance = COEF * EXPERTS * (probs.mean(0) ** 2).sum()
        if self.record:
            self.added.append(balance)
            return out  # type: ignore[return-value]
        return add_loss(out, balance)  # type: ignore[no-any-return]


def overlap(module0, inputs0, criterion0, labels0, loss1, outputs1, output_grads1):  # type: ignore[no-untyped-def]
    """DualPipe's hook as a user writes it: module0's forward, then module1's backward."""
    module0.hook_calls += 1
    outputs0 = [module0(*inputs0)]
    loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
    if loss1 is not None:
        loss1.backward()
    else:
        torch.autograd.backward(outputs1, output_grads1)
    return outputs0, loss0


class HookedMoE(MoEBlock):
    """A MoEBlock whose class defines DualPipe's overlap hook, and counts its calls."""

    hook_calls = 0

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):  # type: ignore[no-untyped-def]
        return overlap(module0, inputs0, criterion0, labels0, loss1, outputs1, output_grads1)


class ContextBlock(nn.Module):
    """Takes the boundary `x` and two context keywords: `gain` (float rows) and `pos`
    (integer positions into an embedding): each stage needs both, none is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.pos = nn.Embedding(4, HIDDEN)
        self.hook_calls = 0

    def forward(self, x: torch.Tensor, *, gain: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.linear(x) * gain + self.pos(pos))

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):  # type: ignore[no-untyped-def]
        return overlap(module0, inputs0, criterion0, labels0, loss1, outputs1, output_grads1)


class Plain(nn.Module):
    """Linear + GELU: a stage that adds no loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.linear(x))


def build(kind: str, count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    if kind == "mixed":  # only the even stages add a loss: ranks differ in what they report
        return [MoEBlock() if s % 2 == 0 else Plain() for s in range(count)]
    make = {
        "moe": lambda: MoEBlock(),
        "raw": lambda: MoEBlock(raw=True),
        "hooked": lambda: HookedMoE(),
        "context": lambda: ContextBlock(),
    }[kind]
    return [make() for _ in range(count)]


def batch(microbatches: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    rows = ROWS * microbatches
    x = torch.randn(rows, HIDDEN, generator=generator)
    y = torch.randn(rows, HIDDEN, generator=generator)
    gain = torch.rand(rows, 1, generator=generator) + 0.5
    pos = torch.randint(0, 4, (rows,), generator=generator)
    return x, y, {"gain": gain, "pos": pos}


@dataclass(frozen=True)
class Case:
    """`model`: moe, raw, hooked (added losses) or context (context inputs);
    boundaries: discovered by the runtime; `infer`: also declared by a function of the
    sample (the discovery's context reaches the stages it runs), `fixed`: also declared as
    fixed ones computed with the context."""

    name: str
    program: Program
    model: str = "moe"
    infer: bool = False
    fixed: bool = False  # declare the boundaries found by `infer_boundaries` with the context
    bad_rows: bool = False  # the context has twice the inputs' rows: refused on every rank


def run_cases(rank: int, world: int, cases: list[Case]) -> dict[str, dict[str, Any]]:
    results = {}
    for case in cases:
        try:
            if case.model.startswith("against"):
                results[case.name] = _against_case(rank, case)
                continue
            results[case.name] = _run_case(rank, case)
        except PipeccError as err:
            results[case.name] = {"error": type(err).__name__, "message": str(err)}
    return results


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    program = case.program
    num_stages = program.placement.num_stages(0)
    stages = build(case.model, num_stages)
    modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
    x, y, context = batch(program.num_microbatches, seed=3)
    uses_context = case.model == "context"
    ctx0 = {k: v[:ROWS] for k, v in context.items()}
    boundaries: Any = None  # found by the runtime's discovery, on real data
    if case.infer:  # declared by a function, checked (the discovery's context reaches it)
        boundaries = lambda sample: infer_boundaries(stages, sample)  # noqa: E731
    elif case.fixed:  # declared, checked
        boundaries = infer_boundaries(stages, x[:ROWS], context=ctx0 if uses_context else None)
    config = RuntimeConfig(timeout=60.0)
    runtime = PipelineRuntime(program, modules, boundaries, loss_fn=_mse, config=config)
    if case.bad_rows:
        context = {k: torch.cat([v, v]) for k, v in context.items()}
    loss = runtime.step(x, y, context=context if uses_context else None)
    found = runtime.global_loss(breakdown=True)
    total = float(runtime.global_loss())
    reported = {mb: {s: float(v) for s, v in d.items()} for mb, d in runtime.aux_losses.items()}
    runtime.forward(x, y, context=context if uses_context else None)  # evaluation reports too
    evaluated = {mb: {s: float(v) for s, v in d.items()} for mb, d in runtime.aux_losses.items()}
    want = _reference(case, num_stages, (x, y, context if uses_context else None))
    held = {s.stage for s in program.placement.chunks(rank)}
    return {
        "grad_rel": _worst(stages, want["grads"], held),
        "loss": None if loss is None else float(loss),
        "losses": {mb: float(v) for mb, v in runtime.losses.items()},
        "aux": reported,
        "aux_forward": evaluated,
        "breakdown": found._asdict(),
        "total": total,
        "want": {k: v for k, v in want.items() if k != "grads"},
        "hook_calls": sum(getattr(m, "hook_calls", 0) for m in modules.values()),
    }


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _reference(case: Case, num_stages: int, data: tuple[Any, Any, Any]) -> dict[str, Any]:
    """One step by hand: per microbatch the stages in order with the context as keywords,
    the loss plus the recorded added losses, scaled by 1/M."""
    stages = build(case.model, num_stages)
    for stage in stages:
        if isinstance(stage, MoEBlock):
            stage.record = True
    x, y, context = data
    count = case.program.num_microbatches
    main = 0.0
    aux: dict[int, dict[int, float]] = {}
    for mb in range(count):
        rows = slice(mb * ROWS, (mb + 1) * ROWS)
        kwargs = {k: v[rows] for k, v in context.items()} if context is not None else {}
        value = x[rows]
        for stage in stages:
            value = stage(value, **kwargs)
        loss = _mse(value, y[rows])
        added = [
            (s, stage.added.pop())
            for s, stage in enumerate(stages)
            if getattr(stage, "added", None)
        ]
        if added:
            aux[mb] = {s: float(a) for s, a in added}
        ((loss + sum(a for _, a in added)) / count).backward()
        main += float(loss)
    grads = {
        (s, n): (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        for s, stage in enumerate(stages)
        for n, p in stage.named_parameters()
    }
    added_mean = sum(sum(d.values()) for d in aux.values()) / count
    return {"grads": grads, "main": main / count, "aux": aux, "added": added_mean}


def _worst(
    stages: list[nn.Module], want: dict[tuple[int, str], torch.Tensor], held: set[int]
) -> float:
    worst = 0.0
    for s in held:
        for name, p in stages[s].named_parameters():
            ref = want[(s, name)]
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            worst = max(worst, float((got - ref).abs().max()) / (float(ref.abs().max()) or 1.0))
    return worst


def _against_case(rank: int, case: Case) -> dict[str, Any]:
    """`check_against` in a training script: every rank holds the whole decoder
    (examples/decoder.py) and trains only its stages, whose weights moved (an optimizer's
    step, different on each rank); `against-bug`: the split forgets layer 1."""
    import split_bugs
    from pipecc.runtime import check_against

    decoder = split_bugs.decoder
    program = case.program
    num_stages = program.placement.num_stages(0)
    bug = "forget-layer" if case.model == "against-bug" else None
    modules = {
        s.chunk: split_bugs.broken(decoder["build_stage"](s.stage, num_stages), bug)
        for s in program.placement.chunks(rank)
    }
    with torch.no_grad():
        for module in modules.values():
            for param in module.parameters():
                param.mul_(1.0 + 0.05 * (rank + 1))  # this rank's optimizer moved them
    whole = decoder["build_model"]()  # the whole model, stale where other ranks trained
    x, y, context = decoder["make_batch"](4 * program.num_microbatches, seed=1)
    sample = (x[:4], {k: v[:4] for k, v in context.items()})
    boundaries = infer_boundaries(
        [decoder["build_stage"](s, num_stages) for s in range(num_stages)], sample[0],
        context=sample[1],
    )  # fmt: skip
    runtime = PipelineRuntime(program, modules, boundaries, loss_fn=decoder["loss_fn"])
    found = check_against(whole, runtime, x, y, context=context)
    return found._asdict()
