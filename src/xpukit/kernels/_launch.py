"""Where a Triton kernel launches: on the current device of its backend, so the tensors' device is
made current for the launch (xpukit's Triton kernels: nf4 dequantisation, weight-only products)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["on_device"]


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """A context that makes ``device`` current for its backend (CUDA, XPU), or does nothing
    (the CPU under Triton's interpreter, an index-less device)."""
    import torch

    module = getattr(torch, device.type, None)
    if device.index is not None and module is not None and hasattr(module, "device"):
        made_current: contextlib.AbstractContextManager[object] = module.device(device)
        return made_current
    return contextlib.nullcontext()
