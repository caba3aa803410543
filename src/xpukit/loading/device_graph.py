"""The graph API of one torch device module (``torch.cuda`` or ``torch.xpu``), for the two places
that capture device graphs themselves: the training layers
(:mod:`xpukit.loading.training.graph_capture`) and the decode step
(:mod:`xpukit.loading.decode.step_graph`). A CPU test passes a stand-in with the same methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["GraphBackend"]


class GraphBackend:
    """The graph API of one torch device module (``torch.cuda`` or ``torch.xpu``).

    Captures and warm-ups run on one side stream of the backend's own. Where the device module has
    ``MemPool`` and ``use_mem_pool`` (torch 2.6+ on CUDA), :meth:`pool` is a ``MemPool`` and
    :meth:`warm_up` allocates from it: a warm-up pass before a capture then reuses the memory that
    earlier captures left free in the pool, instead of taking as much again from the device's default
    pool (the way inductor's graph trees warm up; docs/training.md "CUDA graphs of the decoder layers").
    """

    def __init__(self, kind: str) -> None:
        import inspect

        import torch

        self.kind = kind
        self.module = getattr(torch, kind)
        self.graph_class = getattr(self.module, "CUDAGraph" if kind == "cuda" else f"{kind.upper()}Graph")
        self.mem_pools = hasattr(self.module, "MemPool") and hasattr(self.module, "use_mem_pool")
        self._graph_stream = "stream" in inspect.signature(self.module.graph).parameters
        self._stream: Any = None

    def new_graph(self) -> Any:
        return self.graph_class()

    def pool(self) -> Any:
        return self.module.MemPool() if self.mem_pools else self.module.graph_pool_handle()

    def capture(self, graph: Any, body: Callable[[], None], pool: Any) -> None:
        # Captures happen mid-training, where a data loader's pin-memory thread may call into CUDA;
        # "thread_local" keeps those calls from invalidating this thread's capture (torch.cuda.graph).
        options: dict[str, Any] = {"capture_error_mode": "thread_local"} if self.kind == "cuda" else {}
        if self._graph_stream:
            options["stream"] = self._side()
        with self.module.graph(graph, pool=getattr(pool, "id", pool), **options):
            body()

    def synchronize(self) -> None:
        self.module.synchronize()

    def release_cached(self) -> None:
        """Hand the device's default pool's free cached blocks back to the driver (``empty_cache``).

        The graphs' pool cannot take blocks the default pool caches, and the first training pass runs
        eagerly: without this its activations stay cached there while the captures take as much again
        into the pool (docs/training.md "CUDA graphs of the decoder layers"). A live graph pool keeps
        its blocks; only unused default-pool blocks (and pools of freed graphs) are released.
        """
        self.module.empty_cache()

    def pool_bytes(self, pool: Any) -> int | None:
        """The device memory ``pool`` holds from the allocator (its segments' sizes), where the
        device module can say (``MemPool.snapshot``, else the memory snapshot's segments of that
        pool); ``None`` where it cannot."""
        try:
            if hasattr(pool, "snapshot"):
                segments = pool.snapshot()
            else:
                pool_id = tuple(getattr(pool, "id", pool))
                segments = [
                    s for s in self.module.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool_id
                ]
            return int(sum(int(s.get("total_size", 0)) for s in segments))
        except Exception:  # a device module without snapshots: the pool's size is not known
            return None

    def side_stream(self) -> Any:
        """Run on the captures' side stream (outside any pool)."""
        return self.module.stream(self._side())

    def warm_up(self, pool: Any) -> Any:
        """Run a capture's warm-up passes: on the captures' stream, allocating from ``pool`` where
        the device module allows it."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.module.stream(self._side()))
        if self.mem_pools and hasattr(pool, "id"):
            stack.enter_context(self.module.use_mem_pool(pool))
        return stack

    def _side(self) -> Any:
        if self._stream is None:
            self._stream = self.module.Stream()
        return self._stream
