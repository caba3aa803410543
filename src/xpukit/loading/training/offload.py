"""Activation offloading for ``gradient_checkpointing="offload"``.

See docs/training-plan.md "Offloaded checkpointing".

With non-reentrant gradient checkpointing each decoder layer keeps only its input for backward. The
model's ``forward`` runs inside saved-tensor hooks (:func:`_hooks`) that move every tensor saved
outside the checkpointed regions (those layer inputs, the final norm's, the loss's) of at least
:data:`MIN_BYTES` to host memory during the forward and bring it back when backward needs it. Inside
a checkpointed region torch's own hooks take precedence (the innermost hooks win), so recomputation
is unchanged; the packed tensors keep their host copies, so backward needs no context.

The copies are asynchronous. torch's own ``torch.autograd.graph.save_on_cpu`` copies each tensor
with a blocking ``copy_``, so the host waits for the device at every layer and can no longer queue
work ahead of it; a training step that is bound by the host (a 4-bit LoRA step of 2 048 tokens is,
docs/benchmarks.md) then costs the host's time plus the device's. Here the copy into pinned host
memory is ``non_blocking``, queued on the device's stream behind the kernels that produce the tensor,
and the copy back is queued in front of the kernels that use it, so stream order alone keeps both
correct: the device memory of the original can be reused only by later work on the same stream, and
torch's pinned-memory allocator does not hand out the host buffer again before the copies that use
it have finished. Tensors smaller than :data:`MIN_BYTES` stay on the device (their copies would
cost more than they save).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from xpukit.machine.facts import DeviceFacts

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["MIN_BYTES", "offload_saved_activations"]

MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are

# A saved tensor as the hooks keep it: itself, or (its device, its copy in host memory).
_Packed: TypeAlias = "torch.Tensor | tuple[torch.device, torch.Tensor]"


def _hooks(
    pin: bool,
) -> tuple[Callable[[torch.Tensor], _Packed], Callable[[_Packed], torch.Tensor]]:
    import torch

    def pack(tensor: torch.Tensor) -> _Packed:
        if tensor.device.type == "cpu" or tensor.numel() * tensor.element_size() < MIN_BYTES:
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        return (tensor.device, host)

    def unpack(packed: _Packed) -> torch.Tensor:
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=pin)
        return packed

    return pack, unpack


def offload_saved_activations(model: PreTrainedModel | PeftModel, device: DeviceFacts) -> str:
    """Run ``model.forward`` inside the offloading hooks (pinned, asynchronous on CUDA/XPU); returns
    a note."""
    import torch

    pin = device.backend in ("cuda", "xpu")
    pack, unpack = _hooks(pin)
    forward = model.forward
    if getattr(forward, "_xpukit_offload", False):
        return "saved activations already offloaded to host memory"

    @functools.wraps(forward)
    def offloaded(*args: object, **kwargs: object) -> object:  # the model's output, passed on
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return forward(*args, **kwargs)

    offloaded._xpukit_offload = True  # type: ignore[attr-defined]
    model.forward = offloaded
    return "saved activations offloaded to host memory around the checkpointed layers" + (
        " (pinned, asynchronous copies)" if pin else ""
    )
