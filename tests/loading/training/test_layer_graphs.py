"""Graphs of the decoder layers: the decision (pure), the wrappers' state machine and eager path (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load
from xpukit.planning.training.lora_request import resolve_lora


def _decision(plan: Any) -> Any:
    return next((d for d in plan.decisions if d.name == "layer_graphs"), None)


def test_on_for_cuda_fused_qlora_without_checkpointing() -> None:
    plan = plan_load(
        reference_config("qwen3-8b"), facts="h200", quantize="4bit", lora=True, batch_size=4, seq_len=512
    )
    assert plan.decision("fused_lora").value is True
    assert plan.training is not None and plan.training.gradient_checkpointing is False
    graphs = _decision(plan)
    assert graphs.value is True and graphs.source == "auto"
    assert "torch.cuda.graph" in graphs.reason and "13 043" in graphs.reason


def test_on_for_intel_gpus_with_a_torch_that_has_xpu_graphs() -> None:
    from dataclasses import replace

    from xpukit.machine.profiles import machine_profile

    args: dict[str, Any] = {"quantize": "4bit", "lora": True, "batch_size": 4, "seq_len": 512}
    plan = plan_load(reference_config("qwen3-8b"), facts="max-1550", **args)
    graphs = _decision(plan)
    assert graphs.value is True and "torch.xpu.graph" in graphs.reason
    assert "not yet run on an Intel GPU" in graphs.reason and "doctor --selftest" in graphs.reason
    old = replace(machine_profile("max-1550"), torch_version="2.10.0+xpu")
    graphs = _decision(plan_load(reference_config("qwen3-8b"), facts=old, **args))
    assert graphs.value is False and "need torch >= 2.11" in graphs.reason and "2.10.0+xpu" in graphs.reason
    with pytest.raises(InvalidRequestError, match=r"graphs': True.*need torch >= 2.11.*Fix"):
        plan_load(reference_config("qwen3-8b"), facts=old, **(args | {"lora": {"graphs": True}}))


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"facts": "cpu"}, "need CUDA or an Intel GPU"),
        ({"lora": {"fused": False}}, "fused 4-bit LoRA path"),
    ],
)
def test_off_where_not_measured(kwargs: dict[str, Any], why: str) -> None:
    args: dict[str, Any] = {
        "facts": "h200",
        "quantize": "4bit",
        "lora": True,
        "batch_size": 4,
        "seq_len": 512,
    }
    plan = plan_load(reference_config("qwen3-8b"), **(args | kwargs))
    graphs = _decision(plan)
    assert graphs.value is False and why in graphs.reason and graphs.source == "auto"


def test_the_user_turns_it_off_or_insists() -> None:
    args: dict[str, Any] = {"facts": "h200", "quantize": "4bit", "batch_size": 4, "seq_len": 512}
    off = _decision(plan_load(reference_config("qwen3-8b"), lora={"graphs": False}, **args))
    assert (off.value, off.source) == (False, "user") and "'graphs': False" in off.reason
    on = _decision(plan_load(reference_config("qwen3-8b"), lora={"graphs": True}, **args))
    assert (on.value, on.source) == (True, "user") and "'graphs': True} given" in on.reason
    with pytest.raises(InvalidRequestError, match=r"graphs': True.*need CUDA or an Intel GPU.*Fix"):
        plan_load(reference_config("qwen3-8b"), lora={"graphs": True}, **(args | {"facts": "cpu"}))
    with pytest.raises(InvalidRequestError, match="must be True or False"):
        resolve_lora({"graphs": "yes"}, quantized=True)


def test_every_checkpointing_rung_runs_captured_with_its_buffers_in_the_fit() -> None:
    """Plain and offloaded checkpointing both run inside the graphs (the recomputation captured; with
    "offload" each layer's input in a host slot): the plan takes them by itself where the estimate,
    the graphs' buffers and the recomputation in their pool included, fits; a budget that fits only
    without those buffers runs eagerly, with that reason."""
    args: dict[str, Any] = {"facts": "h200", "quantize": "4bit", "batch_size": 4, "seq_len": 512}
    for gc, text in ((True, "checkpointed inside the graphs"), ("offload", "pinned host slot")):
        for lora in ({"gradient_checkpointing": gc}, {"graphs": True, "gradient_checkpointing": gc}):
            plan = plan_load(reference_config("qwen3-8b"), lora=lora, **args)
            graphs = _decision(plan)
            assert graphs.value is True and text in graphs.reason, lora
            assert plan.training is not None and plan.training.gradient_checkpointing == gc
            assert plan.training.graphs and plan.training.estimate["graph_buffers"] > 0
    eager = plan_load(
        reference_config("qwen3-8b"), lora={"graphs": False, "gradient_checkpointing": True}, **args
    )
    assert eager.training is not None and "graph_buffers" not in eager.training.estimate
    # 6.8 GB (the input embedding in host memory): offloaded checkpointing fits 4 x 512 only without the
    # graphs' memory (no liger here: the chunked loss's logits and the recomputation each keep a pool)
    # -> eager, and it says why
    budget = plan_load(reference_config("qwen3-8b"), lora=True, max_memory={0: "6.8GB"}, **args)
    assert budget.training is not None and budget.training.gradient_checkpointing == "offload"
    assert not budget.training.graphs and "graph_buffers" not in budget.training.estimate
    assert (
        _decision(budget).value is False and "only without the graphs' own memory" in _decision(budget).reason
    )
    # asking for the graphs there: only the captured rungs are tried (the leanest with a token budget)
    asked = plan_load(reference_config("qwen3-8b"), lora={"graphs": True}, max_memory={0: "6.8GB"}, **args)
    assert asked.training is not None and asked.training.graphs and _decision(asked).value is True
    assert asked.training.estimate["graph_buffers"] > 0  # with the recomputation the eager loss cannot reuse
    # training_args leaves transformers' checkpointing off: xpukit checkpoints inside the graphs
    from xpukit.machine.profiles import device_profile
    from xpukit.training.keywords import TrainingContext, training_kwargs

    inside_plan = plan_load(reference_config("qwen3-8b"), lora={"gradient_checkpointing": True}, **args)
    h200 = device_profile("h200")
    inside = TrainingContext(training=inside_plan.training, checkpoint_in_graphs=True)
    assert training_kwargs(h200, context=inside, output_dir="o")["gradient_checkpointing"] is False
    # ... while the rules that follow checkpointing still see it: the 8-bit optimizer where nothing fits
    from dataclasses import replace

    assert inside_plan.training is not None
    tight = TrainingContext(
        training=replace(inside_plan.training, fits=False),
        checkpoint_in_graphs=True,
        gradient_checkpointing=True,
        quantized=True,
        bitsandbytes_version="0.50.2",
    )
    chosen = training_kwargs(h200, context=tight, output_dir="o")
    assert chosen["gradient_checkpointing"] is False and chosen["optim"] == "paged_adamw_8bit"
    # a plan that fits counted the fused AdamW's fp32 states: it takes that one, checkpointed or not
    fits = replace(tight, training=inside_plan.training)
    assert inside_plan.training.fits and training_kwargs(h200, context=fits)["optim"] == "adamw_torch_fused"
    plain = TrainingContext(training=inside_plan.training)
    assert training_kwargs(h200, context=plain, output_dir="o")["gradient_checkpointing"] is True


def test_no_decision_without_new_adapters() -> None:
    assert _decision(plan_load(reference_config("qwen3-8b"), facts="h200")) is None


def test_wrapped_layers_run_eagerly_off_cuda_and_give_the_same_result(tiny_model: Path) -> None:
    torch = pytest.importorskip("torch")
    from xpukit import load_for_xpu
    from xpukit.loading.training.layer_graphs import install_layer_graphs

    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(3))
    results = []
    for wrapped in (False, True):
        model = load_for_xpu(tiny_model, device="cpu", dtype="float32", seed=0, lora=True)
        if wrapped:
            assert "graphs of the 2 decoder layers" in install_layer_graphs(model)
        model.train()
        for _ in range(2):  # the second call of a shape is where CUDA would capture
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        if wrapped:
            graphs = model.xpukit_layer_graphs
            assert graphs.stats["eager"] == 2 and graphs.stats["graphed"] == 0 and graphs.key is None
            assert graphs.eager_reasons == {"not a CUDA/XPU call with position embeddings": 2}
            with torch.no_grad():
                model(input_ids=ids)
            assert graphs.eager_reasons["no grad or eval mode"] == 1
    torch.testing.assert_close(results[1][0], results[0][0])
    for a, b in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(a, b)
    state = model.state_dict()
    assert not any(".layer." in name for name in state)  # module names unchanged: adapters save as before


def _faked(monkeypatch: pytest.MonkeyPatch, layers: list[Any]) -> tuple[Any, list[tuple[Any, ...]]]:
    """A LayerGraphs over plain layers whose capture is faked (CPU): replays are recorded."""
    from xpukit.loading.training.layer_calls import Watch
    from xpukit.loading.training.layer_graphs import LayerGraphs

    graphs = LayerGraphs(layers, backend=object())  # a backend given: as if on CUDA
    graphs.forwards = [lambda h, *a, layer=layer, **k: layer(h) for layer in layers]
    replays: list[tuple[Any, ...]] = []

    def fake_capture(hidden: Any, inputs: Any, templates: Any, key: Any, calls: Any) -> None:
        def run(h: Any, *values: Any, key: Any = key) -> Any:
            replays.append(key)
            for layer in layers:
                h = layer(h)
            return h

        graphs._graphs[key] = run
        graphs._watch = Watch(layers)
        graphs.stats["captures"] += 1

    monkeypatch.setattr(graphs, "_capture", fake_capture)
    return graphs, replays


def test_first_call_eager_then_each_shape_captured_and_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state machine on the CPU, with the capture faked: the first training call runs eagerly,
    then each new shape (input and mask) is captured on first sight and replayed after."""
    torch = pytest.importorskip("torch")
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    graphs, replays = _faked(monkeypatch, layers)
    rotary = (torch.zeros(1), torch.zeros(1))

    def step(rows: int = 2, mask: Any = None) -> Any:
        h = x = torch.randn(rows, 4)
        for i in range(3):
            h = graphs.forward(i, h, attention_mask=mask, position_embeddings=rotary)
        h.sum().backward()
        return x, h

    step()
    assert graphs.eager_reasons == {
        "first training call (warms lazily built state; shapes are captured from the next)": 1
    }
    assert not replays
    x, out = step()
    step()
    assert graphs.stats["captures"] == 1 and graphs.stats["graphed"] == 2 and len(replays) == 2
    torch.testing.assert_close(out, layers[2](layers[1](layers[0](x))))  # layers 1, 2 pass it on
    step(rows=3)  # another shape: captured at once, then replayed
    step(rows=3)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    step(rows=3, mask=mask)  # the same input shape with a mask: a shape of its own
    assert graphs.stats["captures"] == 3 and graphs.stats["graphed"] == 5 and len(graphs.keys) == 3
    first_layer = graphs.keys[2][-1][0]  # (positional, keyword) signature of layer 0's arguments
    assert ("attention_mask", ("tensor", 0, (1, 1, 3, 3), torch.bool)) in first_layer[1]


def test_the_first_call_runs_each_layer_checkpointed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager first call would leave a step's activations cached beside the graphs' pool: it
    keeps only the layers' inputs, and its backward recomputes each layer once (the same gradients);
    later eager calls (a shape beyond the bound) run plain."""
    torch = pytest.importorskip("torch")
    layers = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(3)]
    graphs, _ = _faked(monkeypatch, layers)
    runs = [0] * 3
    graphs.forwards = [
        lambda h, *a, i=i, layer=layer, **k: (runs.__setitem__(i, runs[i] + 1), layer(h))[1]
        for i, layer in enumerate(layers)
    ]
    for layer in layers:
        layer.train()
    rotary = (torch.zeros(1), torch.zeros(1))
    x = torch.randn(2, 4, requires_grad=True)
    h = x
    for i in range(3):
        h = graphs.forward(i, h, attention_mask=None, position_embeddings=rotary)
    assert runs == [1, 1, 1]
    h.sum().backward()
    assert runs == [2, 2, 2]  # recomputed in the backward: checkpointed
    want = torch.autograd.grad(layers[2](layers[1](layers[0](x))).sum(), x)[0]
    torch.testing.assert_close(x.grad, want)
    graphs.max_shapes = 0  # every later call eager: plain, not checkpointed
    h = torch.randn(3, 4, requires_grad=True)
    for i in range(3):
        h = graphs.forward(i, h, attention_mask=None, position_embeddings=rotary)
    h.sum().backward()
    assert runs == [3, 3, 3]


def test_shapes_beyond_the_bound_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    graphs, replays = _faked(monkeypatch, layers)
    graphs.max_shapes = 2
    rotary = (torch.zeros(1), torch.zeros(1))
    for rows in (1, 1, 2, 3, 3, 1):
        h = torch.randn(rows, 4)
        for i in range(2):
            h = graphs.forward(i, h, attention_mask=None, position_embeddings=rotary)
        h.sum().backward()
    assert graphs.stats["captures"] == 2 and graphs.eager_reasons["a shape beyond the 2 captured"] == 2
    assert graphs.stats["graphed"] == 3 and len(replays) == 3


def test_a_forward_before_the_previous_backward_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from xpukit.loading.training.layer_graphs import LayerGraphs

    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    graphs, _ = _faked(monkeypatch, layers)
    monkeypatch.setattr(graphs, "_why_eager", lambda *a: LayerGraphs._why_eager(graphs, *a))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")), raising=False)
    rotary = (torch.zeros(1), torch.zeros(1))

    def forward() -> Any:
        h = torch.randn(2, 4)
        for i in range(2):
            h = graphs.forward(i, h, attention_mask=None, position_embeddings=rotary)
        return h

    for layer in layers:
        layer.train()
    forward().sum().backward()  # eager: the first training call
    kept = forward()  # graphed, its backward not run yet
    forward()  # must not reuse the graph's buffers while `kept` is alive
    assert graphs.eager_reasons["a forward before the previous one's backward"] == 1
    kept.sum().backward()
    forward().sum().backward()
    assert graphs.stats["graphed"] == 2


def test_position_reading_kernels_and_arguments_the_graphs_cannot_carry_run_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from xpukit.loading.training.layer_graphs import LayerGraphs

    layers = [torch.nn.Linear(4, 4)]
    hidden = torch.randn(2, 4)
    rotary = (torch.zeros(1), torch.zeros(1))
    flash = LayerGraphs(layers, attention="flash_attention_2", backend=object())
    flash._warm = True
    why = flash._why_eager(hidden, None, {"position_embeddings": rotary})
    assert why is not None and "flash_attention_2" in why
    assert LayerGraphs(layers)._why_eager(hidden, None, {"position_embeddings": rotary}) == (
        "not a CUDA/XPU call with position embeddings"
    )
    # An argument that is neither a tensor nor a plain value (flex attention's BlockMask, say): the
    # layers run eagerly over what they handed over, with the reason.
    graphs, replays = _faked(monkeypatch, [torch.nn.Linear(4, 4) for _ in range(2)])

    class BlockMask:
        pass

    for _ in range(2):
        h = x = torch.randn(2, 4)
        for i in range(2):
            h = graphs.forward(i, h, attention_mask=BlockMask(), position_embeddings=rotary)
    assert graphs.eager_reasons["a layer argument of type BlockMask"] == 1 and not replays
    torch.testing.assert_close(h, graphs.layers[1](graphs.layers[0](x)))


def test_layers_of_two_kinds_hand_over_their_own_mask_and_position_embeddings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sliding-window models give each layer type its own mask and rotary tensors: each layer's
    arguments are graph inputs (one per distinct tensor), so the stack still replays."""
    torch = pytest.importorskip("torch")
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    graphs, replays = _faked(monkeypatch, layers)
    local, full = (torch.zeros(1), torch.zeros(1)), (torch.ones(1), torch.ones(1))
    masks = {"local": torch.ones(1, 1, 2, 2, dtype=torch.bool), "full": torch.zeros(1, 1, 2, 2)}
    kinds = ["local", "local", "full"]
    for _ in range(3):
        h = torch.randn(2, 4)
        for i, kind in enumerate(kinds):
            rotary = local if kind == "local" else full
            h = graphs.forward(i, h, attention_mask=masks[kind], position_embeddings=rotary)
        h.sum().backward()
    assert graphs.stats["captures"] == 1 and graphs.stats["graphed"] == 2 and len(replays) == 2
    signature = graphs.keys[0][-1]
    inputs = {part[1] for layer in signature for name, part in layer[1] if name == "attention_mask"}
    assert inputs == {0, 3}  # two masks, each one input shared by its layers (rotary pairs: 1-2, 4-5)


def test_stand_in_parameters_share_the_real_ones_storage() -> None:
    torch = pytest.importorskip("torch")
    from xpukit.loading.training.graph_capture import StandIns

    layer = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    layer[0].bias.requires_grad_(False)
    real = [p for p in layer.parameters() if p.requires_grad]
    stand_ins = StandIns([layer])
    assert stand_ins.real == real and len(stand_ins.leaves) == 3
    pairs = zip(stand_ins.leaves, real, strict=True)
    assert all(s is not r and s.data_ptr() == r.data_ptr() for s, r in pairs)
    with stand_ins.installed():
        assert [p for p in layer.parameters() if p.requires_grad] == stand_ins.leaves
        layer(torch.randn(5, 3)).sum().backward()  # through the stand-ins: the real ones get nothing
    assert [p for p in layer.parameters() if p.requires_grad] == real
    assert all(r.grad is None for r in real) and all(s.grad is not None for s in stand_ins.leaves)


def test_a_model_whose_mlp_cannot_be_fused_is_told_before_loading(tiny_model_factory: Any) -> None:
    """A ReLU-gated MLP is not one the fused path computes: the plan says the fused path is partial,
    refuses an insisted one before any weight is read, and keeps the layer graphs off (measured on
    whole fused blocks)."""
    path = tiny_model_factory("gemma", hidden_activation="relu")
    plan = plan_load(path, facts="h200", quantize="4bit", lora=True, batch_size=2, seq_len=64)
    fused = plan.decision("fused_lora")
    assert fused.value is True and "the MLP keeps peft's modules" in fused.reason and "'relu'" in fused.reason
    graphs = _decision(plan)
    assert graphs.value is False and "fused 4-bit LoRA path" in graphs.reason
    with pytest.raises(InvalidRequestError, match=r"'fused': True.*MLP cannot be fused.*Fix"):
        plan_load(path, facts="h200", quantize="4bit", lora={"fused": True}, batch_size=2, seq_len=64)


def test_off_in_a_launched_job() -> None:
    """DDP/FSDP hook the parameters' gradient accumulators, which the capture's stand-ins bypass."""
    from dataclasses import replace

    from xpukit.machine.launch import parse_launch
    from xpukit.machine.profiles import machine_profile

    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    machine = replace(machine_profile("h200", 2), launch=parse_launch(env))
    args: dict[str, Any] = {"facts": machine, "quantize": "4bit", "batch_size": 4, "seq_len": 512}
    graphs = _decision(plan_load(reference_config("qwen3-8b"), lora=True, **args))
    assert graphs.value is False and "launched job of 2 processes" in graphs.reason
    with pytest.raises(InvalidRequestError, match="launched job"):
        plan_load(reference_config("qwen3-8b"), lora={"graphs": True}, **args)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["layer-graphs", "layer-graphs-checkpointed"])
def test_the_doctor_selftest_layer_graph_check_says_why_nothing_replayed_off_cuda(checkpoint: bool) -> None:
    """On the CPU the selftest's checks run both models and report that no graph replayed (on a
    CUDA or XPU device the same checks capture and replay: docs/doctor.md)."""
    torch = pytest.importorskip("torch")
    from xpukit.doctor.selftest import _graphs_check

    with pytest.raises(RuntimeError, match=r"not replayed.*not a CUDA/XPU call"):
        _graphs_check(torch, "cpu", checkpoint=checkpoint)


def test_between_the_rungs_only_the_layers_the_budget_needs_are_checkpointed() -> None:
    """At 10-12 GB the 8B shape's step does not fit without checkpointing but fits with room to spare
    with every layer checkpointed: the plan checkpoints the fewest layers whose step fits inside the
    graphs (docs/training-plan.md "Fewer checkpointed layers"), fewer with more room; a user's own
    checkpointing and the eager rungs keep every layer."""
    from xpukit.planning.model.shape import model_shape

    args: dict[str, Any] = {"facts": "h200", "quantize": "4bit", "batch_size": 4, "seq_len": 512}
    counts = []
    for budget in ("10GB", "12GB", "14GB"):
        plan = plan_load(reference_config("qwen3-8b"), lora=True, max_memory={0: budget}, **args)
        training = plan.training
        assert training is not None and training.gradient_checkpointing is True and training.graphs
        assert training.checkpoint_layers is not None and 0 < training.checkpoint_layers < 36
        assert training.fits and training.estimate["peak"] <= training.room
        reason = plan.decision("gradient_checkpointing").reason
        assert f"for {training.checkpoint_layers} of the 36 layers" in reason
        counts.append(training.checkpoint_layers)
    assert counts[0] > counts[1] > counts[2]
    # the fewest: one layer fewer checkpointed would not fit the same room
    from xpukit.planning.training.activation_memory import dequant_transient
    from xpukit.planning.training.rungs import Rungs

    shape = model_shape(reference_config("qwen3-8b"))
    plan = plan_load(reference_config("qwen3-8b"), lora=True, max_memory={0: "12GB"}, **args)
    assert plan.training is not None and plan.training.loss == "liger"
    request = resolve_lora(True, quantized=True)
    rungs = Rungs(
        shape,
        request,
        2,
        "cuda",
        True,
        True,
        True,
        dequant_transient(shape, compute_bytes=2, fused_lora=True),
        True,
    )
    rung, room, k = (True, True, True), plan.training.room, plan.training.checkpoint_layers
    assert rungs.fewest_checkpointed(rung, 4 * 512, room) == k and k is not None
    spare = int(room / 1.05)  # 5 % of the room kept spare (rungs.PARTLY_SPARE)
    assert rungs.peak(rung, 4 * 512, k) <= spare < rungs.peak(rung, 4 * 512, k - 1)
    assert rungs.peak(rung, 4 * 512) < rungs.peak(rung, 4 * 512, k)  # the room every layer would leave
    assert plan.lora is not None and plan.lora.checkpoint_layers == k  # what loading installs
    full = plan_load(reference_config("qwen3-8b"), lora=True, **args).training
    assert full is not None and full.checkpoint_layers is None and not full.gradient_checkpointing
    assert model_shape(reference_config("qwen3-8b")).layers == 36
    for lora in ({"gradient_checkpointing": True}, {"graphs": False}):
        kept = plan_load(reference_config("qwen3-8b"), lora=lora, max_memory={0: "12GB"}, **args).training
        assert kept is not None and kept.checkpoint_layers is None, lora
