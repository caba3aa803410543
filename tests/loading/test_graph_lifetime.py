"""What the layer graphs hold, and for how long (docs/layer-graphs.md "What the graphs hold, and for how
long"), on the CPU: the capture's lifetime rules with a stand-in device module and a backend that
re-runs the captured bodies. tests/loading/training/test_layer_graphs_gpu.py loads, trains and drops ten
models in one
process on CUDA."""

from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def _module(events: list[Any], capturing: list[bool]) -> Any:
    """A stand-in for torch.cuda's graph API that records what runs, and whether the collector was
    on at that moment."""

    @contextlib.contextmanager
    def record(what: str) -> Any:
        events.append((what, gc.isenabled()))
        yield

    return SimpleNamespace(
        graph=lambda g, **options: record("capture"),
        Stream=object,
        MemPool=lambda: SimpleNamespace(id=(7, 7)),
        stream=lambda s: record("stream"),
        use_mem_pool=lambda p: record("use_mem_pool"),
        current_device=lambda: 0,
        is_current_stream_capturing=lambda: capturing[0],
        empty_cache=lambda: events.append(("empty_cache", gc.isenabled())),
    )


def _backend(events: list[Any], capturing: list[bool]) -> Any:
    from xpukit.loading.device_graph import GraphBackend

    backend = GraphBackend("cuda")
    backend.module, backend.mem_pools = _module(events, capturing), True
    backend._blas_workspace = lambda: events.append(("blas", gc.isenabled()))  # type: ignore[method-assign]
    return backend


def test_captures_and_their_warm_ups_run_with_the_collector_paused() -> None:
    """A model dropped earlier, freed only by the cyclic collector, must not be freed in the middle of
    a capture: its graph pool's release synchronizes, which the allocator refuses during a capture
    (the process aborts). The collector is off inside, and on again after."""
    events: list[Any] = []
    backend = _backend(events, [False])
    inside: list[bool] = []
    pool = backend.pool()
    with backend.warm_up(pool):
        inside.append(gc.isenabled())
    backend.capture(None, lambda: inside.append(gc.isenabled()), pool)
    assert inside == [False, False] and gc.isenabled()
    # the BLAS workspace is made first, with the collector on and outside the pool
    assert [e for e in events if e[0] in ("blas", "use_mem_pool")] == [
        ("blas", True),
        ("use_mem_pool", False),
        ("blas", True),
    ]
    gc.disable()
    try:  # a collector the caller had turned off stays off
        backend.capture(None, lambda: None, pool)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="in the body"):  # restored when the body fails too
        backend.capture(None, lambda: (_ for _ in ()).throw(RuntimeError("in the body")), pool)
    assert gc.isenabled()


def test_a_pool_let_go_during_someone_elses_capture_waits_for_the_next_safe_point() -> None:
    from xpukit.loading.device_graph import GraphPool, parked_pools

    capturing = [True]
    backend = _backend([], capturing)

    class Handle:
        id = (9, 9)

    handle = Handle()
    alive = weakref.ref(handle)
    pool = GraphPool(handle, backend.capturing)
    del handle
    before = parked_pools()
    del pool  # its owner went while a capture is under way: parked, not freed
    assert parked_pools() == before + 1 and alive() is not None
    backend.release_cached()  # still capturing: nothing is let go
    assert alive() is not None
    capturing[0] = False
    backend.release_cached()
    assert parked_pools() == 0 and alive() is None
    pool = GraphPool(Handle(), backend.capturing)
    del pool  # outside a capture: freed at once
    assert parked_pools() == 0


def test_one_side_stream_per_device_for_the_process() -> None:
    """Every model's captures use the same stream, so the BLAS library keeps one workspace for it
    (one per stream, for the process) rather than one per model loaded."""
    first, second = _backend([], [False]), _backend([], [False])
    assert first._side() is second._side()


def _graphs(layers: list[Any], checkpoint: Any = False) -> Any:
    from test_graph_capture import RerunBackend

    from xpukit.loading.training.layer_graphs import LayerGraphs

    backend = RerunBackend()
    backend.pool = object  # type: ignore[method-assign]  (a new pool object each time)
    graphs = LayerGraphs(layers, backend=backend, checkpoint=checkpoint)
    graphs.forwards = [lambda h, *a, layer=layer, **k: layer(h) for layer in layers]
    return graphs


def _step(graphs: Any, rows: int = 2) -> Any:
    rotary = (torch.zeros(1), torch.zeros(1))
    h = torch.randn(rows, 4)
    for i in range(len(graphs.layers)):
        h = graphs.forward(i, h, attention_mask=None, position_embeddings=rotary)
    return h


def test_a_captured_shape_holds_its_pool_and_host_buffers_past_a_drop() -> None:
    """A replay writes to its pool and its host slots: a pass still in flight when the graphs are
    dropped (weights changed) keeps them, whatever the layer graphs let go of."""
    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    graphs = _graphs(layers, checkpoint="offload")
    _step(graphs).sum().backward()  # eager, the first call
    _step(graphs).sum().backward()  # captured
    assert graphs.stats["captures"] == 1 and graphs.host.buffer is not None
    captured = next(iter(graphs._graphs.values()))
    pending = _step(graphs)  # replayed; its backward not run yet
    assert captured.pool is graphs._pool and captured.keep == (graphs.host.buffer,)
    buffer = weakref.ref(graphs.host.buffer)
    graphs._drop()
    assert graphs.host.buffer is None and buffer() is not None  # the pass in flight still holds it
    pending.sum().backward()
    del pending, captured
    graphs.backend.graphs.clear()  # the stand-in keeps the bodies it re-runs (a device graph does not)
    gc.collect()
    assert buffer() is None


def test_the_record_says_what_each_capture_cost() -> None:
    graphs = _graphs([torch.nn.Linear(4, 4) for _ in range(2)])
    for rows in (2, 2, 3, 3):
        _step(graphs, rows).sum().backward()
    record = graphs.record()
    assert record["captures"] == 2 and record["shapes"] == 2 and len(record["each"]) == 2
    assert [each["tokens"] for each in record["each"]] == [2, 3]
    assert record["capture_ms"] == graphs.stats["capture_ms"]
    assert record["pool_bytes_first"] is None and record["pool_bytes_per_later_shape"] is None  # not known


def test_the_record_times_the_host_slots_apart_from_the_rest_before_a_capture() -> None:
    """A longer row than the pinned host buffer holds allocates a new one (on a GPU, pinning it costs
    about a second per gigabyte): each capture's parts say how long its slots took, apart from the
    rest of the preparation."""
    import time

    graphs = _graphs([torch.nn.Linear(4, 4) for _ in range(2)], checkpoint="offload")
    slots = graphs.host.slots

    def slow_slots(*args: Any) -> Any:
        time.sleep(0.03)
        return slots(*args)

    graphs.host.slots = slow_slots
    for rows in (2, 2, 3):  # the first call runs eagerly; then shapes 2 and 3 are captured
        _step(graphs, rows).sum().backward()
    for each in graphs.record()["each"]:
        assert each["parts"]["host_slots"] >= 30 and each["parts"]["prepare"] >= 0
        assert sum(each["parts"].values()) <= each["ms"] + 5  # the slots counted once


def test_the_record_splits_the_pool_into_the_first_shape_and_each_later_one() -> None:
    """The first capture's warm-up pass allocates in the pool too: the record gives the pool after the
    first shape and what each later shape added on average, beside the plain average per shape."""
    graphs = _graphs([torch.nn.Linear(4, 4) for _ in range(2)])
    sizes = iter([600, 700, 900])
    graphs.backend.pool_bytes = lambda pool: next(sizes)
    for rows in (2, 2, 3, 4):  # the first call runs eagerly; then shapes 2, 3 and 4 are captured
        _step(graphs, rows).sum().backward()
    record = graphs.record()
    assert [each["pool_bytes"] for each in record["each"]] == [600, 700, 900]
    assert record["pool_bytes"] == 900 and record["pool_bytes_per_shape"] == 300
    assert record["pool_bytes_first"] == 600 and record["pool_bytes_per_later_shape"] == 150


def test_changing_what_is_trained_drops_the_graphs_and_their_pool() -> None:
    """The graphs add into gradient buffers of what was trained: they go, their pool and host slots
    with them, and the new capture holds the slots it copies to."""
    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    graphs = _graphs(layers, checkpoint="offload")
    for _ in range(2):
        _step(graphs).sum().backward()
    pool, buffer = graphs._pool, graphs.host.buffer
    layers[0].bias.requires_grad_(False)
    _step(graphs).sum().backward()
    assert graphs.stats["captures"] == 2 and len(graphs.keys) == 1 and graphs._pool is not pool
    captured = next(iter(graphs._graphs.values()))
    assert graphs.host.buffer is not buffer and captured.keep == (graphs.host.buffer,)
    assert captured.pool is graphs._pool


def test_a_dropped_model_with_graphs_and_packing_is_freed_by_a_collection(tiny_model: Path) -> None:
    """Nothing of xpukit's (a registry, a cache, a wrapper) keeps a dropped model alive: the next
    load in the same process gets its memory back."""
    from xpukit import load_for_xpu
    from xpukit.loading.training.layer_graphs import install_layer_graphs
    from xpukit.loading.training.packing import install_packing

    model = load_for_xpu(tiny_model, device="cpu", dtype="float32", seed=0, lora=True)
    install_layer_graphs(model, checkpoint="offload")
    install_packing(model, bucket=8, graphs=model.xpukit_layer_graphs)
    model.train()
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    alive = weakref.ref(model)
    layers = weakref.ref(model.xpukit_layer_graphs)
    del model
    gc.collect()
    assert alive() is None and layers() is None


def test_decode_step_graphs_take_a_new_pool_once_all_their_graphs_are_gone() -> None:
    """A pool handle (``graph_pool_handle``, where torch has no ``MemPool``) that no graph uses any more
    may already be released by the allocator: capturing into it again is refused. Once every captured
    step is dropped, the next capture gets a pool of its own."""
    from xpukit.loading.decode.step_graph import StepGraphs

    class Backend:
        def __init__(self) -> None:
            self.pools: list[Any] = []

        def new_graph(self) -> Any:
            return SimpleNamespace(replay=lambda: None)

        def pool(self) -> Any:
            self.pools.append(object())
            return self.pools[-1]

        def capture(self, graph: Any, body: Any, pool: Any) -> None:
            assert pool is self.pools[-1]

        def synchronize(self) -> None:
            pass

        def side_stream(self) -> Any:
            return contextlib.nullcontext()

    backend = Backend()
    graphs = StepGraphs(backend)
    for _ in range(2):  # warm, then captured
        graphs.run(("a", 1), lambda: None)
    graphs.run(("b", 1), lambda: None)
    graphs.run(("b", 1), lambda: None)
    assert len(backend.pools) == 1  # one pool for both
    graphs.forget("a")
    assert graphs._pool is not None  # "b" still uses it
    graphs.forget("b")
    assert graphs._pool is None
    for _ in range(2):
        graphs.run(("a", 1), lambda: None)
    assert len(backend.pools) == 2
