"""The frozen input embedding in host memory under a budget (docs/training-plan.md "The input embedding in
host memory"): the plan moves it only where the room it frees lets a faster step fit; the load moves
it and the model computes what it computed before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit import plan_load
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.model.shape import model_shape
from xpukit.planning.training.host_embedding import host_embedding_bytes
from xpukit.planning.training.lora_request import LoraRequest


def _plan(seq: int, budget: str | None, facts: str = "h200", **kw: Any) -> Any:
    kw.setdefault("lora", True)
    memory = {"max_memory": {0: budget}} if budget else {}
    return plan_load(
        reference_config("qwen3-8b"), facts=facts, quantize="4bit", batch_size=4, seq_len=seq, **memory, **kw
    )


@pytest.fixture
def liger(monkeypatch: pytest.MonkeyPatch) -> None:
    import xpukit.planning.training.fit as fit

    monkeypatch.setattr(fit, "liger_availability", lambda backend: (True, "injected"))


def test_8gb_takes_the_graphs_with_the_embedding_in_host_memory(liger: None) -> None:
    """8B QLoRA, 4 × 512 under 8 GB on the H200's facts: with the embedding's 1.24 GB freed the
    checkpointed rung in the graphs fits the worst step, where on the device only the eager offloaded
    rung by tokens did; the fixed part no longer counts it."""
    plan = _plan(512, "8GB")
    training = plan.training
    decision = plan.decision("input_embedding")
    assert decision.value == "host" and "host memory" in decision.reason
    assert training.embedding_on_host and training.graphs and not training.split_by_tokens
    assert training.gradient_checkpointing is True and training.micro_batch == 4 and training.fits
    assert "input embedding" in training.fixed_rule
    assert "input embedding in host memory" in training.summary_line()
    twelve = _plan(512, "12GB")  # the same weights, the table on the device
    assert twelve.training.fixed - training.fixed == 151936 * 4096 * 2


def test_it_stays_on_the_device_where_it_gains_nothing(liger: None) -> None:
    """With room, and where the same step fits either way (12 GB), the table stays; the decision says why."""
    room = _plan(512, None)
    assert not room.training.embedding_on_host
    assert all(d.name != "input_embedding" for d in room.decisions)  # nothing to decide
    twelve = _plan(512, "12GB")
    assert twelve.decision("input_embedding").value == "device"
    assert "would not let a faster step fit" in twelve.decision("input_embedding").reason
    assert not twelve.training.embedding_on_host


def _request(config: dict[str, Any]) -> LoraRequest:
    return LoraRequest(
        kind="new", config=config, adapter_path=None, gradient_checkpointing=True, reason="test"
    )


def test_only_a_frozen_untied_embedding_on_one_gpu_may_move() -> None:
    config = reference_config("qwen3-8b")  # untied: 151 936 × 4 096

    def moved(config: Any, request: LoraRequest, backend: str = "cuda", single: bool = True) -> int:
        return host_embedding_bytes(
            config, model_shape(config), request, backend=backend, compute_bytes=2, single_process=single
        )

    plain = _request({"r": 16, "target_modules": "all-linear"})
    assert moved(config, plain) == 151936 * 4096 * 2
    assert moved(config, plain, backend="xpu") > 0
    assert moved(config, plain, backend="cpu") == 0
    assert moved(config, plain, single=False) == 0
    trained = _request({"r": 16, "modules_to_save": ["embed_tokens"]})
    assert moved(config, trained) == 0
    tied = reference_config("qwen3-0.6b")
    assert tied.tie_word_embeddings is True
    assert moved(tied, plain) == 0


def test_the_moved_module_gathers_on_the_host_and_stays_there(tiny_models: Any) -> None:
    """On the CPU (where both memories are one) the wrapper's rules: the same output, hooks see it,
    ``.to()`` leaves the table, the module is last among its parent's children."""
    import torch

    from xpukit import load_for_xpu
    from xpukit.loading.training import host_embedding as he

    model = load_for_xpu(Path(tiny_models["llama"]), device="cpu", dtype="float32", seed=0, lora=True)
    base = model.get_base_model()
    embed = base.get_input_embeddings()
    ids = torch.tensor([[5, 7, 9]])
    before = embed(ids).clone()
    seen = []
    embed.register_forward_hook(lambda mod, args, out: seen.append(out.device))
    assert he.install_host_embedding(model) == "input embedding: already in host memory"
    real_device = embed.weight.device  # the wrapper alone (both memories are the CPU's here)
    he._wrap(embed, real_device)
    he._move_last(base, embed)
    torch.testing.assert_close(embed(ids), before)
    assert seen and seen[-1] == real_device
    assert list(base.model._modules)[-1] == "embed_tokens"
    assert next(base.parameters()) is not embed.weight
    model.to(torch.float64)
    assert embed.weight.dtype == torch.float32  # the table is left alone by moves of the model


@pytest.mark.gpu
def test_training_with_the_embedding_in_host_memory_matches_on_cuda(tiny_models: Any) -> None:
    """On CUDA: a 4-bit LoRA step with the table in host memory gives the same loss and adapter
    gradients as with it on the device, and frees its bytes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from xpukit import load_for_xpu
    from xpukit.loading.training.host_embedding import install_host_embedding

    ids = torch.randint(3, 200, (2, 24), device="cuda")
    results = []
    for move in (False, True):
        model = load_for_xpu(Path(tiny_models["llama"]), device="cuda", dtype="bfloat16", seed=0, lora=True)
        if move:
            note = install_host_embedding(model)
            assert "host memory" in note, note
            assert model.get_base_model().get_input_embeddings().weight.device.type == "cpu"
            assert model.get_base_model().device.type == "cuda"
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-3)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=2e-2, atol=1e-3, msg=name)


def test_weights_apart_skips_the_allocator_warmup_only_inside_and_only_when_wanted() -> None:
    from transformers import modeling_utils

    from xpukit.loading.training.host_embedding import weights_apart

    original = modeling_utils.caching_allocator_warmup
    with weights_apart(False):
        assert modeling_utils.caching_allocator_warmup is original
    with pytest.raises(RuntimeError), weights_apart(True):
        assert modeling_utils.caching_allocator_warmup is not original
        assert modeling_utils.caching_allocator_warmup(None, {}, None) is None
        raise RuntimeError("a failed load")
    assert modeling_utils.caching_allocator_warmup is original
