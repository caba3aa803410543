"""The graph API of one torch device module (``torch.cuda`` or ``torch.xpu``), for the two places
that capture device graphs themselves: the training layers
(:mod:`xpukit.loading.training.graph_capture`) and the decode step
(:mod:`xpukit.loading.decode.step_graph`). A CPU test passes a stand-in with the same methods, or a
stand-in device module to :class:`GraphBackend` itself.

What lives how long (docs/layer-graphs.md "What the graphs hold, and for how long"):

* a capture and its warm-up run with Python's garbage collector paused: a model dropped earlier that
  is only freed by the collector (its modules and wrappers refer to each other) would otherwise be
  freed in the middle of the capture, and a graph pool released then makes the allocator
  synchronize, which it refuses while a capture is under way (the process aborts); a warm-up that
  allocates from a pool (``use_mem_pool``) counts as one for the allocator too;
* a pool (:class:`GraphPool`) whose last owner goes while a capture is under way (someone else's
  capture) is parked and let go at the next capture or ``release_cached`` outside one;
* the captures' side stream is one per device for the process, and the BLAS library's workspace for
  it is made before any warm-up or capture, in the device's default pool: made inside a graph pool
  it would stay allocated there for the whole process and keep that pool's memory;
* no capture starts while work on another thread may touch the device (:func:`background_device_work`:
  the decode loop's compiled step being built, whose compile runs kernels: inductor benchmarks
  padded matrix products on random inputs). Such work launches on the device's default stream, which
  waits for every other stream: a capture under way is invalidated and the other thread's call fails
  (seen on an H200, docs/decode.md "Tiered decoding"). The decode loop runs a step uncaptured
  meanwhile (:func:`background_busy`); any other capture waits for the work to end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeviceGraph",
    "DeviceModule",
    "GraphBackend",
    "GraphPool",
    "background_busy",
    "background_device_work",
    "collector_paused",
    "parked_pools",
    "wait_for_background",
]


class DeviceGraph(Protocol):
    """A captured device graph (``torch.cuda.CUDAGraph``, ``torch.xpu.XPUGraph``)."""

    def replay(self) -> None: ...


class _Capturable(Protocol):
    """A device graph's own capture calls (what ``torch.cuda.graph`` / ``torch.xpu.graph`` call)."""

    def capture_begin(self, *pool: object, **options: object) -> None: ...

    def capture_end(self) -> None: ...


class DeviceModule(Protocol):
    """What :class:`GraphBackend` uses of a torch device module (``torch.cuda``, ``torch.xpu``, or a
    CPU test's stand-in). Its graph class is looked up by name; ``MemPool`` and ``use_mem_pool``
    (torch 2.6+ on CUDA) and ``is_current_stream_capturing`` are used where the module has them."""

    def graph(self, graph: DeviceGraph, **options: object) -> AbstractContextManager[object]: ...

    def graph_pool_handle(self) -> object: ...

    def stream(self, stream: torch.Stream) -> AbstractContextManager[object]: ...

    def Stream(self) -> torch.Stream: ...

    def current_device(self) -> int: ...

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def memory_snapshot(self) -> list[dict[str, Any]]: ...  # torch's allocator records (JSON-like)

    def MemPool(self) -> object: ...

    def use_mem_pool(self, pool: object) -> AbstractContextManager[object]: ...


# The captures' side stream of each device (kind, index), shared by every model of the process.
_SIDE_STREAMS: dict[tuple[str, int], torch.Stream] = {}
# Pool handles whose last owner went while a capture was under way: let go at the next safe point.
_PARKED: list[object] = []
# Work on other threads that may touch the device (module docstring), and its end.
_BACKGROUND = [0]
_QUIET = threading.Condition()


@contextlib.contextmanager
def background_device_work() -> Iterator[None]:
    """Mark work on this (non-main) thread that may touch the device: no capture starts meanwhile."""
    with _QUIET:
        _BACKGROUND[0] += 1
    try:
        yield
    finally:
        with _QUIET:
            _BACKGROUND[0] -= 1
            _QUIET.notify_all()


def background_busy() -> bool:
    """Whether work on another thread may touch the device now (then no capture may start)."""
    return _BACKGROUND[0] > 0


def wait_for_background(timeout: float | None = None) -> bool:
    """Wait until no such work runs; whether it ended within ``timeout``."""
    with _QUIET:
        return _QUIET.wait_for(lambda: _BACKGROUND[0] == 0, timeout)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (restored as it was): nothing a collection frees
    (device memory, a graph pool, pinned host memory) is freed in the middle of a capture."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def parked_pools() -> int:
    """How many pools wait to be let go (their owner went during a capture)."""
    return len(_PARKED)


class GraphPool:
    """One memory pool of device graphs (a ``MemPool``, or the id ``graph_pool_handle`` gives), held
    by the graphs captured into it and by their owner. Letting go of a ``MemPool`` empties its cache,
    which synchronizes: when that would happen during a capture the pool is parked instead."""

    def __init__(self, handle: object, capturing: Callable[[], bool]) -> None:
        self.handle = handle
        self._capturing = capturing

    @property
    def id(self) -> object:
        return getattr(self.handle, "id", self.handle)

    def __del__(self) -> None:
        try:
            if self._capturing():
                _PARKED.append(self.handle)
        except Exception:  # the interpreter shutting down: nothing to protect any more
            pass


class GraphBackend:
    """The graph API of one torch device module (``torch.cuda`` or ``torch.xpu``).

    Captures and warm-ups run on one side stream per device, shared by every model. Where the device
    module has ``MemPool`` and ``use_mem_pool`` (torch 2.6+ on CUDA), :meth:`pool` is a ``MemPool`` and
    :meth:`warm_up` allocates from it: a warm-up pass before a capture then reuses the memory that
    earlier captures left free in the pool, instead of taking as much again from the device's default
    pool (the way inductor's graph trees warm up; docs/layer-graphs.md "CUDA graphs of the decoder layers").
    ``module``: the device module itself (a CPU test's stand-in); by default ``torch.<kind>``. A
    ``pool`` argument is a :class:`GraphPool` from :meth:`pool`, or the raw handle it holds.
    """

    def __init__(self, kind: str, module: DeviceModule | None = None) -> None:
        import inspect

        import torch

        self.kind = kind
        self.module: DeviceModule = module if module is not None else getattr(torch, kind)
        self.graph_class = getattr(self.module, "CUDAGraph" if kind == "cuda" else f"{kind.upper()}Graph")
        self.mem_pools = hasattr(self.module, "MemPool") and hasattr(self.module, "use_mem_pool")
        self._graph_stream = "stream" in inspect.signature(self.module.graph).parameters

    def new_graph(self) -> DeviceGraph:
        graph: DeviceGraph = self.graph_class()
        return graph

    def pool(self) -> GraphPool:
        self._let_parked_go()
        handle = self.module.MemPool() if self.mem_pools else self.module.graph_pool_handle()
        return GraphPool(handle, self.capturing)

    def capturing(self) -> bool:
        """Whether the current stream is being captured (by anyone)."""
        check = getattr(self.module, "is_current_stream_capturing", None)
        return bool(check()) if check is not None else False

    def capture(
        self, graph: DeviceGraph, body: Callable[[], None], pool: object, settle: bool = True
    ) -> dict[str, float]:
        """Capture ``body`` into ``graph``; the milliseconds before recording (``graph_enter``),
        recording (``record``) and at the capture's end (``graph_end``, where the graph is instantiated).

        ``settle``: enter through ``torch.<kind>.graph``, which first waits for the device and empties
        the caches (the device's and, on CUDA, the pinned host memory's). With ``False`` the capture
        begins at once on the side stream (``capture_begin`` / ``capture_end``, what that context
        calls inside): work queued on other streams keeps running while the host records, and no
        cache is emptied (docs/layer-graphs.md "What a capture costs").
        """
        # Captures happen mid-training, where a data loader's pin-memory thread may call into CUDA;
        # "thread_local" keeps those calls from invalidating this thread's capture (torch.cuda.graph).
        begun = time.perf_counter()
        options: dict[str, object] = {"capture_error_mode": "thread_local"} if self.kind == "cuda" else {}
        wait_for_background()  # another thread's device work would invalidate the capture
        self._let_parked_go()
        self._blas_workspace()
        handle = getattr(pool, "id", pool)
        with collector_paused():
            if settle or not hasattr(graph, "capture_begin"):
                if self._graph_stream:
                    options["stream"] = self._side()
                # torch.cuda.graph's entry synchronizes and empties the caches; its exit instantiates
                with self.module.graph(graph, pool=handle, **options):
                    entered = time.perf_counter()
                    body()
                    recorded = time.perf_counter()
            else:
                with self.module.stream(self._side()):
                    direct = cast("_Capturable", graph)
                    direct.capture_begin(*(() if handle is None else (handle,)), **options)
                    entered = time.perf_counter()
                    try:
                        body()
                    finally:
                        recorded = time.perf_counter()
                        direct.capture_end()  # instantiates the graph
        ended = time.perf_counter()
        return {
            "graph_enter": 1000 * (entered - begun),
            "record": 1000 * (recorded - entered),
            "graph_end": 1000 * (ended - recorded),
        }

    def synchronize(self) -> None:
        self.module.synchronize()

    def release_cached(self) -> None:
        """Hand the device's default pool's free cached blocks back to the driver (``empty_cache``).

        The graphs' pool cannot take blocks the default pool caches, and the first training pass runs
        eagerly: without this its activations stay cached there while the captures take as much again
        into the pool (docs/layer-graphs.md "CUDA graphs of the decoder layers"). A live graph pool keeps
        its blocks; only unused default-pool blocks (and pools of freed graphs) are released.
        """
        self._let_parked_go()
        self.module.empty_cache()

    def pool_bytes(self, pool: object) -> int | None:
        """The device memory ``pool`` holds from the allocator (its segments' sizes), where the
        device module can say (``MemPool.snapshot``, else the memory snapshot's segments of that
        pool); ``None`` where it cannot."""
        handle: object = getattr(pool, "handle", pool)
        try:
            if hasattr(handle, "snapshot"):
                segments = handle.snapshot()
            else:  # graph_pool_handle's id: a pair of ints
                pool_id = tuple(cast("Iterable[int]", getattr(handle, "id", handle)))
                segments = [
                    s for s in self.module.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool_id
                ]
            return int(sum(int(s.get("total_size", 0)) for s in segments))
        except Exception:  # a device module without snapshots: the pool's size is not known
            return None

    def side_stream(self) -> AbstractContextManager[object]:
        """Run on the captures' side stream (outside any pool)."""
        return self.module.stream(self._side())

    def warm_up(self, pool: object) -> contextlib.ExitStack[bool | None]:
        """Run a capture's warm-up passes: on the captures' stream, allocating from ``pool`` where
        the device module allows it, with the garbage collector paused."""
        self._blas_workspace()
        stack = contextlib.ExitStack()
        stack.enter_context(collector_paused())
        stack.enter_context(self.module.stream(self._side()))
        handle = getattr(pool, "handle", pool)
        if self.mem_pools and hasattr(handle, "id"):
            stack.enter_context(self.module.use_mem_pool(handle))
        return stack

    def _side(self) -> torch.Stream:
        key = (self.kind, int(self.module.current_device()))
        if key not in _SIDE_STREAMS:
            _SIDE_STREAMS[key] = self.module.Stream()
        return _SIDE_STREAMS[key]

    def _blas_workspace(self) -> None:
        """Make the BLAS workspaces of the side stream now, in the default pool: cuBLAS (and
        cuBLASLt) keep one per handle and stream for the process, made at the stream's first matrix
        product (torch's cuBLAS workspace cache; inductor's graph trees clear it around their own
        captures for the same reason). A no-op once they exist."""
        import torch

        if self.kind != "cuda" or self.capturing():
            return
        device = torch.device(self.kind, int(self.module.current_device()))
        with self.module.stream(self._side()):
            for dtype in (torch.float32, torch.bfloat16):
                a = torch.ones(8, 8, device=device, dtype=dtype)
                torch.nn.functional.linear(a, a, a[0])  # cuBLASLt (a bias epilogue)
                torch.mm(a, a)  # cuBLAS

    def _let_parked_go(self) -> None:
        if _PARKED and not self.capturing():
            _PARKED.clear()
