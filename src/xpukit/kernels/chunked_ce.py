"""``lm_head`` + cross-entropy in chunks of tokens: the ``[tokens, vocab]`` logits never exist whole.

A causal LM's loss over a large vocabulary is the biggest single activation of a LoRA step: for
Qwen3 (151 936 words) and 2 048 tokens the logits are 0.62 GB in bf16, 1.24 GB upcast to fp32 for
the loss, and as much again for their gradient. liger-kernel's fused linear cross-entropy avoids
them with Triton kernels; this is the same idea in plain PyTorch, so it runs on every device (the
CPU and MPS included, and XPU without Triton): the forward computes, chunk by chunk of tokens, the
logits of the chunk, its loss and already the gradient with respect to the chunk's hidden states
(``(softmax − one_hot) @ W``), and keeps only that gradient (tokens × hidden) for backward. Peak
extra memory is one chunk's logits plus the hidden-state gradient; the caller sizes the chunk
(:func:`xpukit.planning.training.activation_memory.chunk_tokens`).

The loss is transformers' ``ForCausalLMLoss``: labels shifted left by one, ``ignore_index`` -100,
fp32 log-softmax, the sum divided by ``num_items_in_batch`` when given (gradient accumulation, as
``Trainer`` passes it) else by the number of counted tokens (docs/training-plan.md "Chunked cross-entropy").
The ``lm_head`` weight must be frozen (LoRA training); a trainable head keeps the plain loss.

:func:`liger_linear_cross_entropy` is the same loss through liger-kernel's Triton kernel (extra
``liger``), with the ``chunk_mem_const`` the caller sets (liger's default makes small chunks,
each re-reading the head; docs/training-plan.md "liger's loss chunk").
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE_INDEX", "chunked_linear_cross_entropy", "liger_linear_cross_entropy"]

IGNORE_INDEX = -100


class _Ctx(Protocol):
    """What the function keeps on autograd's context between forward and backward."""

    saved_tensors: tuple[torch.Tensor, ...]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...


@functools.cache
def _function() -> type[torch.autograd.Function]:
    """Define the autograd function (needs torch; built once, as ``lora_ops._functions``)."""
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):  # type: ignore[misc]
        @staticmethod
        def forward(
            ctx: _Ctx,
            hidden: torch.Tensor,
            weight: torch.Tensor,
            labels: torch.Tensor,
            denominator: torch.Tensor,
            chunk: int,
        ) -> torch.Tensor:
            grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start : start + chunk]
                y = labels[start : start + chunk]
                counted = y != IGNORE_INDEX
                target = y.clamp_min(0).unsqueeze(1)
                logits = (h @ weight.t()).float()
                lse = logits.logsumexp(-1, keepdim=True)
                total += ((lse - logits.gather(1, target)).squeeze(1) * counted).sum()
                if grad_hidden is not None:
                    probs = logits.sub_(lse).exp_()  # softmax, in the logits' memory
                    probs.scatter_add_(1, target, torch.full_like(target, -1, dtype=probs.dtype))
                    probs.mul_(counted.unsqueeze(1))
                    grad_hidden[start : start + chunk] = probs.to(hidden.dtype) @ weight
            ctx.save_for_backward(grad_hidden, denominator)
            return total / denominator

        @staticmethod
        def backward(ctx: _Ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            grad_hidden, denominator = ctx.saved_tensors
            scale = (grad_loss / denominator).to(grad_hidden.dtype)
            return grad_hidden * scale, None, None, None, None

    return ChunkedLinearCrossEntropy


def _flat(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states as ``(tokens, hidden)`` in the compute dtype, the weight in it, and the labels
    shifted left by one and flattened (transformers' ``ForCausalLMLoss``)."""
    import torch

    if weight.requires_grad:
        raise ValueError("the chunked linear cross-entropy needs a frozen lm_head weight")
    dtype = weight.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat_labels = shifted.reshape(-1).to(hidden.device)
    return hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype), flat_labels


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk: int,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """transformers' causal-LM loss of ``hidden @ weight.T`` against ``labels``, chunk by chunk.

    Args:
        hidden: the final hidden states, ``(batch, seq, hidden)``.
        weight: the frozen ``lm_head`` weight, ``(vocab, hidden)``.
        labels: ``(batch, seq)`` token ids, -100 where not counted; shifted here as transformers does.
        chunk: tokens per chunk.
        num_items_in_batch: the denominator when given (``Trainer`` under gradient accumulation).
    """
    import torch

    flat, weight, flat_labels = _flat(hidden, weight, labels)
    if num_items_in_batch is None:
        denominator = (flat_labels != IGNORE_INDEX).sum().clamp_min(1).float()
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    with torch.autocast(hidden.device.type, enabled=False):
        return _function().apply(flat, weight, flat_labels, denominator, max(1, int(chunk)))


def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_mem_const: int,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """The same loss through liger-kernel's fused linear cross-entropy with its ``chunk_mem_const``
    (the caller's, for this call's token count: liger's chunk grows with it). The sum is divided by
    ``num_items_in_batch`` when given, as liger's model forwards do."""
    import torch
    from liger_kernel.transformers import functional

    flat, weight, flat_labels = _flat(hidden, weight, labels)
    summed = num_items_in_batch is not None
    with torch.autocast(hidden.device.type, enabled=False):
        loss = functional.liger_fused_linear_cross_entropy(
            flat,
            weight,
            flat_labels,
            ignore_index=IGNORE_INDEX,
            reduction="sum" if summed else "mean",
            chunk_mem_const=chunk_mem_const,
        )
    return loss / num_items_in_batch if summed else loss
