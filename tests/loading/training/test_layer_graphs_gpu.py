"""On CUDA: the decoder layers as CUDA graphs train exactly as the eager layers do.

Run with ``pytest -m gpu tests/loading/training/test_layer_graphs_gpu.py`` (needs CUDA, triton and
bitsandbytes).
Both runs use the same kernels (a graph replays what the eager pass launched), so losses and LoRA
gradients agree to bf16 rounding; the tolerance is the bf16 one of tests/kernels/test_kernels_gpu.py.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytestmark = pytest.mark.gpu


def _need_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")


def _load(tiny_model: Any, lora: dict[str, Any], **shape: int) -> Any:
    """The tiny model in 4-bit with new adapters (``lora``) on CUDA (skipped without CUDA, triton or
    bitsandbytes); ``shape`` overrides the batch_size/seq_len."""
    _need_cuda()
    from xpukit import load_for_xpu

    sizes = {"batch_size": 2, "seq_len": 32, **shape}
    return load_for_xpu(tiny_model, device="cuda", quantize="4bit", seed=0, lora=lora, **sizes)


def _grads(model: Any) -> Any:
    import torch

    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def _steps(model: Any, ids: Any, steps: int) -> list[tuple[float, Any]]:
    """A hand-written loop that keeps last step's ``loss`` (and its autograd graph) alive while the
    next forward runs, the case that invalidated the first captures (module docstring there)."""
    import torch

    model.train()
    out = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = _grads(model)
        out.append((float(loss.detach()), grads))
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "lora",
    [
        {"graphs": True},
        {"graphs": True, "gradient_checkpointing": True},
        {"graphs": True, "gradient_checkpointing": "offload"},
        {"graphs": True, "gradient_checkpointing": True, "checkpoint_layers": 1},
    ],
    ids=[
        "graphs",
        "checkpointed-inside-graphs",
        "offloaded-inside-graphs",
        "partly-checkpointed-inside-graphs",
    ],
)
def test_graphed_layers_give_the_eager_losses_and_gradients(tiny_model: Any, lora: dict[str, Any]) -> None:
    """Graphed layers (and, with checkpointing, the recomputation captured with them; with offloaded
    checkpointing the copies of each layer's input to its pinned host slot and back: docs/layer-graphs.md
    "CUDA graphs of the decoder layers") give the eager layers' losses and gradients."""
    import torch

    ids = (torch.arange(64, device="cuda").reshape(2, 32) * 7) % 500
    eager = _steps(_load(tiny_model, {"graphs": False}), ids, 4)
    lora = dict(lora)
    partly = lora.pop("checkpoint_layers", None)  # what the plan's fit sets under a budget
    model = _load(tiny_model, lora)
    model.xpukit_layer_graphs.checkpoint_layers = partly
    assert model.xpukit_layer_graphs.checkpoint == (lora.get("gradient_checkpointing") or False)
    graphed = _steps(model, ids, 4)
    stats = model.xpukit_layer_graphs.stats
    assert stats["captures"] == 1 and stats["graphed"] == 3 and stats["eager"] == 1
    assert stats["pool_bytes"] > 0  # the pool's size is reported
    if lora.get("gradient_checkpointing") == "offload":
        assert stats["host_slot_bytes"] > 0 and model.xpukit_layer_graphs.host.buffer.is_pinned()
    if importlib.util.find_spec("liger_kernel") is not None:  # its RoPE in the replays, eager elsewhere
        assert model.xpukit_layer_graphs.rope.active, model.xpukit_layer_graphs.rope.note
    for (la, ga), (lb, gb) in zip(eager, graphed, strict=True):
        assert abs(la - lb) <= 1e-2 * abs(la)
        assert float((ga - gb).norm() / ga.norm()) < 2e-2


def test_two_forwards_before_one_backward_run_eagerly(tiny_model: Any) -> None:
    import torch

    ids = (torch.arange(64, device="cuda").reshape(2, 32) * 7) % 500
    other = (ids + 11) % 500
    results = []
    for graphs in (False, True):
        model = _load(tiny_model, {"graphs": graphs})
        _steps(model, ids, 2)  # with graphs: captured on the second
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total = model(input_ids=ids, labels=ids).loss + model(input_ids=other, labels=other).loss
        total.backward()
        results.append(_grads(model))
        if graphs:
            reasons = model.xpukit_layer_graphs.eager_reasons
            assert reasons["a forward before the previous one's backward"] == 1
    assert float((results[0] - results[1]).norm() / results[0].norm()) < 2e-2


@pytest.mark.parametrize("settle", [True, False])
def test_packed_padded_batches_replay_graphs_and_train_as_the_padded_eager_batches(
    tiny_model: Any, settle: bool
) -> None:
    """The real-run case: batches of different lengths padded by a collator. Packed into buckets, the
    graphs replay after the first call of each shape; losses and gradients are the padded batches'.
    With ``settle=False`` the captures after the first record while the device runs earlier steps."""
    _need_cuda()
    import torch

    gen = torch.Generator().manual_seed(0)
    batches = []
    for step in range(8):
        # packed rows of 24-600 tokens: two buckets of 256 at least, so a second shape is captured
        lengths = torch.randint(8, 200, (3,), generator=gen).tolist()
        width = max(lengths)
        ids = torch.randint(5, 500, (3, width), generator=gen)
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        batches.append((ids.cuda() * mask.cuda(), mask.cuda(), step))
    results = []
    for lora in ({"graphs": False, "packing": False}, {"graphs": True, "packing": True}):
        model = _load(tiny_model, lora, batch_size=3, seq_len=200)
        if lora["graphs"]:
            model.xpukit_layer_graphs.settle = settle
        model.train()
        run = []
        for ids, mask, _ in batches:
            labels = ids.masked_fill(mask == 0, -100)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            run.append((float(loss.detach()), _grads(model)))
            model.zero_grad(set_to_none=True)
        results.append((model, run))
    (_, eager), (packed, graphed) = results
    stats = packed.xpukit_layer_graphs.stats
    assert stats["graphed"] >= 6 and stats["eager"] == 1, packed.xpukit_layer_graphs.eager_reasons
    assert stats["captures"] >= 2
    assert packed.xpukit_packing.stats["packed"] == 8 and packed.xpukit_packing.stats["padding_removed"] > 0
    for (la, ga), (lb, gb) in zip(eager, graphed, strict=True):
        assert abs(la - lb) <= 1e-2 * abs(la)
        assert float((ga - gb).norm() / ga.norm()) < 3e-2


def test_graphed_training_with_accumulation_and_optimizer_steps_ends_at_the_eager_weights(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optimizer updates reach the replayed graphs, and accumulated micro-batches add up (the graph's
    gradient buffer is rewritten by the next replay, so the first gradient must be a copy).

    The replays run transformers' RoPE here, so both sides launch the same kernels. With liger's
    RoPE in the replays (the default where liger is installed) the two round differently in bf16,
    and six AdamW steps at lr 1e-2 turn that into 11 % of the weights' movement (H200, 2026-12-03):
    Adam's first updates are about lr × sign(gradient), and near-zero gradients flip sign. Each
    step's gradients with liger's RoPE are checked against eager ones in
    test_graphed_layers_give_the_eager_losses_and_gradients."""
    import torch

    from xpukit.loading.training import graph_rope

    monkeypatch.setattr(graph_rope, "_liger_rope", lambda: None)

    gen = torch.Generator().manual_seed(1)
    micro = [torch.randint(5, 500, (2, 32), generator=gen).cuda() for _ in range(12)]
    weights = []
    for graphs in (False, True):
        model = _load(tiny_model, {"graphs": graphs})
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        start = torch.cat([p.detach().float().flatten() for p in params])
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        for step in range(6):  # 2 micro-batches per step
            for ids in micro[2 * step : 2 * step + 2]:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    (model(input_ids=ids, labels=ids).loss / 2).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        weights.append(torch.cat([p.detach().float().flatten() for p in params]))
        if graphs:
            assert model.xpukit_layer_graphs.stats["graphed"] >= 10
    moved = (weights[0] - start).norm()  # the same seed: both runs start from these weights
    assert float(moved) > 0
    assert float((weights[0] - weights[1]).norm() / moved) < 5e-2


@pytest.mark.parametrize("checkpointing", [True, "offload"])
def test_a_step_split_by_tokens_trains_as_the_whole_step(tiny_model: Any, checkpointing: Any) -> None:
    """A padded batch over the token budget (docs/training-plan.md "A token budget per pass") runs as
    checkpointed passes of whole examples, eagerly beside the graphs; its loss and LoRA gradients are
    the whole step's, replayed, and the graphs replay again on the next step."""
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (4, 48), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[0, 30:] = 0
    mask[3, :20] = 0
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for budget in (None, 64):
        model = _load(
            tiny_model, {"graphs": True, "gradient_checkpointing": checkpointing}, batch_size=4, seq_len=48
        )
        model.train()
        model.xpukit_packing.max_tokens = budget
        out = []
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            out.append((float(loss.detach()), _grads(model)))
            model.zero_grad(set_to_none=True)
        results.append(out)
        if budget:
            assert model.xpukit_packing.stats["split_steps"] == 3
            assert (
                model.xpukit_layer_graphs.eager_reasons["a step over the token budget of 64, split by tokens"]
                > 0
            )
    for (la, ga), (lb, gb) in zip(*results, strict=True):
        assert abs(la - lb) <= 1e-2 * abs(la)
        assert float((ga - gb).norm() / ga.norm()) < 2e-2


def test_ten_loads_in_one_process_train_and_give_the_device_memory_back(tiny_model: Any) -> None:
    """A notebook that loads, trains, drops and loads again with another budget or rung: ten models
    in one process, each captured and replayed, alternating the rungs (graphs, checkpointed inside
    them, offloaded inside them, eager) and budgets. After each is dropped (``del`` and a collection)
    the device memory is back where it was after the first (which made the process's lazily built
    state: kernels, the BLAS workspace of the captures' stream): allocated within 16 MiB, reserved
    within 64 MiB (docs/layer-graphs.md "What the graphs hold, and for how long")."""
    _need_cuda()
    import gc

    import torch

    from xpukit import load_for_xpu

    setups = [
        ({"graphs": True}, None),
        ({"graphs": True, "gradient_checkpointing": True, "checkpoint_layers": 1}, {0: "4GiB"}),
        ({"graphs": True, "gradient_checkpointing": True}, {0: "4GiB"}),
        ({"graphs": True, "gradient_checkpointing": "offload"}, None),
        ({"graphs": False}, {0: "2GiB"}),
        ({"graphs": True, "gradient_checkpointing": "offload"}, {0: "2GiB"}),
    ]
    ids = (torch.arange(64, device="cuda").reshape(2, 32) * 7) % 500

    def cycle(lora: dict[str, Any], budget: Any) -> dict[str, int]:
        lora = dict(lora)
        partly = lora.pop("checkpoint_layers", None)
        model = load_for_xpu(
            tiny_model,
            device="cuda",
            quantize="4bit",
            seed=0,
            lora=lora,
            batch_size=2,
            seq_len=32,
            max_memory=budget,
        )
        if partly is not None:
            model.xpukit_layer_graphs.checkpoint_layers = partly
        _steps(model, ids, 3)
        graphs = getattr(model, "xpukit_layer_graphs", None)
        stats = dict(graphs.stats) if graphs is not None else {}
        del model, graphs
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return stats

    cycle(*setups[0])
    start = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for i in range(10):
        lora, budget = setups[i % len(setups)]
        stats = cycle(lora, budget)
        if lora["graphs"]:
            assert stats["captures"] == 1 and stats["graphed"] == 2, (i, stats)
        end = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        assert end[0] - start[0] <= 16 * 2**20 and end[1] - start[1] <= 64 * 2**20, (i, start, end)


def test_the_graphs_pool_grows_expandable_segments_after_the_load(tiny_model: Any) -> None:
    """The plan's ``expandable_segments`` on CUDA (torch 2.11+, no allocator variable set): the
    load records the switch, and the segments the graphs' private pool then takes are expandable
    (docs/layer-graphs.md "Expandable segments in the allocator")."""
    import os

    import torch

    model = _load(tiny_model, {"graphs": True})
    decision = next((d for d in model.xpukit_plan.decisions if d.name == "expandable_segments"), None)
    if decision is None or decision.value is not True or decision.source == "user":
        pytest.skip(f"the plan keeps the allocator here: {decision}")
    events = [e for e in model.xpukit_plan.events if e.what == "expandable_segments"]
    assert [e.kind for e in events] == ["applied"], events
    assert "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    ids = (torch.arange(64, device="cuda").reshape(2, 32) * 7) % 500
    before = {seg["address"] for seg in torch.cuda.memory_snapshot()}  # earlier tests' segments
    _steps(model, ids, 3)
    assert model.xpukit_layer_graphs.stats["captures"] == 1
    pools = [
        seg
        for seg in torch.cuda.memory_snapshot()
        if seg["address"] not in before and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    ]
    assert pools, "the capture took no new segment of a private pool"
    assert all(seg.get("is_expandable") for seg in pools), [
        (seg.get("segment_pool_id"), seg.get("is_expandable")) for seg in pools
    ]


def test_a_graph_pool_let_go_during_a_capture_is_parked_not_released() -> None:
    """The abort of the GPU suite run whole (docs/layer-graphs.md "What the graphs hold, and for how
    long"): a pool whose last owner goes in the middle of a capture (a dropped model freed by a
    collection there) is parked until the next capture, instead of emptying its cache then, which the
    allocator refuses during a capture. Here the owner goes inside a capture's body, on purpose."""
    _need_cuda()
    import torch

    from xpukit.loading.device_graph import GraphBackend, parked_pools

    backend = GraphBackend("cuda")
    doomed = backend.pool()
    with backend.warm_up(doomed):
        x = torch.empty(1 << 20, device="cuda")  # a block of the pool, freed: cached in it
    del x
    own = backend.pool()
    a = torch.ones(16, device="cuda")
    state: dict[str, Any] = {}
    before = parked_pools()

    def body() -> None:
        nonlocal doomed
        state["out"] = a * 2
        del doomed  # its last owner goes during the capture
        state["parked"] = parked_pools()

    graph = backend.new_graph()
    backend.capture(graph, body, own)
    graph.replay()
    torch.cuda.synchronize()
    assert state["parked"] == before + 1 and float(state["out"].sum()) == 32.0
    backend.release_cached()  # outside a capture: let go
    assert parked_pools() == 0
