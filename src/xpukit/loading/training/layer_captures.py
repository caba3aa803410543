"""The captured graphs of one model's decoder stack, one per training call shape, and what they share.

:class:`LayerCaptures` is the per-shape bookkeeping under :class:`.layer_graphs.LayerGraphs` (which
decides which model calls replay): the graphs keyed by the call's shape, dtype, device, autocast
state and layer arguments (:data:`CallKey`), up to ``max_shapes`` of them; the one memory pool they
share; the stand-ins and shared gradients of what is trained (:mod:`.graph_capture`), dropped with
the graphs when that changes; the host slots of offloaded checkpointing (:mod:`.graph_offload`); and
what each capture cost (:meth:`LayerCaptures.record`). A layer runs through :meth:`LayerCaptures._layer`
inside a capture and out of one: checkpointed where asked, its input in a host slot when captured
with offloading.

docs/layer-graphs.md "CUDA graphs of the decoder layers" and "What a capture costs".
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, TypeAlias, TypedDict

from xpukit.loading.device_graph import GraphBackend
from xpukit.loading.training.graph_capture import (
    CaptureBackend,
    Captured,
    NothingToTrain,
    SharedGrads,
    StandIns,
    capture,
)
from xpukit.loading.training.graph_offload import HostSlots, offload_input
from xpukit.loading.training.graph_rope import GraphRope
from xpukit.loading.training.layer_calls import NO_CACHE, Call, LayerForward, Signature, Watch, fill_call
from xpukit.planning.training.activation_memory import GRAPH_SHAPES

if TYPE_CHECKING:
    import torch

__all__ = ["GRAPH_BACKENDS", "MAX_SHAPES", "CallKey", "CaptureCost", "GraphRecord", "LayerCaptures"]

logger = logging.getLogger("xpukit.loading.training.layer_graphs")  # the layer graphs' one logger

# Device types whose torch module has a graph class, graph() and graph_pool_handle().
GRAPH_BACKENDS = ("cuda", "xpu")
# Shapes captured per model at most; a further shape runs eagerly (counted in the plan's estimate).
MAX_SHAPES = GRAPH_SHAPES

# What a captured graph is kept under: the stack input's shape, dtype, device and requires_grad, the
# autocast state and dtype, and the layers' argument signature (layer_calls.flatten).
CallKey: TypeAlias = tuple[
    tuple[int, ...], "torch.dtype", "torch.device", bool, bool, "torch.dtype | None", Signature
]


class CaptureCost(TypedDict):
    """One capture: its row's tokens, its milliseconds, the pool's bytes after it (``None``: the
    device cannot say), and the milliseconds of its parts (``graph_capture.Captured.cost``)."""

    tokens: int
    ms: int
    pool_bytes: int | None
    parts: dict[str, int]


class GraphRecord(TypedDict):
    """What the graphs cost a run (:meth:`LayerCaptures.record`)."""

    captures: int
    capture_ms: int
    shapes: int
    pool_bytes: int | None
    pool_bytes_per_shape: int | None
    pool_bytes_first: int | None
    pool_bytes_per_later_shape: int | None
    host_slot_bytes: int
    each: list[CaptureCost]


class LayerCaptures:
    """The graphs of one model's decoder layers, one per captured shape, and what they share.

    Attributes:
        stats: ``captures``, their total ``capture_ms``, the pool's and the host slots' bytes (and
            the passes :class:`.layer_graphs.LayerGraphs` counts).
        failed: why capturing failed (graphs are then off for this model), else ``None``.
        keys: the captured calls' shapes, dtypes, autocast states and input ``requires_grad``.
        max_shapes: how many shapes are captured at most.
        rope: whether the captures run liger-kernel's RoPE (:class:`.graph_rope.GraphRope`).
    """

    def __init__(
        self,
        layers: list[torch.nn.Module],
        *,
        backend: CaptureBackend | None,
        checkpoint: bool | str,
        rope: bool,
        checkpoint_layers: int | None,
    ) -> None:
        self.layers = layers
        self.forwards: list[LayerForward] = [layer.forward for layer in layers]
        # Each layer checkpointed here, replayed or not (transformers' own checkpointing is off then);
        # "offload": the captured layers' inputs wait in host slots (graph_offload).
        self.checkpoint = checkpoint
        # With ``checkpoint`` True: only the first this many layers are (None: all; the plan's fit).
        self.checkpoint_layers = checkpoint_layers
        self.host = HostSlots(pin=False)
        self.rope = GraphRope(layers, wanted=rope)
        self.max_shapes = MAX_SHAPES
        # Warm-up passes before each capture after the first: none, the first capture's warm-up built
        # and autotuned the kernels (checkpointed, H200, 8 GB: 3 447 against 3 264 tokens/s over 20
        # steps); the same kernels run without checkpointing (docs/layer-graphs.md "What a capture costs").
        self.warmups = 0
        # Wait for the device and empty its cache before each capture (graph_capture.capture); False:
        # a capture without a warm-up pass records while the device runs the steps queued before. No
        # gain measured (docs/layer-graphs.md "What a capture costs"): the host's recording is the cost.
        self.settle = True
        self.stats: Counter[str] = Counter()
        self.failed: str | None = None
        self._graphs: dict[CallKey, Captured] = {}
        self._pool: object = None  # the backend's pool handle, once made
        self._pool_first: int | None = None  # the pool's bytes after its first shape's capture
        self.captured: list[CaptureCost] = []  # each capture: row tokens, ms, pool bytes (record())
        # The capture's leaves and the adapters' gradients every shape shares (graph_capture).
        self._trained: tuple[StandIns, SharedGrads] | None = None
        # The device's graph API (device_graph.GraphBackend); the CPU tests pass a stand-in.
        self.backend = backend
        self._light = False  # this call runs eagerly with each layer checkpointed (the first call)
        self._watch: Watch | None = None  # what the captured graphs read

    @property
    def keys(self) -> list[CallKey]:
        return list(self._graphs)

    def captured_tokens(self) -> list[int]:
        """The lengths of the single rows captured so far (packed rows: ``[1, tokens, hidden]``):
        packing pads a row to one of them once :meth:`full` (``loading/training/packing.py``)."""
        return [int(key[0][1]) for key in self._graphs if len(key[0]) == 3 and key[0][0] == 1]

    def full(self) -> bool:
        """Whether a new shape would no longer be captured: all ``max_shapes`` are taken."""
        return len(self._graphs) >= self.max_shapes

    @property
    def key(self) -> CallKey | None:
        """The first captured shape (``None`` before any capture)."""
        return next(iter(self._graphs), None)

    def _drop(self) -> None:
        """Forget every graph (their addresses are stale) and what they shared."""
        self._graphs.clear()
        self._pool = self._trained = None
        self._watch = None
        self.host.clear()

    def _call_key(self, hidden: torch.Tensor, signature: Signature) -> CallKey:
        import torch

        kind = hidden.device.type
        autocast = torch.is_autocast_enabled(kind)
        return (
            tuple(hidden.shape),
            hidden.dtype,
            hidden.device,
            hidden.requires_grad,
            autocast,
            torch.get_autocast_dtype(kind) if autocast else None,
            signature,
        )

    def _layer(
        self,
        forward: LayerForward,
        hidden: torch.Tensor,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        *,
        capturing: bool,
        slot: torch.Tensor | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        """One layer's forward; checkpointed (non-reentrant) in checkpoint mode while training with
        grad, its saved input in ``slot`` on the host when captured with offloading. Inside a capture
        the RNG state is not saved (the device's generator state cannot be read there; the fused path
        the graphs run on has no dropout)."""
        import torch

        own = getattr(self.layers[0], "gradient_checkpointing", False)  # turned on again: transformers'
        wanted = (self.checkpoint and self._checkpointed(index)) or (self._light and not capturing)
        if own or not (wanted and torch.is_grad_enabled() and self.layers[0].training):
            return forward(hidden, *args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        # As transformers' checkpointed layers do: a recomputation would fill a KV cache a second time.
        kwargs = {**kwargs, **{k: v for k, v in NO_CACHE.items() if k in kwargs}}
        if slot is None:
            return checkpoint(
                forward, hidden, *args, use_reentrant=False, preserve_rng_state=not capturing, **kwargs
            )
        with offload_input(hidden, slot):  # the input the checkpoint saves waits in host memory
            return checkpoint(forward, hidden, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    def _checkpointed(self, index: int) -> bool:
        """Whether layer ``index`` is checkpointed (plain checkpointing: the first ``checkpoint_layers``;
        offloaded: all)."""
        if self.checkpoint is not True or self.checkpoint_layers is None:
            return True
        return index < self.checkpoint_layers

    def _capture(
        self,
        hidden: torch.Tensor,
        inputs: list[torch.Tensor],
        templates: list[Call],
        key: CallKey,
        calls: list[Call],
    ) -> str | None:
        """Capture this shape; ``None`` when it was, else why the call runs eagerly."""
        import torch

        started = time.perf_counter()
        kind = hidden.device.type
        backend = self._backend(kind)
        autocast = torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if autocast else hidden.dtype
        forwards = self.forwards
        stand_ins, grads = self._trained_now(backend)  # first: it may drop the graphs and their slots

        slots: list[torch.Tensor | None] = [None] * len(forwards)
        slots_ms = 0.0  # a longer row than the host buffer holds allocates (and pins) a new one
        if self.checkpoint == "offload" and torch.is_grad_enabled():
            self.host.pin = kind in GRAPH_BACKENDS
            slots_started = time.perf_counter()
            slots = self.host.slots(len(forwards), hidden)
            slots_ms = 1000 * (time.perf_counter() - slots_started)
            self.stats["host_slot_bytes"] = self.host.bytes

        def stack(h: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
            for index, (forward, template, slot) in enumerate(zip(forwards, templates, slots, strict=True)):
                args, kwargs = fill_call(template, values)
                h = self._layer(forward, h, args, kwargs, capturing=True, slot=slot, index=index)
            return h

        sample = torch.randn(hidden.shape, device=hidden.device, dtype=hidden.dtype)
        samples = (sample.requires_grad_(hidden.requires_grad), *(t.detach().clone() for t in inputs))
        self.rope.decide(calls)  # the first capture only: liger's RoPE checked against the model's
        prepared = {"prepare": 1000 * (time.perf_counter() - started) - slots_ms, "host_slots": slots_ms}

        def captured() -> Captured:
            buffer = self.host.buffer  # the host slots' buffer: the graphs copy to it
            keep = (buffer,) if slots[0] is not None and buffer is not None else ()
            with torch.autocast(kind, dtype=dtype, enabled=autocast, cache_enabled=False):
                warmup = self.warmups if self._graphs else 1  # the first capture always warms up
                return capture(
                    stack,
                    samples,
                    stand_ins,
                    grads,
                    backend=backend,
                    pool=self._pool,
                    warmup=warmup,
                    keep=keep,
                    settle=self.settle,
                )

        try:
            run = self.rope.run(captured, keep=NothingToTrain)
        except NothingToTrain:  # adapters switched off: nothing to capture a backward of
            return "nothing in the layers requires grad (adapters off)"
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "%s graphs of the decoder layers failed (%s); the layers run eagerly. After a failed "
                "capture torch may leave the device's random generator in capture mode: if random ops "
                "then fail ('Offset increment outside graph capture'), restart with "
                "lora={'graphs': False}",
                kind.upper(),
                self.failed,
            )
            return "capture failed"
        self._graphs[key] = run
        self._watch = Watch(self.layers)
        self._count(hidden, backend, started, {**prepared, **run.cost})
        return None

    def _count(
        self, hidden: torch.Tensor, backend: CaptureBackend, started: float, parts: dict[str, float]
    ) -> None:
        """A capture done: its cost in :attr:`stats` (its parts as ``capture_<part>_ms``) and
        :attr:`captured`."""
        ms = round(1000 * (time.perf_counter() - started))  # before the pool's snapshot, which is ours
        self.stats["captures"] += 1
        self.stats["capture_ms"] += ms
        for part, part_ms in parts.items():
            self.stats[f"capture_{part}_ms"] += round(part_ms)
        pool = backend.pool_bytes(self._pool) if hasattr(backend, "pool_bytes") else None
        if pool is not None:
            self.stats["pool_bytes"] = pool
            if len(self._graphs) == 1:  # the first shape in this pool (its warm-up pass allocated there)
                self._pool_first = pool
        self.captured.append(
            {
                "tokens": int(hidden.shape[-2]) if hidden.dim() >= 2 else 1,
                "ms": ms,
                "pool_bytes": pool,
                "parts": {part: round(ms) for part, ms in parts.items()},
            }
        )

    def record(self) -> GraphRecord:
        """What the graphs cost this run, for a trainer-side record (bench/bench_realrun.py reads it):
        ``captures`` and their total ``capture_ms``; the pool's bytes at the end, per captured shape,
        after the first shape (whose warm-up pass allocated in the pool too) and added by each later
        shape on average; each capture's row length, milliseconds and the pool's bytes after it."""
        shapes = len(self._graphs)
        pool = self.stats.get("pool_bytes")
        first = self._pool_first if shapes else None
        later = (
            (pool - first) // (shapes - 1) if pool is not None and first is not None and shapes > 1 else None
        )
        return {
            "captures": self.stats["captures"],
            "capture_ms": self.stats["capture_ms"],
            "shapes": shapes,
            "pool_bytes": pool,
            "pool_bytes_per_shape": pool // shapes if pool and shapes else None,
            "pool_bytes_first": first,
            "pool_bytes_per_later_shape": later,
            "host_slot_bytes": self.stats.get("host_slot_bytes", 0),
            "each": list(self.captured),
        }

    def _trained_now(self, backend: CaptureBackend) -> tuple[StandIns, SharedGrads]:
        """The stand-ins and shared gradients of what is trained now, and the pool; when what is
        trained changed, the graphs go with the gradient buffers they add into (and a new pool)."""
        if self._pool is None:
            self._pool = backend.pool()
        current = StandIns(self.layers)
        if self._trained is None or [id(p) for p in self._trained[1].params] != [id(p) for p in current.real]:
            if self._graphs:
                self._drop()
                self._pool = backend.pool()
            self._trained = (current, SharedGrads(current.real))
        return self._trained

    def _backend(self, kind: str) -> CaptureBackend:
        if self.backend is None:
            self.backend = GraphBackend(kind)
        return self.backend
