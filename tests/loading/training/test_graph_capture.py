"""The capture of loading/training/graph_capture.py on the CPU, with a backend that re-runs the
captured bodies instead of replaying device kernels: what is copied in and out, and how the shared
gradient buffers become ``.grad``, checked against plain autograd.
tests/loading/training/test_layer_graphs_gpu.py
runs the real graphs on CUDA."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")


class RerunGraph:
    def __init__(self) -> None:
        self.body: Any = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with torch.enable_grad():  # a replay runs inside an autograd.Function (grad off there)
            self.body()


class RerunBackend:
    """Stands in for torch.cuda's graph API: a "replay" runs the captured body again."""

    def __init__(self) -> None:
        self.graphs: list[RerunGraph] = []
        self.warm_pools: list[Any] = []
        self.events: list[str] = []

    def new_graph(self) -> RerunGraph:
        self.graphs.append(RerunGraph())
        return self.graphs[-1]

    def pool(self) -> None:
        return None

    def capture(self, graph: RerunGraph, body: Any, pool: Any, settle: bool = True) -> None:
        self.events.append("capture" if settle else "capture unsettled")
        graph.body = body
        body()

    def synchronize(self) -> None:
        pass

    def release_cached(self) -> None:
        self.events.append("release")

    def warm_up(self, pool: Any) -> Any:
        self.warm_pools.append(pool)
        self.events.append("warm-up")
        return contextlib.nullcontext()


def _net() -> Any:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    net[0].bias.requires_grad_(False)
    return net


def _captured(net: Any, backend: RerunBackend, shared: Any, rows: int) -> Any:
    from xpukit.loading.training.graph_capture import StandIns, capture

    sample = torch.randn(rows, 4, requires_grad=True)
    return capture(net, (sample,), StandIns([net]), shared, backend=backend, pool=None)


def test_replays_give_autograd_gradients_for_every_shape_and_accumulation() -> None:
    from xpukit.loading.training.graph_capture import SharedGrads

    net, reference = _net(), _net()
    params = [p for p in net.parameters() if p.requires_grad]
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    backend = RerunBackend()
    shared = SharedGrads(params)
    graphs = {rows: _captured(net, backend, shared, rows) for rows in (3, 5)}
    assert all(p.grad is None for p in params)  # capturing leaves the real gradients alone

    def both(rows: int, seed: int) -> None:
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        out = graphs[rows](x)
        (out * out).sum().backward()
        want = reference(x_ref)
        (want * want).sum().backward()
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(x.grad, x_ref.grad)

    def same_grads() -> None:
        for p, r in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.grad, r.grad)

    both(3, 1)  # set_to_none state: the views become .grad
    same_grads()
    assert all(p.grad is v for p, v in zip(params, shared.views, strict=True))
    both(5, 2)  # another shape accumulates into the same buffers
    same_grads()
    for model in (net, reference):
        model.zero_grad(set_to_none=True)
    both(5, 3)  # a stale sum must not leak into a fresh step
    same_grads()
    for model in (net, reference):
        model.zero_grad(set_to_none=False)  # zeroes the views in place
    both(3, 4)
    same_grads()
    for model in (net, reference):  # an eager pass first: .grad is autograd's own tensor
        model.zero_grad(set_to_none=True)
        model(torch.ones(2, 4)).sum().backward()
    eager_grad = params[0].grad
    assert eager_grad is not shared.views[0]
    both(5, 5)
    same_grads()
    assert params[0].grad is eager_grad  # added to, not replaced
    both(3, 6)  # and again: the view is zeroed each time, the eager tensor keeps the sum
    same_grads()
    assert sum(g.replays for g in backend.graphs) == 2 * 6


def test_stand_ins_and_shared_gradients_must_cover_the_same_parameters() -> None:
    from xpukit.loading.training.graph_capture import SharedGrads, StandIns, capture

    net = _net()
    params = [p for p in net.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="same parameters, in order"):
        capture(
            net,
            (torch.randn(2, 4),),
            StandIns([net]),
            SharedGrads(params[::-1]),
            backend=RerunBackend(),
            pool=None,
        )


def test_one_set_of_gradient_buffers_for_all_shapes() -> None:
    from xpukit.loading.training.graph_capture import SharedGrads

    net = _net()
    params = [p for p in net.parameters() if p.requires_grad]
    shared = SharedGrads(params)
    assert len(shared.flats) == 1 and shared.flats[0].numel() == sum(p.numel() for p in params)
    views = [v.data_ptr() for v in shared.views]
    backend = RerunBackend()
    for rows in (2, 3, 4):
        _captured(net, backend, shared, rows)(torch.randn(rows, 4)).sum().backward()
    assert [p.grad.data_ptr() for p in params] == views


def _lora(path: Path, graphed: bool) -> Any:
    """A tiny LoRA model in float32 on the CPU; with ``graphed``, its layers as LayerGraphs over the
    re-running backend."""
    from xpukit import load_for_xpu
    from xpukit.loading.training.layer_graphs import install_layer_graphs

    model = load_for_xpu(path, device="cpu", dtype="float32", seed=0, lora=True)
    if graphed:
        install_layer_graphs(model)
        model.xpukit_layer_graphs.backend = RerunBackend()
    model.train()
    return model


@pytest.mark.parametrize("arch", ["qwen3", "gemma"])
def test_layer_graphs_on_a_lora_model_train_as_the_eager_layers(
    tiny_models: Any, sliding_gemma: Path, arch: str
) -> None:
    """The decoder stack of a tiny LoRA model through LayerGraphs' own capture (stand-ins, masks,
    rotary inputs, shared gradients), over padded batches of two shapes with gradient accumulation;
    Gemma 3 with a sliding-window layer of 4 tokens beside a full one (each kind its own mask and
    position embeddings)."""
    tiny_model = sliding_gemma if arch == "gemma" else Path(tiny_models[arch])
    gen = torch.Generator().manual_seed(7)
    batches = []
    for length in (12, 12, 9, 12, 9, 9):
        ids = torch.randint(3, 500, (2, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, : length // 3] = 0  # left padding in the second row
        batches.append((ids, mask))
    runs = []
    for graphed in (False, True):
        model = _lora(tiny_model, graphed)
        losses, grads = [], []
        for step in range(3):  # two micro-batches a step
            for ids, mask in batches[2 * step : 2 * step + 2]:
                labels = ids.masked_fill(mask == 0, -100)
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                (loss / 2).backward()
                losses.append(float(loss.detach()))
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            model.zero_grad(set_to_none=True)
        runs.append((losses, grads))
    stats = model.xpukit_layer_graphs.stats
    assert stats["captures"] == 2 and stats["graphed"] == 5 and stats["eager"] == 1
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-5)
    for eager_step, graphed_step in zip(runs[0][1], runs[1][1], strict=True):
        assert len(eager_step) == len(graphed_step) > 0
        for a, b in zip(eager_step, graphed_step, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_captures_run_the_checked_rope_and_train_as_the_eager_layers(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a RoPE function that passes the check (a plain PyTorch stand-in for liger-kernel's,
    which needs a GPU), the captures run it in place of the family's own, which is back after each
    capture; losses and gradients equal the eager layers'."""
    import sys

    from xpukit.loading.training import graph_rope

    used: list[int] = []

    def rope(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1) -> Any:
        used.append(q.shape[-2])
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        half = q.shape[-1] // 2

        def rotate(x: Any) -> Any:
            return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

        return rotate(q), rotate(k)

    monkeypatch.setattr(graph_rope, "_liger_rope", lambda: rope)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(3, 500, (2, n), generator=gen) for n in (10, 10, 7, 10)]
    runs = []
    for graphed in (False, True):
        model = _lora(tiny_model, graphed)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(float(loss.detach()))
        runs.append((losses, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    graphs = model.xpukit_layer_graphs
    module = sys.modules[type(graphs.layers[0].self_attn).__module__]
    assert graphs.rope.active, graphs.rope.note
    assert module.apply_rotary_pos_emb is not rope
    assert sorted(set(used)) == [7, 10]  # the two captures (the check itself uses cos's 10 or 7 rows)
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-5)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_packed_rows_take_a_captured_shape_once_the_graphs_keep_no_more(tiny_model: Path) -> None:
    """Packing over the graphs with room for two shapes: rows pad to their 16-token bucket until two
    are captured, then a row whose bucket is not captured takes the shortest captured shape that
    holds it and replays; the losses are those of the padded batches without packing or graphs
    (right padding, padding labels -100)."""
    gen = torch.Generator().manual_seed(3)
    batches = []
    for lengths in ((18, 12), (12, 8), (40, 30), (30, 20)):  # real tokens 30, 20, 70, 50
        ids = torch.randint(3, 500, (2, max(lengths)), generator=gen)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    plain = _lora(tiny_model, graphed=False)
    with torch.no_grad():
        want = [float(plain(input_ids=i, attention_mask=m, labels=y).loss) for i, m, y in batches]
    model = _lora(tiny_model, graphed=True)
    graphs = model.xpukit_layer_graphs
    graphs.max_shapes = 2
    # The CPU plan packs without a bucket (no graphs there); on a GPU loading/lora.py wires these.
    packing = model.xpukit_packing
    packing.bucket, packing.graphs = 16, graphs
    got = []
    for ids, mask, labels in batches:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        got.append(float(loss.detach()))
    assert got == pytest.approx(want, rel=1e-5)
    # 30 → 32 (the warm-up call, eager), 20 → 32 (captured), 70 → 80 (captured), 50 → 80 (its 64 is
    # not captured and no more will be: it replays the 80)
    assert sorted(graphs.captured_tokens()) == [32, 80]
    assert packing.stats["bucket_padding"] == 2 + 12 + 10 + 30
    assert graphs.stats["captures"] == 2 and graphs.stats["graphed"] == 3


@pytest.mark.parametrize("mode", [True, "offload", "partly"])
def test_checkpointed_layers_inside_the_graphs_train_as_the_eager_layers(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: bool | str
) -> None:
    """lora={"graphs": True, "gradient_checkpointing": True | "offload"}: each layer checkpointed
    inside the captured stack (the backward recomputes it with the stand-ins in place) and on the eager
    passes; with "offload" each captured layer's input goes to its host slot and back. Losses and
    gradients equal the plain eager layers over two shapes with accumulation. "partly": only the first
    layer of the two checkpointed (the plan's fewest checkpointed layers), the other kept whole."""
    import torch.utils.checkpoint as ckpt

    import xpukit.loading.training.graph_offload as graph_offload
    from xpukit import training_args
    from xpukit.loading.training.layer_graphs import install_layer_graphs

    calls: list[bool] = []
    captured_layers: set[int] = set()  # the layer forwards checkpointed inside a capture
    real = ckpt.checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(bool(kwargs.get("preserve_rng_state")))
        if not calls[-1]:
            captured_layers.add(id(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "checkpoint", counted)
    came_back: list[Any] = []  # the layer inputs unpacked from their host slots
    real_offloaded = graph_offload._Offloaded

    class Offloaded(real_offloaded):  # type: ignore[misc,valid-type]
        def __init__(self, slot: Any, device: Any) -> None:
            super().__init__(slot, device)
            came_back.append(slot)

    monkeypatch.setattr(graph_offload, "_Offloaded", Offloaded)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(3, 500, (2, n), generator=gen) for n in (12, 12, 9, 12, 9, 9)]
    runs = []
    for graphed in (False, True):
        model = _lora(tiny_model, graphed=False)
        if not graphed:
            eager = model  # no optimizer step changes its weights: the reference below too
        if graphed:
            model.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
            if mode == "partly":
                install_layer_graphs(model, checkpoint=True, checkpoint_layers=1)
            else:
                install_layer_graphs(model, checkpoint=mode)
            model.xpukit_layer_graphs.backend = RerunBackend()
            layers = model.xpukit_layer_graphs.layers
            assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
            # xpukit checkpoints them, so Trainer must not turn transformers' checkpointing on again
            assert not training_args(model, output_dir=str(tmp_path), max_steps=1).gradient_checkpointing
            from xpukit.training.arguments import _context

            assert _context(model, None).gradient_checkpointing  # the optimizer rule still sees it
        losses, grads = [], []
        for step in range(3):
            for ids in batches[2 * step : 2 * step + 2]:
                loss = model(input_ids=ids, labels=ids).loss
                (loss / 2).backward()
                losses.append(float(loss.detach()))
                if graphed and step == 0 and len(losses) == 1:  # the eager first call, checkpointed
                    assert calls == [True] * len(layers)
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            model.zero_grad(set_to_none=True)
        runs.append((losses, grads))
    stats = model.xpukit_layer_graphs.stats
    assert stats["captures"] == 2 and stats["graphed"] == 5 and stats["eager"] == 1
    assert False in calls  # inside the capture: no RNG state saved
    assert len(captured_layers) == (1 if mode == "partly" else len(layers))  # which are checkpointed
    if mode == "offload":  # every captured layer's input went through a host slot, one buffer for all
        assert stats["host_slot_bytes"] > 0 and len(came_back) >= 5 * len(layers)
        assert {s.untyped_storage().data_ptr() for s in came_back} == {
            model.xpukit_layer_graphs.host.buffer.untyped_storage().data_ptr()
        }
    else:
        assert not came_back
    # An eager checkpointed pass (a shape beyond those kept) given a KV cache to fill: the
    # recomputation must not fill it a second time.
    graphs = model.xpukit_layer_graphs
    graphs.max_shapes = 2
    ids = torch.randint(3, 500, (2, 7), generator=gen)
    gaps = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1]])  # packing passes it on, cache and all
    with torch.no_grad():
        want = float(eager(input_ids=ids, attention_mask=gaps, labels=ids).loss)
    loss = model(input_ids=ids, attention_mask=gaps, labels=ids, use_cache=True).loss
    loss.backward()  # filled twice, the cache's keys outgrew the mask: a size error here
    assert (
        float(loss) == pytest.approx(want, rel=1e-5) and graphs.eager_reasons["a shape beyond the 2 captured"]
    )
    # Checkpointing turned on again by someone else: transformers' checkpoint, the layers eagerly.
    model.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
    loss = model(input_ids=ids, attention_mask=gaps, labels=ids).loss
    loss.backward()
    assert float(loss) == pytest.approx(want, rel=1e-5) and graphs.eager_reasons["gradient checkpointing"]
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-5)
    for eager_step, graphed_step in zip(runs[0][1], runs[1][1], strict=True):
        assert len(eager_step) == len(graphed_step) > 0
        for a, b in zip(eager_step, graphed_step, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_the_device_graph_api_the_capture_names_exists_in_this_torch(kind: str) -> None:
    """torch.cuda / torch.xpu as GraphBackend reads them (present in CPU builds of torch too; the
    XPU names are those docs/platform-notes.md "Graphs on Intel GPUs" gives)."""
    import inspect

    from xpukit.loading.device_graph import GraphBackend

    backend = GraphBackend(kind)
    assert backend.graph_class.__name__ == {"cuda": "CUDAGraph", "xpu": "XPUGraph"}[kind]
    for name in ("graph", "graph_pool_handle", "synchronize", "Stream", "stream", "empty_cache"):
        assert callable(getattr(backend.module, name)), name
    assert "pool" in inspect.signature(backend.module.graph).parameters
    if kind == "cuda":  # the warm-ups' pool (GraphBackend.warm_up)
        assert backend.mem_pools and callable(backend.module.MemPool)


# --- the cases a review of the capture found (each failed before its fix) ------------------------


def _plain_graphs(layers: list[Any]) -> Any:
    """LayerGraphs over plain Linear layers (their forwards ignore the decoder's keywords), with the
    real capture through the re-running backend."""
    from xpukit.loading.training.layer_graphs import LayerGraphs

    graphs = LayerGraphs(layers, backend=RerunBackend())
    graphs.forwards = [lambda h, *a, layer=layer, **k: layer(h) for layer in layers]
    return graphs


def _stack(graphs: Any, h: Any) -> Any:
    rotary = (torch.zeros(1), torch.zeros(1))
    for i in range(len(graphs.layers)):
        h = graphs.forward(i, h, attention_mask=None, position_embeddings=rotary)
    return h


def test_a_pass_held_only_through_a_float32_copy_still_blocks_the_buffers() -> None:
    """A final norm that casts the stack's bf16 output to float32 keeps only the copy: the output
    tensor dies while ``loss`` holds the pass, and a second forward must not replay into its buffers."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    graphs = _plain_graphs(layers)
    _stack(graphs, torch.randn(2, 4)).sum().backward()  # eager: the first call
    _stack(graphs, torch.randn(2, 4)).sum().backward()  # captured and replayed
    x, x2 = torch.randn(2, 4), torch.randn(2, 4)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    first = _stack(graphs, x).double().sum()  # only the float64 copy holds the pass
    second = _stack(graphs, x2).double().sum()
    assert graphs.eager_reasons["a forward before the previous one's backward"] == 1
    (first + second).backward()
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    (layers[1](layers[0](x)).double().sum() + layers[1](layers[0](x2)).double().sum()).backward()
    for got, layer_param in zip(grads, [p for layer in layers for p in layer.parameters()], strict=True):
        torch.testing.assert_close(got, layer_param.grad)
    assert graphs.stats["graphed"] == 2


def test_recorded_hidden_states_run_the_layers_eagerly(tiny_model: Path) -> None:
    """transformers records output_hidden_states through hooks on the layers, which a replayed or
    handing-over layer would not feed: such a call runs eagerly and reports the real states."""
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(5))
    runs = []
    for graphed in (False, True):
        model = _lora(tiny_model, graphed)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
        runs.append(model(input_ids=ids, labels=ids, output_hidden_states=True).hidden_states)
    reasons = model.xpukit_layer_graphs.eager_reasons
    assert reasons["hidden states, attentions or router logits recorded from the layers"] == 1
    for a, b in zip(runs[0], runs[1], strict=True):
        torch.testing.assert_close(b, a)


def test_switching_the_adapters_off_drops_the_graphs(tiny_model: Path) -> None:
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(6))
    losses = []
    for graphed in (False, True):
        model = _lora(tiny_model, graphed)
        with torch.no_grad():  # adapters that change the output
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
        run = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            run.append(float(loss.detach()))
        with model.disable_adapter():  # grad on, but nothing in the layers to train
            run.append(float(model(input_ids=ids, labels=ids).loss.detach()))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        run.append(float(loss.detach()))
        losses.append(run)
    graphs = model.xpukit_layer_graphs
    assert graphs.eager_reasons["the layers' weights or adapters changed: graphs captured again"] == 1
    assert graphs.eager_reasons["nothing in the layers requires grad (adapters off)"] == 1
    assert graphs.failed is None and graphs.stats["captures"] == 2  # captured again after the switch
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert losses[0][2] != pytest.approx(losses[0][1], rel=1e-3)  # the switch mattered


def test_layers_that_return_tuples_never_replay() -> None:
    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    graphs = _plain_graphs(layers)
    graphs.forwards = [lambda h, *a, layer=layer, **k: (layer(h),) for layer in layers]
    rotary = (torch.zeros(1), torch.zeros(1))
    for _ in range(3):
        h: Any = torch.randn(2, 4)
        for i in range(2):
            h = graphs.forward(i, h if i == 0 else h[0], attention_mask=None, position_embeddings=rotary)
    assert graphs.unsupported == "the layers return a tuple, not the hidden states alone"
    assert graphs.eager_reasons[graphs.unsupported] == 2 and graphs.stats["captures"] == 0


def test_a_parameter_two_modules_share_gets_its_whole_gradient() -> None:
    from xpukit.loading.training.graph_capture import SharedGrads, StandIns

    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    net = torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.Linear(4, 4))
    net[2].weight = shared.weight  # tied
    stand_ins = StandIns([net])
    assert len(stand_ins.real) == len(stand_ins.leaves) == 3  # the tied weight once
    grads = SharedGrads(stand_ins.real)
    from xpukit.loading.training.graph_capture import capture

    run = capture(net, (torch.randn(2, 4),), stand_ins, grads, backend=RerunBackend(), pool=None)
    x = torch.randn(2, 4)
    run(x).sum().backward()
    got = shared.weight.grad.clone()
    shared.weight.grad = None
    net(x).sum().backward()
    torch.testing.assert_close(got, shared.weight.grad)


def test_a_parameter_the_code_does_not_use_keeps_no_gradient() -> None:
    from xpukit.loading.training.graph_capture import SharedGrads, StandIns, capture

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    stand_ins = StandIns([net])
    run = capture(
        net[0],
        (torch.randn(2, 4),),
        stand_ins,
        SharedGrads(stand_ins.real),
        backend=RerunBackend(),
        pool=None,
    )
    run(torch.randn(2, 4)).sum().backward()
    assert net[0].weight.grad is not None and net[1].weight.grad is None  # as autograd leaves it


def test_cuda_captures_do_not_fail_on_other_threads_cuda_calls() -> None:
    """A data loader's pin-memory thread may call into CUDA during a capture mid-training:
    capture_error_mode="thread_local" (torch.cuda.graph) keeps that from invalidating it."""
    from types import SimpleNamespace

    from xpukit.loading.device_graph import GraphBackend

    seen: dict[str, Any] = {}

    def graph(g: Any, **options: Any) -> Any:
        seen.update(options)
        return contextlib.nullcontext()

    for kind, want in (("cuda", "thread_local"), ("xpu", None)):
        backend = GraphBackend(kind)
        backend.module = SimpleNamespace(graph=graph, Stream=object, current_device=lambda: 0)
        backend._blas_workspace = lambda: None  # type: ignore[method-assign]  (no device here)
        seen.clear()
        backend.capture(None, lambda: None, "pool")
        assert seen.get("capture_error_mode") == want and seen["pool"] == "pool"


def test_warm_ups_allocate_from_the_captures_pool_on_the_captures_stream() -> None:
    """A warm-up pass before a capture takes its memory from the graphs' own pool (a MemPool, where
    torch has them) on the stream the captures use, so it reuses what earlier captures left free."""
    from types import SimpleNamespace

    from xpukit.loading.device_graph import GraphBackend

    events: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def record(what: str, value: Any) -> Any:
        events.append((what, value))
        yield

    def graph(g: Any, **options: Any) -> Any:
        return record("capture", (options["pool"], options["stream"]))

    module = SimpleNamespace(
        graph=graph,
        Stream=object,
        MemPool=lambda: SimpleNamespace(id=(1, 2)),
        stream=lambda s: record("stream", s),
        use_mem_pool=lambda p: record("use_mem_pool", p),
        current_device=lambda: 0,
    )
    backend = GraphBackend("cuda")
    backend.module, backend.mem_pools = module, True
    backend._blas_workspace = lambda: events.append(("blas", None))  # type: ignore[method-assign]
    pool = backend.pool()
    with backend.warm_up(pool):
        pass
    backend.capture(None, lambda: None, pool)
    stream = backend._side()
    # the BLAS workspace of the stream is made before each warm-up and capture, outside the pool
    assert events == [
        ("blas", None),
        ("stream", stream),
        ("use_mem_pool", pool.handle),
        ("blas", None),
        ("capture", ((1, 2), stream)),
    ]
    # Without MemPool (an older torch): a plain graph pool handle, and the warm-up only changes stream.
    backend.mem_pools, events[:] = False, []
    with backend.warm_up((3, 4)):
        pass
    assert events == [("blas", None), ("stream", stream)]


def test_each_capture_first_hands_the_default_pools_cache_back() -> None:
    """The first training pass runs eagerly and leaves a step's activations cached in the default
    pool, which the graphs' pool cannot reuse; every capture releases that cache before its warm-up
    (on an H200 the two held the activations twice: docs/layer-graphs.md "CUDA graphs of the decoder
    layers")."""
    from types import SimpleNamespace

    from xpukit.loading.device_graph import GraphBackend
    from xpukit.loading.training.graph_capture import SharedGrads

    net = _net()
    backend = RerunBackend()
    shared = SharedGrads([p for p in net.parameters() if p.requires_grad])
    _captured(net, backend, shared, 3)
    _captured(net, backend, shared, 5)
    assert backend.events == ["release", "warm-up", "capture", "capture"] * 2

    emptied: list[bool] = []
    real = GraphBackend("cuda")
    real.module = SimpleNamespace(
        empty_cache=lambda: emptied.append(True), is_current_stream_capturing=lambda: False
    )
    real.release_cached()
    assert emptied == [True]


def test_a_capture_without_a_warm_up_may_record_while_the_device_runs() -> None:
    """``settle=False``: a capture with no warm-up pass neither waits for the device nor releases its
    cache, and its graphs are captured unsettled; a warm-up pass still settles first (it allocates).
    The gradients are the same either way."""
    from xpukit.loading.training.graph_capture import SharedGrads, StandIns, capture

    class Counting(RerunBackend):
        def synchronize(self) -> None:
            self.events.append("sync")

    grads = []
    for settle, warmup, want in (
        (False, 0, ["warm-up", "capture unsettled", "capture unsettled"]),
        (False, 1, ["sync", "release", "warm-up", "sync", "capture", "capture"]),
        (True, 0, ["sync", "release", "warm-up", "sync", "capture", "capture"]),
    ):
        net = _net()
        backend = Counting()
        params = [p for p in net.parameters() if p.requires_grad]
        shared = SharedGrads(params)
        x = torch.randn(3, 4)
        run = capture(
            net, (x,), StandIns([net]), shared, backend=backend, pool=None, warmup=warmup, settle=settle
        )
        assert backend.events == want
        run(x).sum().backward()
        grads.append([p.grad.clone() for p in params])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b)


def test_an_unsettled_capture_begins_on_the_side_stream_without_waiting() -> None:
    """``GraphBackend.capture(..., settle=False)`` calls the graph's own ``capture_begin`` (with the
    pool and, on CUDA, the thread-local error mode) and ``capture_end`` on the captures' stream,
    never the device module's ``graph`` context (which synchronizes and empties the caches); the
    capture ends also when the recorded code raises."""
    from types import SimpleNamespace

    from xpukit.loading.device_graph import GraphBackend

    events: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def record(what: str, value: Any) -> Any:
        events.append((what, value))
        yield
        events.append(("left " + what, value))

    class Graph:
        def capture_begin(self, *pool: Any, **options: Any) -> None:
            events.append(("begin", (pool, options)))

        def capture_end(self) -> None:
            events.append(("end", None))

    module = SimpleNamespace(
        graph=lambda g, **o: pytest.fail("the settling graph context was entered"),
        synchronize=lambda: pytest.fail("synchronized"),
        empty_cache=lambda: pytest.fail("emptied the cache"),
        stream=lambda s: record("stream", s),
        Stream=object,
        current_device=lambda: 0,
    )
    for kind, options in (("cuda", {"capture_error_mode": "thread_local"}), ("xpu", {})):
        backend = GraphBackend(kind)
        backend.module = module
        backend._blas_workspace = lambda: None  # type: ignore[method-assign]  (no device here)
        events.clear()
        split = backend.capture(
            Graph(), lambda: events.append(("body", None)), SimpleNamespace(id=(1, 2)), False
        )
        stream = backend._side()
        assert events == [
            ("stream", stream),
            ("begin", (((1, 2),), options)),
            ("body", None),
            ("end", None),
            ("left stream", stream),
        ]
        assert set(split) == {"graph_enter", "record", "graph_end"}

    def fails() -> None:
        raise RuntimeError("bad layer")

    events.clear()
    with pytest.raises(RuntimeError, match="bad layer"):
        backend.capture(Graph(), fails, None, False)
    assert events[1] == ("begin", ((), {})) and ("end", None) in events


def test_each_capture_records_where_its_time_went() -> None:
    """A capture's milliseconds split into its warm-up, its two graphs and, where the backend times
    them, each graph's wait before recording, its recording and its end (the instantiation)."""
    import time
    from types import SimpleNamespace

    from xpukit.loading.device_graph import GraphBackend

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    graphs = _plain_graphs(layers)
    for rows in (2, 2, 3):  # the first call runs eagerly; then shapes 2 and 3 are captured
        _stack(graphs, torch.randn(rows, 4)).sum().backward()
    each = graphs.record()["each"]
    assert [c["tokens"] for c in each] == [2, 3]  # Linear rows stand for the packed row's tokens
    for cost in each:
        # before the capture: the gradients' buffers, the sample, the RoPE check, the host slots
        assert set(cost["parts"]) == {"prepare", "host_slots", "warm_up", "forward", "backward"}
        assert all(ms >= 0 for ms in cost["parts"].values()) and cost["parts"]["host_slots"] == 0
        assert sum(cost["parts"].values()) <= cost["ms"] + 5  # parts of the whole (rounded)
    assert graphs.stats["capture_forward_ms"] == sum(c["parts"]["forward"] for c in each)

    @contextlib.contextmanager
    def graph(g: Any, **options: Any) -> Any:
        time.sleep(0.02)  # torch's entry: synchronize, empty the caches, begin
        yield
        time.sleep(0.03)  # the capture's end: instantiate

    backend = GraphBackend("cuda")
    backend.module = SimpleNamespace(graph=graph, Stream=object, current_device=lambda: 0)
    backend._blas_workspace = lambda: None  # type: ignore[method-assign]  (no device here)
    split = backend.capture(None, lambda: time.sleep(0.01), "pool")
    assert set(split) == {"graph_enter", "record", "graph_end"}
    assert split["graph_enter"] >= 20 and split["record"] >= 10 and split["graph_end"] >= 30


def test_each_capture_counts_its_own_two_graphs_only() -> None:
    """A backend's split of a graph adds to that capture's parts: twice a capture (forward and
    backward), never carried into the next capture's warm-up."""

    class TimedBackend(RerunBackend):
        def capture(self, graph: RerunGraph, body: Any, pool: Any, settle: bool = True) -> dict[str, float]:
            super().capture(graph, body, pool, settle)
            return {"record": 5.0}

    from xpukit.loading.training.graph_capture import SharedGrads

    net = _net()
    backend = TimedBackend()
    shared = SharedGrads([p for p in net.parameters() if p.requires_grad])
    for rows in (3, 5):
        cost = _captured(net, backend, shared, rows).cost
        assert cost["record"] == 10.0 and set(cost) == {"warm_up", "forward", "backward", "record"}


def test_plain_values_of_other_types_are_other_shapes() -> None:
    from xpukit.loading.training.layer_calls import flatten

    signatures = {flatten([((), {"flag": value})])[2] for value in (True, 1, 1.0)}
    assert len(signatures) == 3  # equal in Python, but a layer may branch on the type
