"""xpukit's chunked linear cross-entropy against transformers' loss: values and gradients (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _case(batch: int = 3, seq: int = 7, hidden: int = 16, vocab: int = 50) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(batch, seq, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :3] = -100  # a prompt that is not counted
    return h, w, labels


def _reference(h: Any, w: Any, labels: Any, **kwargs: Any) -> Any:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(h @ w.t(), labels, vocab_size=w.shape[0], **kwargs)


@pytest.mark.parametrize("chunk", [1, 4, 5, 100])
@pytest.mark.parametrize("items", [None, 11])
def test_loss_and_gradient_equal_transformers(chunk: int, items: int | None) -> None:
    from xpukit.kernels.chunked_ce import chunked_linear_cross_entropy

    h, w, labels = _case()
    want = _reference(h, w, labels, num_items_in_batch=items)
    (want_grad,) = torch.autograd.grad(want * 1.7, h)
    got = chunked_linear_cross_entropy(h, w, labels, chunk=chunk, num_items_in_batch=items)
    (got_grad,) = torch.autograd.grad(got * 1.7, h)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)


def test_a_trainable_head_is_refused() -> None:
    from xpukit.kernels.chunked_ce import chunked_linear_cross_entropy

    h, w, labels = _case()
    with pytest.raises(ValueError, match="frozen"):
        chunked_linear_cross_entropy(h, w.requires_grad_(), labels, chunk=4)


def test_chunks_hold_the_configured_bytes() -> None:
    from xpukit.planning.training.activation_memory import CHUNK_BYTES, chunk_tokens

    assert chunk_tokens(151936) == CHUNK_BYTES // (4 * 151936) == 441
    assert chunk_tokens(10**12) == 1


def test_a_lora_model_trains_the_same(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from xpukit import load_for_xpu
    from xpukit.loading.training.chunked_loss import apply_chunked_loss
    from xpukit.planning.training import activation_memory

    monkeypatch.setattr(activation_memory, "CHUNK_BYTES", 4 * 1024 * 5)  # 5 tokens a chunk: several chunks
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :4] = -100
    results = []
    for chunked in (False, True):
        model = load_for_xpu(
            tiny_model, device="cpu", dtype="float32", seed=0, lora={"gradient_checkpointing": False}
        )
        base = model.get_base_model()
        if chunked:
            note = apply_chunked_loss(base)
            assert "chunks of 5 tokens" in note
        model.train()
        out = model(input_ids=ids, labels=labels)
        assert (out.logits is None) == chunked
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), grads))
        with torch.no_grad():  # inference keeps its logits
            assert model(input_ids=ids).logits.shape == (2, 16, model.config.vocab_size)
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5)


def test_models_that_change_their_logits_are_refused(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training.chunked_loss import apply_chunked_loss, chunked_loss_problem

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert chunked_loss_problem(model) is None
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in str(chunked_loss_problem(model))
    with pytest.raises(ValueError, match="softcapping"):
        apply_chunked_loss(model)
