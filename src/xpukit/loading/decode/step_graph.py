"""The decode step (compiled, or the first tier's uncompiled one) captured as one device graph by
xpukit, replayed once per token.

With ``mode="reduce-overhead"`` inductor's CUDA-graph trees replay the step, but every token first
goes through dynamo's guards and the trees' checks of every graph input's address (each weight is
one): host work that the device waits for at batch 1 (docs/decode-internals.md "Own step graphs"). The loop's
step reads and writes only buffers whose addresses never change (:mod:`xpukit.loading.decode.loop`),
so one capture of the step compiled without graphs (``mode="default"``) replays it with a single
call per token.

Per key (a kept batch state, the step kind, and the shape: the attention window of a step, the
prompt bucket of a prefill, docs/decode-internals.md "Attention window"): the first call runs the function
on a side stream (it compiles, and its token is a real one), the second captures it and replays the
capture, every later one replays. A capture that raises (an operation that cannot be captured)
leaves that key uncaptured from then on, said once: a capture runs nothing, so the step then runs
uncaptured for its token. The weights' identities and addresses are read once per
``generate()`` call; a change (a merge, a move, a swapped parameter) drops every capture, and the
next calls capture again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Protocol

from xpukit.loading.device_graph import background_busy

if TYPE_CHECKING:
    import torch

    from xpukit.loading.decode.interfaces import DecodeModel
    from xpukit.loading.device_graph import GraphBackend, GraphPool

__all__ = ["DeviceGraph", "GraphKey", "StepGraphs", "weights_key"]

logger = logging.getLogger(__name__)

# (the batch state's owner key, the step kind, the shape it is for: a window or a prompt bucket)
GraphKey = tuple[Hashable, str, int | None]


class DeviceGraph(Protocol):
    """A captured device graph (``torch.cuda.CUDAGraph``, ``torch.xpu.XPUGraph``): replayed only."""

    def replay(self) -> None: ...


def weights_key(model: DecodeModel) -> tuple[tuple[int, int], ...]:
    """Identity and address of every parameter and buffer of ``model`` (a quantized weight that is a
    tensor subclass counts by the addresses of the tensors it holds)."""
    key: list[tuple[int, int]] = []
    for tensor in (*model.parameters(), *model.buffers()):
        key.extend(_addresses(tensor))
    return tuple(key)


def _addresses(tensor: torch.Tensor) -> list[tuple[int, int]]:
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return [(id(tensor), tensor.data_ptr())]
    names, _ = tensor.__tensor_flatten__()
    found = [(id(tensor), 0)]
    for name in names:
        found.extend(_addresses(getattr(tensor, name)))
    return found


class StepGraphs:
    """The captured decode steps of one model.

    Attributes:
        backend: the device's graph API (:class:`xpukit.loading.device_graph.GraphBackend`; the CPU
            tests pass a stand-in).
        stats: ``captures`` and ``replays`` so far, ``dropped`` (captures dropped because the
            weights changed), and ``uncaptured_while_building`` (steps with no graph yet run while a
            compiled step was being built: no capture starts then, xpukit.loading.device_graph).
        uncaptured: the keys whose capture raised, with the error: they run uncaptured from then on
            (a capture runs nothing, so the step's token is computed by that uncaptured run).
    """

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend
        self.stats = {"captures": 0, "replays": 0, "dropped": 0, "uncaptured_while_building": 0}
        self._pool: GraphPool | None = None
        self._graphs: dict[GraphKey, DeviceGraph] = {}
        self.uncaptured: dict[GraphKey, str] = {}
        self._warm: set[GraphKey] = set()
        self._weights: tuple[tuple[int, int], ...] | None = None

    def check_weights(self, model: DecodeModel) -> None:
        """Drop every capture when ``model``'s weights are not the ones they read (once per call)."""
        key = weights_key(model)
        if key != self._weights:
            self.stats["dropped"] += len(self._graphs)
            self._graphs.clear()
            self._warm.clear()
            self._weights = key
            self._pool = None  # a pool id without graphs may be released: the next capture gets its own

    def forget(self, owner: Hashable, kind: str | None = None) -> None:
        """Drop the captures of one batch state (the loop let its buffers go), or only those of one
        step kind (a tier the compiled step replaced)."""
        gone = lambda k: k[0] == owner and (kind is None or k[1] == kind)  # noqa: E731
        for key in [k for k in self._graphs if gone(k)]:
            del self._graphs[key]
        self._warm = {k for k in self._warm if not gone(k)}
        self.uncaptured = {k: why for k, why in self.uncaptured.items() if not gone(k)}
        if not self._graphs:
            self._pool = None  # as in check_weights

    def run(self, key: GraphKey, step: Callable[[], None]) -> None:
        """One decode step or prefill for ``key``: run, capture or replay ``step``."""
        graph = self._graphs.get(key)
        if graph is None:
            if background_busy():  # a compiled step is being built: it may touch the device
                self.stats["uncaptured_while_building"] += 1
                step()
                return
            if key not in self._warm:
                # Lazily made state (cuBLAS workspaces, the compile itself) stays out of the capture.
                self.backend.synchronize()
                with self.backend.side_stream():
                    step()
                self.backend.synchronize()
                self._warm.add(key)
                return
            if key in self.uncaptured:
                step()
                return
            if self._pool is None:
                self._pool = self.backend.pool()
            graph = self.backend.new_graph()
            try:
                self.backend.capture(graph, step, self._pool)
            except RuntimeError as exc:  # a capture runs nothing: the step runs uncaptured instead
                self.uncaptured[key] = f"{type(exc).__name__}: {exc}"
                logger.warning("xpukit: decode step %s not captured (%s); it runs uncaptured", key, exc)
                self.backend.synchronize()
                step()
                return
            self._graphs[key] = graph
            self.stats["captures"] += 1
        graph.replay()
        self.stats["replays"] += 1
