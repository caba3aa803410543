"""liger-kernel's fused loss in xpukit's chunks: the chunk rule (pure) and the call xpukit makes.

liger-kernel needs Triton, which the CPU runs of these tests lack; its functional entry point is
replaced by a stand-in with the same signature that computes the loss in PyTorch and records the
``chunk_mem_const`` it was given. The real kernel runs in tests/kernels/test_kernels_gpu.py.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from xpukit.planning.training.loss_chunk import LOSS_CHUNK_TOKENS, liger_chunk, liger_chunk_mem_const

GEMMA3_4B = (262208, 2560)  # vocabulary, hidden size
LLAMA31_8B = (128256, 4096)


def test_liger_s_own_chunk_is_its_formula() -> None:
    # next_pow2(ceil(tokens / ceil(vocab / (c * hidden)))), at most the tokens (liger-kernel 0.8.5)
    assert liger_chunk(2048, *GEMMA3_4B, 1) == 32  # ceil(262208 / 2560) = 103; 2048 / 103 -> 20 -> 32
    assert liger_chunk(2048, *LLAMA31_8B, 1) == 64
    assert liger_chunk(2048, 32000, 4096, 1) == 256
    assert liger_chunk(100, *GEMMA3_4B, 1000) == 100  # never more than the tokens


@pytest.mark.parametrize("shape", [GEMMA3_4B, LLAMA31_8B, (151936, 4096), (200064, 3072), (32000, 4096)])
def test_the_mem_const_reaches_the_chunk_and_never_passes_it(shape: tuple[int, int]) -> None:
    for tokens in [*range(1, 300, 7), *range(500, 9000, 37)]:
        c = liger_chunk_mem_const(tokens, *shape)
        got = liger_chunk(tokens, *shape, c)
        own = liger_chunk(tokens, *shape, 1)
        assert got <= max(LOSS_CHUNK_TOKENS, own), (tokens, c, got)
        if own < LOSS_CHUNK_TOKENS:  # the largest c that stays within the chunk
            assert liger_chunk(tokens, *shape, c + 1) > LOSS_CHUNK_TOKENS or got == tokens, (tokens, c)
        else:
            assert c == 1
    assert liger_chunk(2048, *GEMMA3_4B, liger_chunk_mem_const(2048, *GEMMA3_4B)) == 512
    assert liger_chunk(2048, *LLAMA31_8B, liger_chunk_mem_const(2048, *LLAMA31_8B)) == 512


def test_the_liger_loss_is_counted_with_its_chunk() -> None:
    from xpukit.planning.model.shape import ModelShape
    from xpukit.planning.training.activation_memory import activation_bytes

    shape = ModelShape(
        hidden=2560, intermediate=10240, layers=2, heads=8, kv_heads=4, head_dim=256, vocab=262208
    )
    kwargs = dict(compute_bytes=2, lora_r=16, targets=None, dropout=False, mask_bytes=1, checkpointing=False)
    fused = activation_bytes(shape, 2048, fused_loss=True, **kwargs)["loss"]
    assert fused == (2 * 2 + 4) * 2560 * 2048 + 2 * 262208 * LOSS_CHUNK_TOKENS
    small = activation_bytes(shape, 100, fused_loss=True, **kwargs)["loss"]
    assert small == (2 * 2 + 4) * 2560 * 100 + 2 * 262208 * 100  # a call shorter than a chunk


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture
def fake_liger(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """liger_kernel.transformers.functional with a PyTorch stand-in; returns the mem_consts given."""
    calls: list[int] = []

    def liger_fused_linear_cross_entropy(  # liger-kernel 0.8.5's signature
        input: Any,
        weight: Any,
        target: Any,
        bias: Any = None,
        ce_weight: Any = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
        accum_dtype: Any = None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        chunk_mem_const: int = 1,
    ) -> Any:
        calls.append(chunk_mem_const)
        logits = (input @ weight.t()).float()
        return torch.nn.functional.cross_entropy(
            logits, target, ignore_index=ignore_index, reduction=reduction
        )

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy  # type: ignore[attr-defined]
    transformers_pkg = types.ModuleType("liger_kernel.transformers")
    transformers_pkg.functional = functional  # type: ignore[attr-defined]
    root = types.ModuleType("liger_kernel")
    root.transformers = transformers_pkg  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", root)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers_pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    return calls


@pytest.mark.parametrize("items", [None, 11])
def test_the_call_equals_transformers_loss(fake_liger: list[int], items: int | None) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from xpukit.kernels.chunked_ce import liger_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    w = torch.randn(5000, 16, generator=g)
    labels = torch.randint(0, 5000, (3, 7), generator=g)
    labels[0, :3] = -100
    want = ForCausalLMLoss(h @ w.t(), labels, vocab_size=5000, num_items_in_batch=items)
    (want_grad,) = torch.autograd.grad(want * 1.7, h)
    c = liger_chunk_mem_const(21, 5000, 16, 8)
    got = liger_linear_cross_entropy(h, w, labels, chunk_mem_const=c, num_items_in_batch=items)
    (got_grad,) = torch.autograd.grad(got * 1.7, h)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)
    assert fake_liger == [c]
    assert liger_chunk(21, 5000, 16, c) == 8 > liger_chunk(21, 5000, 16, 1)


def test_a_lora_model_trains_the_same(fake_liger: list[int], tiny_model: Path) -> None:
    from xpukit import load_for_xpu
    from xpukit.loading.training.chunked_loss import apply_chunked_loss

    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :4] = -100
    results = []
    for liger in (False, True):
        model = load_for_xpu(
            tiny_model, device="cpu", dtype="float32", seed=0, lora={"gradient_checkpointing": False}
        )
        if liger:
            assert "chunks of up to 8 tokens" in apply_chunked_loss(
                model.get_base_model(), kernel="liger", chunk=8
            )
        model.train()
        out = model(input_ids=ids, labels=labels)
        assert (out.logits is None) == liger
        if liger:  # the chunk asked for, at this call's 32 tokens
            assert fake_liger == [
                liger_chunk_mem_const(32, model.config.vocab_size, model.config.hidden_size, 8)
            ]
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), grads))
    assert len(fake_liger) == 1
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5)


def test_liger_s_kernel_needs_a_chunk(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training.chunked_loss import apply_chunked_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with pytest.raises(ValueError, match="needs a chunk"):
        apply_chunked_loss(model, kernel="liger")
    with pytest.raises(ValueError, match="kernel is one of"):
        apply_chunked_loss(model, kernel="other", chunk=8)


def test_where_xpukit_calls_liger_itself(fake_liger: list[int], tiny_model: Path, monkeypatch: Any) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training import liger

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert liger._own_loss(model, None) == (False, None)
    assert liger._own_loss(model, 512) == (True, None)
    model.config.final_logit_softcapping = 30.0  # liger's own forward applies it; xpukit's wrapper cannot
    own, why = liger._own_loss(model, 512)
    assert not own and "final_logit_softcapping" in str(why)
    model.config.final_logit_softcapping = None
    functional = sys.modules["liger_kernel.transformers.functional"]
    monkeypatch.setattr(functional, "liger_fused_linear_cross_entropy", lambda input, weight, target: None)
    own, why = liger._own_loss(model, 512)
    assert not own and "chunk_mem_const" in str(why)


def test_apply_liger_hands_the_loss_to_xpukit_s_call(
    fake_liger: list[int], tiny_model: Path, monkeypatch: Any
) -> None:
    """With a chunk, liger patches without its fused loss and xpukit wraps the forward instead."""
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training import liger
    from xpukit.machine.profiles import device_profile

    calls: list[dict[str, Any]] = []
    sys.modules["liger_kernel.transformers"]._apply_liger_kernel_to_instance = (  # type: ignore[attr-defined]
        lambda *, model, **kwargs: calls.append(kwargs)
    )
    monkeypatch.setattr(liger, "is_installed", lambda module: True)
    monkeypatch.setattr(liger, "installed_version", lambda package: "0.8.5")
    monkeypatch.setattr(liger, "_supported_model_types", lambda: frozenset({"qwen3"}))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    notes = liger.apply_liger(model, device_profile("h100"), loss_chunk=512)
    assert calls == [{"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": False}]
    assert "chunks of up to 512 tokens" in notes[-1]
    assert getattr(model.forward, "_xpukit_chunked_loss", False)
    calls.clear()  # a model the wrapper cannot take keeps liger's own loss
    capped = AutoModelForCausalLM.from_pretrained(tiny_model)
    capped.config.final_logit_softcapping = 30.0
    notes = liger.apply_liger(capped, device_profile("h100"), loss_chunk=512)
    assert calls == [{"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": True}]
    assert "in its own chunks" in notes[-1] and "final_logit_softcapping" in notes[-1]


def test_a_liger_whose_functional_does_not_import_keeps_its_own_loss(
    fake_liger: list[int], tiny_model: Path, monkeypatch: Any
) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training import liger

    broken = types.ModuleType("liger_kernel.transformers")

    def fail(name: str) -> Any:  # what a broken Triton install does on import
        raise RuntimeError(f"cannot import {name}: Triton failed")

    broken.__getattr__ = fail  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", broken)
    monkeypatch.delitem(sys.modules, "liger_kernel.transformers.functional")
    own, why = liger._own_loss(AutoModelForCausalLM.from_pretrained(tiny_model), 512)
    assert not own and "did not import" in str(why)
