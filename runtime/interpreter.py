"""The interpreter: runs this rank's instruction list of a compiled `Program`.

One loop walks the list in order and dispatches on the instruction class to small
primitives: `_forward`, `_backward` (B), `_backward_input` (I), `_weight` (W), `_fused`
(F&B, F&I), `_post` (send, recv) and `_commit` (a group posted with `batch_isend_irecv`),
`_wait`. It contains no schedule-specific code: 1F1B, ZB-H1 and DualPipe differ only in their
programs. Tensors flow between instructions through one mailbox keyed by the program's
message names (what, pipe, receiving stage, mb): a forward drops its output there for the
next stage, and whichever instruction consumes it takes it out, a `send` when the next stage
lives on another rank, the next stage's forward when it lives on this one (V shapes), so a
local hand-off needs no comm op, exactly as the program has none.

All state of a step lives in a `StepContext` (runtime/context.py); the runtime object keeps
only what the program and the modules fix.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import (
    InputError,
    PipeccError,
    ProgramError,
    RankError,
    RecvTimeoutError,
    SetupError,
)
from pipecc.ir.keys import Message
from pipecc.ir.ops import Compute, Fused, Instr, Kind, Msg, Recv, Send, Sequential, StageOp, Wait
from pipecc.ir.printer import describe, message
from pipecc.ir.program import Program

from . import setup
from .comm import Channel, uses_nccl
from .config import LossFn, RuntimeConfig, mse_loss
from .context import Pending, Saved, StepContext, Tensors, split_microbatches
from .context import unwrap as _unwrap
from .duplicates import copies, sum_copies
from .fused import Hook, ScaledCriterion, find_hook
from .plan import Plan, build_plan, forward_only
from .profile import Recorder
from .specs import Boundaries, TensorSpec, as_tuple, describe_specs, normalise_boundaries
from .split_backward import full_backward, input_backward
from .stage_ops import run_stage_op


class PipelineRuntime:
    """Executes one rank's part of a compiled program, one step at a time.

    `modules[chunk]` is this rank's stage module for each chunk of the placement;
    `boundaries[s]` the specs of stage s's input (see `infer_boundaries`).
    """

    def __init__(
        self,
        program: Program,
        modules: Mapping[int, torch.nn.Module] | Sequence[torch.nn.Module],
        boundaries: Boundaries,
        *,
        loss_fn: LossFn = mse_loss,
        config: RuntimeConfig | None = None,
    ) -> None:
        self.program = program
        config = config or RuntimeConfig()
        self.config = config
        self.modules = dict(modules.items() if isinstance(modules, Mapping) else enumerate(modules))
        self.boundaries = normalise_boundaries(boundaries)
        self.loss_fn = loss_fn
        self.group = config.group
        world = dist.get_world_size(self.group)
        self.rank_map = tuple(
            config.rank_map or dist.get_process_group_ranks(self.group or dist.group.WORLD)
        )
        self.device = config.device or _device_of(self.modules)
        nccl = uses_nccl(self.group, self.device)
        self._problem = setup.world_problem(
            program, world, self.rank_map, dist.get_rank()
        ) or setup.backend_problem(program, nccl=nccl)
        self.rank = self.rank_map.index(dist.get_rank()) if self._problem is None else -1
        self.channel = Channel(self.group, self.rank_map, timeout=config.timeout, nccl=nccl)
        self.losses: dict[int, torch.Tensor] = {}
        self._ready = False
        if self._problem is None:
            self._bind()

    def _bind(self) -> None:
        rank = self.rank
        self.chunks = setup.bind_chunks(self.program, rank, self.modules)
        self.specs = setup.recv_specs(self.program, rank, self.boundaries)
        self.plan = build_plan(list(enumerate(self.program.ranks[rank])))
        self.forward_plan = build_plan(forward_only(self.program.ranks[rank]))
        self.shared = copies(self.program.placement, rank)
        self.hooks = {
            (f, b): hook
            for f, fc in self.chunks.items()
            for b, bc in self.chunks.items()
            if (hook := find_hook(fc.module, bc.module)) is not None
        }
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]  # torch leaves it untyped

    # ---- public API ------------------------------------------------------------------------

    def step(
        self, inputs: object = None, targets: object = None, *, recorder: Recorder | None = None
    ) -> torch.Tensor | None:
        """One training step: forward and backward of all M microbatches.

        Gradients accumulate into `.grad` as the mean over microbatches (zero them before, as
        with a single-process step). Returns the mean loss of the microbatches whose last
        stage lives on this rank (None elsewhere); `self.losses` maps each to its loss.
        """
        ctx = self._context(inputs, targets, training=True, recorder=recorder)
        self._run(self.plan, ctx)
        self._finish(ctx)
        if self.config.sync_duplicated and self.shared:
            modules = {chunk: c.module for chunk, c in self.chunks.items()}
            start = time.perf_counter()
            sum_copies(self.channel, self.rank, self.shared, modules, self.device)
            if recorder is not None:
                recorder.sync(start, time.perf_counter())
        return self._loss_of(ctx)

    def forward(self, inputs: object = None, targets: object = None) -> dict[int, Tensors]:
        """Forward only (evaluation): the program's forwards and activation messages, under
        `torch.no_grad()`. Returns the outputs of the microbatches whose last stage lives
        here, by microbatch; with `targets`, `self.losses` holds their losses."""
        with torch.no_grad():
            ctx = self._context(inputs, targets, training=False, recorder=None)
            self._run(self.forward_plan, ctx)
            self._finish(ctx)
        self._loss_of(ctx)
        return dict(sorted(ctx.outputs.items()))

    # ---- the step --------------------------------------------------------------------------

    def _context(
        self, inputs: object, targets: object, *, training: bool, recorder: Recorder | None
    ) -> StepContext:
        """Split the batch; on the first step, check everything on every rank together."""
        if self._problem is not None:
            raise SetupError(self._problem)
        found: list[str] = []
        holds_first = any(c.first for c in self.chunks.values())
        holds_last = any(c.last for c in self.chunks.values())
        split_inputs = self._split(inputs, "inputs", holds_first, found, required=True)
        split_targets = self._split(targets, "targets", holds_last, found, required=training)
        if not self._ready:
            self._first_step_checks(found)
        elif found:
            raise InputError(f"rank {self.rank}: " + "; ".join(found))
        scale = 1.0 / self.program.num_microbatches
        return StepContext(split_inputs, split_targets, scale, training, recorder=recorder)

    def _first_step_checks(self, found: list[str]) -> None:
        """Modules, boundaries and shapes (runtime/setup.py), agreed by every rank."""
        if not found:
            config = self.config
            found = setup.problems(
                self.program, self.rank, self.modules, self.boundaries,
                check_shapes=config.check_shapes,
            )  # fmt: skip
        named = [f"rank {self.rank}: {text}" for text in found]
        setup.agree(named, self.group, self.program.num_ranks, self.device)
        self._ready = True

    def _split(
        self, value: object, what: str, used: bool, found: list[str], *, required: bool
    ) -> list[Tensors] | None:
        """This rank's microbatches of `value`, if it uses them (others are not copied)."""
        if not used:
            return None
        if value is None:
            if required:
                kind = "first" if what == "inputs" else "last"
                found.append(f"this rank holds a {kind} stage and needs {what}, got None")
            return None
        try:
            return split_microbatches(value, self.program.num_microbatches, what, self.device)
        except InputError as err:
            found.append(err.message)
            return None

    def _run(self, plan: Plan, ctx: StepContext) -> None:
        for index, instr, commit in plan:
            try:
                match instr:
                    case Compute() | Fused() | Sequential() if ctx.recorder is not None:
                        self._timed(ctx, instr)
                    case Compute() | Fused() | Sequential():
                        self._compute(ctx, instr)
                    case Send() | Recv() if ctx.recorder is not None:
                        start = time.perf_counter()
                        self._post(ctx, index, instr, commit)
                        ctx.recorder.post(time.perf_counter() - start)
                    case Send() | Recv():
                        self._post(ctx, index, instr, commit)
                    case Wait():
                        self._wait(ctx, index, instr)
                    case StageOp():  # torch's UNSHARD & co.: FSDP stages only (stage_ops.py)
                        run_stage_op(self.modules.get(instr.chunk), instr)
                    case _:
                        raise AssertionError(f"unknown instruction {instr!r}")
            except PipeccError:
                raise
            except Exception as err:
                raise RankError(
                    self._where(index, instr) + f": {type(err).__name__}: {err}"
                ) from err

    def _compute(self, ctx: StepContext, instr: Compute | Fused | Sequential) -> None:
        match instr:
            case Compute(kind=Kind.F):
                self._forward(ctx, instr)
            case Compute(kind=Kind.B):
                self._backward(ctx, instr)
            case Compute(kind=Kind.I):
                self._backward_input(ctx, instr)
            case Compute(kind=Kind.W):
                self._weight(ctx, instr)
            case Fused():
                self._fused(ctx, instr)
            case Sequential():  # torch's OVERLAP_F_B: its parts in the order written
                for part in instr.parts:
                    self._compute(ctx, part)

    def _timed(self, ctx: StepContext, instr: Compute | Fused | Sequential) -> None:
        assert ctx.recorder is not None
        if type(instr) is Sequential:  # each part timed as the op it is
            for part in instr.parts:
                self._timed(ctx, part)
            return
        if self.side is not None:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self._compute(ctx, instr)
        if self.side is not None:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if isinstance(instr, Fused):
            kind = "FB" if instr.backward.kind is Kind.B else "FI"
            ctx.recorder.compute(kind, instr.forward.stage, seconds)
        elif isinstance(instr, Compute):
            ctx.recorder.compute(instr.kind.value, instr.stage, seconds)

    def _finish(self, ctx: StepContext) -> None:
        left = ctx.leftovers()
        if left:
            raise ProgramError(
                f"rank {self.rank}: the program ended with work left over: " + "; ".join(left)
            )

    def _loss_of(self, ctx: StepContext) -> torch.Tensor | None:
        self.losses = dict(sorted(ctx.losses.items()))
        if not self.losses:
            return None
        return torch.stack(list(self.losses.values())).mean()

    def _where(self, index: int, instr: Instr) -> str:
        return f"rank {self.rank}: instruction {index} ({describe(instr)})"

    # ---- compute primitives ----------------------------------------------------------------

    def _forward(self, ctx: StepContext, op: Compute) -> None:
        chunk = self.chunks[op.chunk]
        inputs = self._take_inputs(ctx, chunk, op)
        if ctx.training and not chunk.first:
            inputs = tuple(_leaf(t) for t in inputs)
        outputs = as_tuple(chunk.module(*inputs), op.stage)
        if chunk.last:
            outputs = self._loss(ctx, op.mb, outputs)
        else:
            self._hand_on(ctx, op, outputs)
        if ctx.training:
            ctx.saved[(op.chunk, op.mb)] = Saved(inputs, outputs)

    def _backward(self, ctx: StepContext, op: Compute) -> None:
        saved = ctx.saved.pop((op.chunk, op.mb))
        outputs, grads = self._output_grads(ctx, op, saved)
        self._hand_back(ctx, op, saved.inputs, full_backward(outputs, grads, saved.inputs))

    def _backward_input(self, ctx: StepContext, op: Compute) -> None:
        saved = ctx.saved.pop((op.chunk, op.mb))
        outputs, grads = self._output_grads(ctx, op, saved)
        params = self.chunks[op.chunk].params
        input_grads, weight = input_backward(outputs, grads, saved.inputs, params)
        ctx.weights[(op.chunk, op.mb)] = weight
        self._hand_back(ctx, op, saved.inputs, input_grads)

    def _weight(self, ctx: StepContext, op: Compute) -> None:
        ctx.weights.pop((op.chunk, op.mb)).run()

    def _any_backward(self, ctx: StepContext, op: Compute) -> None:
        if op.kind is Kind.I:
            self._backward_input(ctx, op)
        else:
            self._backward(ctx, op)

    def _fused(self, ctx: StepContext, instr: Fused) -> None:
        forward, backward = instr.forward, instr.backward
        hook = self.hooks.get((forward.chunk, backward.chunk))
        if hook is not None and backward.kind is Kind.B:
            self._overlapped(ctx, hook, forward, backward)
        elif self.side is not None:
            self._on_two_streams(ctx, forward, backward)
        else:
            self._forward(ctx, forward)
            self._any_backward(ctx, backward)

    def _on_two_streams(self, ctx: StepContext, forward: Compute, backward: Compute) -> None:
        """The forward on a side stream, concurrently with the backward on the current one."""
        assert self.side is not None
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self._forward(ctx, forward)
        self._any_backward(ctx, backward)
        main.wait_stream(self.side)

    def _overlapped(
        self, ctx: StepContext, hook: Hook, forward: Compute, backward: Compute
    ) -> None:
        """F&B through the module class's `overlapped_forward_backward` (DualPipe's hook)."""
        fchunk, bchunk = self.chunks[forward.chunk], self.chunks[backward.chunk]
        inputs = self._take_inputs(ctx, fchunk, forward)
        if not fchunk.first:
            inputs = tuple(_leaf(t) for t in inputs)
        criterion, labels = None, []
        if fchunk.last:
            labels = list(self._target(ctx, forward.mb))
            criterion = ScaledCriterion(self.loss_fn, ctx.scale, len(labels))
        saved = ctx.saved.pop((backward.chunk, backward.mb))
        loss1, outputs1, grads1 = None, [], []
        if bchunk.last:
            loss1 = saved.outputs[0]
        else:
            outputs1, grads1 = (list(x) for x in self._output_grads(ctx, backward, saved))
        outputs0, loss0 = hook(
            fchunk.module, list(inputs), criterion, labels, bchunk.module, loss1, outputs1, grads1
        )
        self._after_overlapped(ctx, forward, inputs, outputs0, loss0, criterion)
        grads = tuple(x.grad if x.requires_grad else None for x in saved.inputs)
        self._hand_back(ctx, backward, saved.inputs, grads)

    def _after_overlapped(
        self,
        ctx: StepContext,
        op: Compute,
        inputs: Tensors,
        outputs0: Any,
        loss0: Any,
        criterion: ScaledCriterion | None,
    ) -> None:
        outputs = as_tuple(outputs0, op.stage)
        if criterion is not None:
            if not isinstance(loss0, torch.Tensor) or criterion.raw is None:
                raise ProgramError(
                    "overlapped_forward_backward must return (outputs0, loss0) "
                    "with loss0 = criterion0(*outputs0, *labels0)"
                )
            ctx.losses[op.mb] = criterion.raw
            outputs = (loss0,)
        else:
            self._hand_on(ctx, op, outputs)
        ctx.saved[(op.chunk, op.mb)] = Saved(inputs, outputs)

    # ---- tensors in and out of a stage -----------------------------------------------------

    def _take_inputs(self, ctx: StepContext, chunk: setup.Chunk, op: Compute) -> Tensors:
        if chunk.first:
            if ctx.inputs is None:
                raise InputError(f"rank {self.rank} holds stage 0 and needs the step's inputs")
            return ctx.inputs[op.mb]
        return self._take(ctx, (Msg.ACT, op.pipe, op.stage, op.mb))

    def _take(self, ctx: StepContext, key: tuple[Msg, int, int, int]) -> Tensors:
        found = ctx.mail.pop(key, None)
        if found is None:
            raise ProgramError(
                f"{message(Message(*key))} is not here: it was neither "
                "produced on this rank nor received by a completed wait before this instruction"
            )
        return found

    def _target(self, ctx: StepContext, mb: int) -> Tensors:
        if ctx.targets is None:
            raise InputError(f"rank {self.rank} holds a last stage and needs the step's targets")
        return ctx.targets[mb]

    def _loss(self, ctx: StepContext, mb: int, outputs: Tensors) -> Tensors:
        """On a last stage: record the microbatch's loss; a backward starts from loss/M."""
        if not ctx.training:
            ctx.outputs[mb] = tuple(o.detach() for o in outputs)
            if ctx.targets is None:
                return ()
        loss = self.loss_fn(_unwrap(outputs), _unwrap(self._target(ctx, mb)))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InputError(f"the loss function must return a scalar tensor, got {loss!r}")
        ctx.losses[mb] = loss.detach()
        return (loss * ctx.scale,)

    def _hand_on(self, ctx: StepContext, op: Compute, outputs: Tensors) -> None:
        """Leave a forward's outputs for the next stage (a send, or a local forward)."""
        expected = self.boundaries.get(op.stage + 1)
        got = tuple(TensorSpec(tuple(o.shape), o.dtype) for o in outputs)
        if expected is not None and got != expected:
            raise SetupError(
                f"{self._describe_op(op)} returned {describe_specs(got)}, but stage "
                f"{op.stage + 1} takes {describe_specs(expected)}"
            )
        ctx.mail[(Msg.ACT, op.pipe, op.stage + 1, op.mb)] = tuple(o.detach() for o in outputs)

    def _output_grads(self, ctx: StepContext, op: Compute, saved: Saved) -> tuple[Tensors, Tensors]:
        """The outputs a backward starts from, with their gradients."""
        if self.chunks[op.chunk].last:
            return saved.outputs, tuple(torch.ones_like(o) for o in saved.outputs)
        received = iter(self._take(ctx, (Msg.GRAD, op.pipe, op.stage, op.mb)))
        pairs = [(o, next(received)) for o in saved.outputs if _is_floating(o)]
        live = [(o, g) for o, g in pairs if o.requires_grad]
        return tuple(o for o, _ in live), tuple(g for _, g in live)

    def _hand_back(
        self, ctx: StepContext, op: Compute, inputs: Tensors, grads: Sequence[torch.Tensor | None]
    ) -> None:
        """Leave a backward's input gradients for the previous stage."""
        if op.stage == 0:
            return
        payload = tuple(
            g if g is not None else torch.zeros_like(x)
            for x, g in zip(inputs, grads, strict=True)
            if _is_floating(x)
        )
        ctx.mail[(Msg.GRAD, op.pipe, op.stage - 1, op.mb)] = payload

    def _describe_op(self, op: Compute) -> str:
        return f"{op.kind.value}{op.chunk}.{op.mb} (stage {op.stage} of pipe {op.pipe})"

    # ---- communication primitives ----------------------------------------------------------

    def _post(self, ctx: StepContext, index: int, instr: Send | Recv, commit: bool) -> None:
        if type(instr) is Send:
            tensors = self._take(ctx, (instr.what, instr.pipe, instr.stage, instr.mb))
            tensors = tuple(t if t.is_contiguous() else t.contiguous() for t in tensors)
        else:
            specs = self.specs[(instr.what, instr.pipe, instr.stage)]
            tensors = tuple(torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs)
        ctx.queue.append((index, instr, tensors))
        if commit:
            self._commit(ctx)

    def _commit(self, ctx: StepContext) -> None:
        """Post the queued ops: one op alone, a group together (`batch_isend_irecv`)."""
        ops = [
            self.channel.p2p(type(instr) is Send, tensor, instr.peer)
            for _, instr, tensors in ctx.queue
            for tensor in tensors
        ]
        handles = self.channel.post(ops, batched=ctx.queue[0][1].group is not None)
        first = 0  # each queued op's tensors are a contiguous run of `ops`
        for index, instr, tensors in ctx.queue:
            mine = tuple(handles[first : first + len(tensors)])
            ctx.pending[index] = Pending(instr, mine, tensors)
            first += len(tensors)
        if ctx.recorder is not None:
            now = time.perf_counter()  # the group is posted (its ops go out from the poster)
            for _, instr, tensors in ctx.queue:
                nbytes = sum(t.nbytes for t in tensors)
                ctx.recorder.posted(type(instr) is Send, _key(instr), now, nbytes)
        ctx.queue.clear()

    def _wait(self, ctx: StepContext, index: int, instr: Wait) -> None:
        start = released = time.perf_counter()
        deadline = time.monotonic() + self.config.timeout
        waited: list[Send | Recv] = []
        for op_index in instr.ops:
            pending = ctx.pending.pop(op_index, None)
            if pending is None:
                raise ProgramError(f"instruction {op_index} is not a posted, unwaited op")
            for posted in pending.posted:
                try:
                    self.channel.complete(posted, deadline)
                except Exception as err:
                    raise self._comm_failure(index, instr, op_index, pending, err) from err
            released = time.perf_counter()
            waited.append(pending.instr)
            if type(pending.instr) is Recv:
                recv = pending.instr
                ctx.mail[(recv.what, recv.pipe, recv.stage, recv.mb)] = pending.tensors
        if ctx.recorder is not None:
            ops = tuple((type(op) is Send, _key(op)) for op in waited)
            ctx.recorder.wait(ops, (start, released, time.perf_counter()))

    def _comm_failure(
        self, index: int, instr: Wait, op_index: int, pending: Pending, err: Exception
    ) -> RankError:
        what = f"{describe(pending.instr)} (instruction {op_index})"
        text = _short(str(err))
        if "Timed out" in text or "timed out" in text:
            return RecvTimeoutError(
                f"{self._where(index, instr)}: {what} did not complete "
                f"within {self.config.timeout:g} s"
            )
        return RankError(f"{self._where(index, instr)}: {what} failed: {text}")


def _short(text: str) -> str:
    """A backend's error without its source location and advice (gloo's are long)."""
    text = text.split("\n")[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]


def _key(instr: Send | Recv) -> tuple[str, int, int, int]:
    return (instr.what.value, instr.pipe, instr.stage, instr.mb)


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A stage input as a leaf of this stage's graph (its gradient goes upstream)."""
    if _is_floating(tensor):
        return tensor.detach().requires_grad_(True)
    return tensor


def _is_floating(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex


def _device_of(modules: Mapping[int, torch.nn.Module]) -> torch.device:
    for module in modules.values():
        for param in module.parameters():
            return param.device
    return torch.device("cpu")
