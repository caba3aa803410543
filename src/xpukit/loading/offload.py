"""Activation offloading for ``gradient_checkpointing="offload"`` (docs/training.md "Training plan by fit").

With non-reentrant gradient checkpointing each decoder layer keeps only its input for backward;
``torch.autograd.graph.save_on_cpu`` moves the tensors saved outside the checkpointed regions — those
layer inputs, the final norm's and the loss's — to host memory during the forward and brings each
back when backward needs it. Inside a checkpointed region torch's own saved-tensor hooks take
precedence (the innermost hooks win), so recomputation is unchanged. transformers 5.22 has no
offloading switch of its own, so the model's ``forward`` runs inside the context; the packed tensors
keep their host copies, so backward needs no context.
"""

from __future__ import annotations

import functools
from typing import Any

from xpukit.machine.facts import DeviceFacts

__all__ = ["offload_saved_activations"]


def offload_saved_activations(model: Any, device: DeviceFacts) -> str:
    """Run ``model.forward`` inside ``save_on_cpu`` (pinned host memory on CUDA/XPU); returns a note."""
    import torch

    pin = device.backend in ("cuda", "xpu")
    forward = model.forward
    if getattr(forward, "_xpukit_offload", False):
        return "saved activations already offloaded to host memory"

    @functools.wraps(forward)
    def offloaded(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return forward(*args, **kwargs)

    offloaded._xpukit_offload = True  # type: ignore[attr-defined]
    model.forward = offloaded
    return (
        "saved activations offloaded to host memory (torch.autograd.graph.save_on_cpu"
        + (", pinned" if pin else "")
        + ") around the checkpointed layers"
    )
