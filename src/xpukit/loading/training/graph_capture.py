"""One callable's forward and backward as two device graphs, its parameters' gradients accumulated
into one set of buffers that every captured shape shares.

``torch.cuda.make_graphed_callables`` (and ``torch.xpu``'s) gives each captured callable its own
static buffer for every parameter's gradient. :mod:`xpukit.loading.training.layer_graphs` captures
the decoder stack once per training shape, so that held one copy of the adapters' gradients per
shape: 175 MB each for an 8B model's LoRA r=16 in float32, over 1 GB with 6 shapes, and the first
gradient had to be cloned out of the graph's buffer every step. Here the backward graph adds each
gradient into a flat buffer per dtype that all shapes share, and the parameters' ``.grad`` are views
of that buffer, so the gradients exist once, as in eager training (docs/layer-graphs.md "CUDA graphs of
the decoder layers").

How ``.grad`` stays what autograd would give:

* before a replay of the backward, a parameter whose ``.grad`` is ``None`` (``zero_grad`` with
  ``set_to_none=True``, as ``Trainer`` does) gets its view zeroed, and after it ``.grad`` is that view;
* a parameter whose ``.grad`` is its view accumulates in the graph (gradient accumulation, or a
  ``zero_grad(set_to_none=False)`` that zeroed the view in place);
* a parameter whose ``.grad`` is some other tensor (an eager pass put it there) gets its view zeroed,
  and the replay's gradient is then added to that tensor.

The capture follows ``make_graphed_callables``: warm-up passes on a side stream, then the forward and
the backward captured into the caller's memory pool. A graph captures ``body()`` once and replays its
kernels; the bodies keep their results on a small state object, so a backend that re-runs the body
instead of replaying (the CPU tests' stand-in for a device) computes the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch.autograd.function import FunctionCtx

__all__ = ["CaptureBackend", "DeviceGraph", "NothingToTrain", "SharedGrads", "StandIns", "capture"]


class DeviceGraph(Protocol):
    """One captured graph (``torch.cuda.CUDAGraph``, ``torch.xpu.XPUGraph``, a CPU test's stand-in)."""

    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    """The device's graph API a capture uses (:class:`xpukit.loading.device_graph.GraphBackend`, or a
    CPU test's stand-in). A pool is the backend's own handle, only passed back to it."""

    def new_graph(self) -> DeviceGraph: ...

    def pool(self) -> object: ...

    def capture(
        self, graph: DeviceGraph, body: Callable[[], None], pool: object, settle: bool = True
    ) -> dict[str, float] | None:
        """Capture ``body`` (with ``settle``, after the device is idle and its caches emptied);
        where the backend times it, its parts in milliseconds."""

    def synchronize(self) -> None: ...

    def release_cached(self) -> None: ...

    def warm_up(self, pool: object) -> contextlib.AbstractContextManager[object]: ...


class NothingToTrain(Exception):
    """The captured code's output needs no gradient (no trainable parameter or input reaches it)."""


class StandIns:
    """A new leaf for every trainable parameter of ``modules``, on the same storage, put in the
    parameters' place only while a capture's bodies run.

    An autograd graph of an earlier step that is still referenced (a loop that keeps last step's
    ``loss`` while the next forward runs) keeps the real parameters' gradient accumulators, made on
    the default stream; a capture through them has to wait for that stream, which invalidates it
    (seen on an H200: ``cudaErrorStreamCaptureInvalidated``). The optimizer updates the shared
    storage in place, so the graphs read the current values.
    """

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        import torch

        # (module, name, real, stand-in)
        self.swaps: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]] = []
        by_id: dict[int, torch.nn.Parameter] = {}  # a parameter two modules share gets one stand-in
        for top in modules:
            for module in top.modules():
                for name, param in list(module._parameters.items()):
                    if param is not None and param.requires_grad:
                        if id(param) not in by_id:
                            by_id[id(param)] = torch.nn.Parameter(param.detach(), requires_grad=True)
                        self.swaps.append((module, name, param, by_id[id(param)]))

    @property
    def real(self) -> list[torch.nn.Parameter]:
        """The trainable parameters, each once."""
        return list({id(real): real for _, _, real, _ in self.swaps}.values())

    @property
    def leaves(self) -> list[torch.nn.Parameter]:
        """Their stand-ins, in the same order."""
        return list({id(real): leaf for _, _, real, leaf in self.swaps}.values())

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        for module, name, _, stand_in in self.swaps:
            module._parameters[name] = stand_in
        try:
            yield
        finally:
            for module, name, real, _ in self.swaps:
                module._parameters[name] = real


class SharedGrads:
    """One flat gradient buffer per dtype for ``params``; each parameter's gradient is a view of it."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        import torch

        self.params = list(params)
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, param in enumerate(self.params):
            groups.setdefault((param.dtype, param.device), []).append(index)
        self.flats: list[torch.Tensor] = []
        views: dict[int, torch.Tensor] = {}
        for (dtype, device), members in groups.items():
            flat = torch.zeros(sum(self.params[i].numel() for i in members), dtype=dtype, device=device)
            offset = 0
            for i in members:
                n = self.params[i].numel()
                views[i] = flat[offset : offset + n].view(self.params[i].shape)
                offset += n
            self.flats.append(flat)
        self.views = [views[i] for i in range(len(self.params))]

    def before_replay(self) -> list[int]:
        """Zero what the replay must not add to; returns the parameters whose ``.grad`` is another
        tensor (the replay's gradient is added to it afterwards)."""
        others: list[int] = []
        fresh: list[int] = []
        for i, (param, view) in enumerate(zip(self.params, self.views, strict=True)):
            if param.grad is None:
                fresh.append(i)
            elif param.grad is not view:
                others.append(i)
        if len(fresh) == len(self.params):
            for flat in self.flats:
                flat.zero_()
        else:
            for i in fresh + others:
                self.views[i].zero_()
        return others

    def after_replay(self, others: list[int], used: Sequence[bool]) -> None:
        """Give the replay's gradients to the parameters; one the captured code did not use keeps
        ``.grad`` as it was (``None`` stays ``None``, as autograd leaves it)."""
        for i in others:
            self.params[i].grad.add_(self.views[i])
        for param, view, live in zip(self.params, self.views, used, strict=True):
            if param.grad is None and live:
                param.grad = view


@functools.cache
def _replay_function() -> type[torch.autograd.Function]:
    import torch

    class Replay(torch.autograd.Function):  # type: ignore[misc]
        """Forward: copy the inputs in and replay the forward graph; backward: the backward graph."""

        @staticmethod
        def forward(
            ctx: FunctionCtx, captured: Captured, anchor: torch.Tensor, *inputs: torch.Tensor
        ) -> torch.Tensor:
            ctx.captured = captured
            return captured.run_forward(inputs)

        @staticmethod
        @torch.autograd.function.once_differentiable  # type: ignore[untyped-decorator]
        def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            return (None, None, *ctx.captured.run_backward(grad))

    return Replay


@dataclass
class _Bodies:
    """What the captured bodies leave: the forward's output, the backward's upstream gradient and
    the inputs' gradients (``None`` for an input that needs none), all static buffers of the graphs."""

    out: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None
    grad_in: tuple[torch.Tensor | None, ...] = ()


class Captured:
    """The two graphs of one shape and what they read and write.

    It holds everything its graphs write to or allocate from (their static tensors, the shared
    gradients, the pool, and ``keep``: host buffers the graphs copy to), so none of it can go before
    the graphs do, whichever order a garbage collection frees a dropped model's objects in (the
    graphs are its first attributes, so they go first when it is freed).
    """

    def __init__(
        self,
        backend: CaptureBackend,
        inputs: tuple[torch.Tensor, ...],
        shared: SharedGrads,
        pool: object = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.forward_graph = backend.new_graph()
        self.backward_graph = backend.new_graph()
        self.inputs = inputs
        self.shared = shared
        self.pool = pool
        self.keep = keep
        self.state = _Bodies()
        self.used: list[bool] = [True] * len(shared.params)  # which parameters the code uses
        # The parameters' gradients do not go through autograd (they land in ``shared``), so the
        # output needs this empty leaf to require grad when no input does (frozen embeddings).
        self.anchor = inputs[0].new_empty(0).requires_grad_(True)
        # Milliseconds of the capture's parts: ``warm_up`` (the synchronizations, the cache's release
        # and the warm-up passes), ``forward`` and ``backward`` (each graph's capture), and, where the
        # backend times them (``GraphBackend.capture``), the two graphs' ``graph_enter`` (the waits
        # before recording), ``record`` (the code run into the graph) and ``graph_end`` (the
        # capture's end, where the graph is instantiated).
        self.cost: dict[str, float] = {}

    def timed(self, part: str, since: float, split: dict[str, float] | None = None) -> float:
        """Add the milliseconds of ``part`` since ``since`` (and ``split``, a graph's parts as the
        backend timed them) to :attr:`cost`; the time now."""
        now = time.perf_counter()
        self.cost[part] = 1000 * (now - since)
        for key, ms in (split or {}).items():
            self.cost[key] = self.cost.get(key, 0.0) + ms
        return now

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return _replay_function().apply(self, self.anchor, *inputs)

    def run_forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for static, given in zip(self.inputs, inputs, strict=True):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self.forward_graph.replay()
        assert self.state.out is not None  # captured (capture() returns no Captured before)
        return self.state.out.detach()

    def run_backward(self, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_out = self.state.grad_out
        assert grad_out is not None  # captured (capture() returns no Captured before)
        if grad_out.data_ptr() != grad.data_ptr():
            grad_out.copy_(grad)
        others = self.shared.before_replay()
        self.backward_graph.replay()
        self.shared.after_replay(others, self.used)
        return tuple(None if g is None else g.detach() for g in self.state.grad_in)


def capture(
    fn: Callable[..., torch.Tensor],
    samples: tuple[torch.Tensor, ...],
    stand_ins: StandIns,
    shared: SharedGrads,
    *,
    backend: CaptureBackend,
    pool: object,
    warmup: int = 1,
    keep: tuple[torch.Tensor, ...] = (),
    settle: bool = True,
) -> Captured:
    """Capture ``fn(*samples)`` (one tensor out) and its backward into ``pool``.

    ``fn`` runs with ``stand_ins`` in place of the real parameters (``shared.params``); the
    backward graph adds the stand-ins' gradients into ``shared``'s views. Inputs that require grad
    get their gradient returned by the backward; the others get ``None``. The returned callable
    takes tensors of the samples' shapes, dtypes and devices, and holds ``pool`` and ``keep`` (host
    buffers the captured code copies to) as long as it lives.

    ``settle``: wait for the device and release the default pool's cache before capturing, and
    capture each graph through the device's graph context (which waits and empties the caches again).
    ``False`` (only where no warm-up pass runs) records while the device still runs the work queued
    before: the capture's host time overlaps it (docs/layer-graphs.md "What a capture costs").
    """
    import torch

    real = stand_ins.real
    if len(real) != len(shared.params) or any(a is not b for a, b in zip(real, shared.params, strict=False)):
        raise ValueError("the stand-ins and the shared gradients must cover the same parameters, in order")
    wanted = [s for s in samples if s.requires_grad]
    leaves = stand_ins.leaves
    started = time.perf_counter()
    settle = settle or warmup > 0  # a warm-up pass allocates: the cache goes first
    if settle:
        backend.synchronize()
        # What the eager passes left cached in the default pool goes back to the device, for the pool.
        backend.release_cached()
    # Lazily built state stays out of the graphs; the passes reuse the pool's free memory.
    with backend.warm_up(pool), stand_ins.installed():
        for _ in range(warmup):
            out = fn(*samples)
            if not out.requires_grad or not (wanted or leaves):
                raise NothingToTrain
            torch.autograd.grad(out, (*wanted, *leaves), torch.empty_like(out), allow_unused=True)
            del out
    if settle:
        backend.synchronize()
    captured = Captured(backend, samples, shared, pool, keep)
    warmed = captured.timed("warm_up", started)
    state = captured.state

    def forward_body() -> None:
        with stand_ins.installed():
            state.out = fn(*samples)

    split = backend.capture(captured.forward_graph, forward_body, pool, settle)
    forwarded = captured.timed("forward", warmed, split)
    out = state.out
    assert out is not None  # the forward body ran
    state.grad_out = torch.empty_like(out)

    def backward_body() -> None:
        with stand_ins.installed():  # a checkpointed layer recomputes its forward here
            grads = torch.autograd.grad(state.out, (*wanted, *leaves), state.grad_out, allow_unused=True)
        captured.used = [g is not None for g in grads[len(wanted) :]]
        for view, grad in zip(shared.views, grads[len(wanted) :], strict=True):
            if grad is not None:
                view.add_(grad)
        it = iter(grads[: len(wanted)])
        state.grad_in = tuple(next(it) if s.requires_grad else None for s in samples)

    split = backend.capture(captured.backward_graph, backward_body, pool, settle)
    captured.timed("backward", forwarded, split)
    state.out = out.detach()  # the capture's autograd graph is spent; its output buffer stays
    return captured
