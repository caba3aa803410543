"""On CUDA: torch's ``varlen_attn`` computes the packed row's masked attention, and a 4-bit LoRA model
trains through it under the layer graphs as it trains with the mask.

Run with ``pytest -m gpu tests/loading/training/test_varlen_attention_gpu.py`` (needs CUDA from compute
capability 8.0 and torch >= 2.10; the training test also triton and bitsandbytes). In bf16 the two
paths round differently (FlashAttention's kernel against SDPA over a mask), so the tolerances are the
bf16 ones of tests/loading/training/test_layer_graphs_gpu.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.gpu


def _need_varlen() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("varlen_attn needs compute capability 8.0+")
    pytest.importorskip("torch.nn.attention.varlen", reason="varlen_attn needs torch >= 2.10")
    return torch


def _relative(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("window", [None, 48])
def test_varlen_attn_gives_the_reference_output_and_gradients(window: int | None) -> None:
    """GQA 8 query heads over 2, head size 64, examples of 37 to 120 tokens, one of 1, the bucket's
    tail and empty slots: output and the q/k/v gradients against SDPA over the block-diagonal mask."""
    torch = _need_varlen()
    from xpukit.loading.training import varlen_attention as va

    if window is not None and "window_size" not in (va._parameters() or ()):
        pytest.skip("this torch's varlen_attn takes no window (torch 2.10)")
    va.FALLBACKS.clear()
    module = torch.nn.Module()
    module.num_key_value_groups = 4  # read by transformers' SDPA in the reference
    cu = va.boundaries([37, 5, 120, 1, 60, 33]).cuda()  # 256 tokens, 6 examples, 2 empty slots
    gen = torch.Generator(device="cuda").manual_seed(0)

    def inputs() -> list[Any]:
        shapes = [(1, 8, 256, 64), (1, 2, 256, 64), (1, 2, 256, 64)]
        gen.manual_seed(0)
        made = [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in shapes]
        return [t.requires_grad_() for t in made]

    q, k, v = inputs()
    out, _ = va.varlen_attention(
        module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=256, sliding_window=window
    )
    assert not va.FALLBACKS, dict(va.FALLBACKS)  # varlen_attn ran
    grad = torch.randn(out.shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    out.backward(grad)
    rq, rk, rv = inputs()
    want, _ = va.reference_attention(module, rq, rk, rv, cu, window=window)
    want.backward(grad)
    assert tuple(out.shape) == tuple(want.shape) == (1, 256, 8, 64)
    assert _relative(out, want) < 2e-2
    for mine, theirs in ((q, rq), (k, rk), (v, rv)):
        assert _relative(mine.grad, theirs.grad) < 2e-2


def _load(tiny_model: Any, **kwargs: Any) -> Any:
    _need_varlen()
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")
    from xpukit import load_for_xpu

    return load_for_xpu(
        tiny_model,
        device="cuda",
        quantize="4bit",
        seed=0,
        lora={"graphs": True},
        batch_size=3,
        seq_len=200,
        **kwargs,
    )


def _grads(model: Any) -> Any:
    import torch

    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def test_4bit_lora_trains_through_varlen_under_the_graphs_as_with_the_mask(tiny_model: Any) -> None:
    """Padded batches packed into buckets: with varlen attention the layer graphs replay and the losses
    and LoRA gradients are the masked SDPA run's (attn="sdpa" given)."""
    torch = _need_varlen()
    from xpukit.loading.training import varlen_attention as va

    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        lengths = torch.randint(8, 200, (3,), generator=gen).tolist()
        width = max(lengths)
        ids = torch.randint(5, 500, (3, width), generator=gen)
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        batches.append((ids.cuda() * mask.cuda(), mask.cuda()))
    runs = []
    for attn in ("sdpa", None):
        model = _load(tiny_model, **({"attn": attn} if attn else {}))
        want = "mask" if attn else "varlen"
        assert model.xpukit_plan.decision("packed_attention").value == want
        va.FALLBACKS.clear()
        model.train()
        run = []
        for ids, mask in batches:
            labels = ids.masked_fill(mask == 0, -100)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            run.append((float(loss.detach()), _grads(model)))
            model.zero_grad(set_to_none=True)
        runs.append((model, run))
    (_, masked), (varlen, graphed) = runs
    assert varlen.config._attn_implementation == va.NAME
    assert not va.FALLBACKS, dict(va.FALLBACKS)
    assert varlen.xpukit_packing.stats["varlen"] == varlen.xpukit_packing.stats["packed"] == 8
    stats = varlen.xpukit_layer_graphs.stats
    assert stats["graphed"] >= 6 and stats["captures"] >= 2, varlen.xpukit_layer_graphs.eager_reasons
    for (la, ga), (lb, gb) in zip(masked, graphed, strict=True):
        assert abs(la - lb) <= 1e-2 * abs(la)
        assert float((ga - gb).norm() / ga.norm()) < 3e-2
