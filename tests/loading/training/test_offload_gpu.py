"""On CUDA: the offloaded checkpointing moves saved layer inputs to pinned host memory, asynchronously,
and trains exactly as checkpointing on the device does.

Run with ``pytest -m gpu tests/loading/training/test_offload_gpu.py``; every test skips cleanly without a
CUDA device.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.gpu


def _cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch


def test_saved_tensors_wait_pinned_on_the_host() -> None:
    torch = _cuda()
    from xpukit.loading.training import offload

    seen: list[Any] = []
    pack, unpack = offload._hooks(pin=True)

    def spy(tensor: Any) -> Any:
        packed = pack(tensor)
        seen.append(packed)
        return packed

    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)  # 4 MiB: offloaded
    small = torch.randn(16, device="cuda", requires_grad=True)  # stays on the device
    with torch.autograd.graph.saved_tensors_hooks(spy, unpack):
        y = (x * x).sum() + (small * small).sum()
    y.backward()
    moved = [p for p in seen if isinstance(p, tuple)]
    assert moved and all(host.is_pinned() and host.device.type == "cpu" for _, host in moved)
    assert any(isinstance(p, torch.Tensor) and p.device.type == "cuda" for p in seen)
    torch.testing.assert_close(x.grad, 2 * x.detach())
    torch.testing.assert_close(small.grad, 2 * small.detach())


def test_offloaded_checkpointing_trains_as_checkpointing(tiny_model: Any, monkeypatch: Any) -> None:
    torch = _cuda()
    from xpukit import load_for_xpu
    from xpukit.loading.training import offload

    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny model's layer inputs are small
    grads = []
    for gc in (True, "offload"):
        model = load_for_xpu(
            tiny_model,
            device="cuda",
            dtype="float32",
            seed=0,
            lora={"gradient_checkpointing": gc, "liger": False, "fused": False},
        )
        ids = torch.arange(256, device="cuda").reshape(4, 64) % 200
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        notes = [e.actual for e in model.xpukit_plan.events if e.what == "lora"]
        assert any("offloaded to host" in n for n in notes) == (gc == "offload")
        del model
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
