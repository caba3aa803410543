"""The frozen input embedding in host memory while the adapters train (docs/training-plan.md "The input
embedding in host memory"; the plan decides it: ``planning/training/host_embedding.py``).

:func:`install_host_embedding` moves the table of the model's input embedding to host memory and
wraps the module's ``forward`` on the instance: the token ids go to the host, the rows are gathered
there by the module's own forward (so a scaled embedding, as Gemma's, scales as before), and the
result is copied to the device the model runs on. Nothing else changes:

* the parameter keeps its name, dtype and ``requires_grad=False``, so ``state_dict`` and saving see
  the same tensors; the module moves to the end of its parent's children, so ``model.device`` (the
  first parameter's device) still names the GPU;
* a later ``model.to(...)`` or ``.cuda()`` (``Trainer`` places a model that is not quantized) leaves
  the table where it is: only the module's own ``_apply`` is turned into a no-op for moves;
* hooks on the module (``enable_input_require_grads``) see the output on the device, as before.

The table's device memory must go back to the driver, not stay cached beside the graphs' pool, which
cannot use it: transformers reserves one block for all the weights before reading them
(``caching_allocator_warmup``), and a table freed from the middle of that block stays reserved (H200,
8 GB budget: 8.57 GB reserved with the table moved, against 8.69 GB with it on the device). So the
load that moves it reads the weights without that warm-up (:func:`weights_apart`), each tensor in its
own allocation, and the move hands the table's bytes back (``empty_cache``); the note says how much
of the device's reserve that released.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["install_host_embedding", "weights_apart"]


@contextlib.contextmanager
def weights_apart(wanted: bool) -> Iterator[None]:
    """With ``wanted``, ``from_pretrained`` inside skips transformers' allocator warm-up (one block
    reserved for every weight), so the input embedding gets an allocation of its own that goes back
    to the driver when it moves to host memory. A transformers without the warm-up: nothing to do."""
    if not wanted:
        yield
        return
    from transformers import modeling_utils

    warmup = getattr(modeling_utils, "caching_allocator_warmup", None)
    if warmup is None:
        yield
        return
    modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling_utils.caching_allocator_warmup = warmup


def install_host_embedding(model: PreTrainedModel | PeftModel) -> str:
    """Move the frozen, untied input embedding of ``model`` (a PeftModel or a transformers model) to
    host memory, gathering there and copying each call's rows to the model's device; returns a note,
    which says why where it stays (tied to the head, trained, already on the host)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = base.get_input_embeddings()
    weight = getattr(embed, "weight", None)
    if weight is None:
        return "input embedding: stays on the device (no weight to move)"
    if weight.requires_grad:
        return "input embedding: stays on the device (it is trained)"
    head = base.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    if head_weight is not None and head_weight.data_ptr() == weight.data_ptr():
        return "input embedding: stays on the device (tied to the output head, which reads all of it)"
    device = weight.device
    if device.type == "cpu":
        return "input embedding: already in host memory"
    size = weight.numel() * weight.element_size()
    for tensor in (*embed.parameters(recurse=False), *embed.buffers(recurse=False)):
        tensor.data = tensor.data.to("cpu")
    _wrap(embed, device)
    _move_last(base, embed)
    accelerator = getattr(torch, device.type)
    reserved = accelerator.memory_reserved(device)
    accelerator.empty_cache()  # the device copy's blocks back to the driver, out of the reserve
    released = reserved - accelerator.memory_reserved(device)
    return (
        f"input embedding in host memory ({size / 2**30:.2f} GiB; {released / 2**30:.2f} GiB of "
        f"{device}'s reserve released): each call gathers its tokens' rows on the host and copies them "
        "to the device"
    )


def _wrap(embed: torch.nn.Module, device: torch.device) -> None:
    """``embed`` gathers on the host (its own forward over the ids there) and returns its rows on the
    ids' device (``device`` for ids on the host); moves of the model leave it where it is."""
    own_forward = embed.forward

    def forward(
        self: torch.nn.Module, input_ids: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        out = own_forward(input_ids.to("cpu"), *args, **kwargs)
        return out.to(input_ids.device if input_ids.device.type != "cpu" else device)

    def keep_on_host(
        self: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> torch.nn.Module:
        return self  # .to()/.cuda() of the model leave the table in host memory

    embed.forward = types.MethodType(forward, embed)
    embed._apply = types.MethodType(keep_on_host, embed)


def _move_last(root: torch.nn.Module, module: torch.nn.Module) -> None:
    """Re-register ``module`` last among its parent's children, so that the first parameter of the
    model (what ``model.device`` reads) is one on the device."""
    for parent in root.modules():
        for name, child in list(parent._modules.items()):
            if child is module:
                del parent._modules[name]
                parent._modules[name] = child
                return
