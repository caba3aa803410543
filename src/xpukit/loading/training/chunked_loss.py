"""Give a causal LM xpukit's chunked linear cross-entropy (:mod:`xpukit.kernels.chunked_ce`).

The model instance's ``forward`` is wrapped: a call with ``labels`` (and grad enabled) runs the
model's own forward with ``lm_head`` replaced by an identity for the call, so the "logits" that come
back are the final hidden states, and the loss is computed from them and ``lm_head``'s weight chunk
by chunk; the output's ``logits`` are ``None`` then, as with liger-kernel's fused loss. Every other
call (no labels, inference, a trainable ``lm_head``) runs the model unchanged. Models that change the
logits after ``lm_head`` (soft-capping, a logit scale) or whose head is not one ``nn.Linear`` keep
the plain loss: :func:`chunked_loss_problem` says why (docs/training-plan.md "Chunked cross-entropy").

``kernel="liger"`` computes the same loss with liger-kernel's fused kernel in chunks of the caller's
size (xpukit sets liger's ``chunk_mem_const`` per call; docs/training-plan.md "liger's loss chunk").
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.utils import ModelOutput

__all__ = ["KERNELS", "apply_chunked_loss", "chunked_loss_problem"]

# Config fields that transform the logits after lm_head (Gemma 2/3, Cohere, Granite, …).
_LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

# Which loss kernel computes the chunks: xpukit's PyTorch one, or liger-kernel's Triton one.
KERNELS = ("xpukit", "liger")


def chunked_loss_problem(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot take the chunked loss, or ``None`` when it can."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or type(head) is not torch.nn.Linear or head.bias is not None:
        return f"lm_head is {type(head).__name__}, not one nn.Linear without bias"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for field in _LOGIT_FIELDS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0):
            return f"config.{field}={value!r} changes the logits after lm_head"
    if not any(name == "lm_head" for name, _ in model.named_children()):
        return "the head is not the model's lm_head attribute"
    return None


def apply_chunked_loss(model: PreTrainedModel, *, kernel: str = "xpukit", chunk: int | None = None) -> str:
    """Wrap ``model.forward`` (a transformers causal LM) with the chunked loss; returns a note.

    Args:
        model: the causal LM (not its peft wrapper).
        kernel: one of :data:`KERNELS`.
        chunk: tokens per chunk (``None``: xpukit's memory-sized chunk,
            :func:`xpukit.planning.training.activation_memory.chunk_tokens`; liger's kernel needs one).

    Raises:
        ValueError: :func:`chunked_loss_problem` found a reason (the caller records it).
    """
    import torch

    from xpukit.kernels.chunked_ce import chunked_linear_cross_entropy, liger_linear_cross_entropy
    from xpukit.planning.training.activation_memory import chunk_tokens
    from xpukit.planning.training.loss_chunk import liger_chunk_mem_const

    if kernel not in KERNELS or (kernel == "liger" and not chunk):
        raise ValueError(
            f"kernel={kernel!r}, chunk={chunk!r}: kernel is one of {KERNELS}; liger's needs a chunk"
        )
    problem = chunked_loss_problem(model)
    if problem is not None:
        raise ValueError(problem)
    forward = model.forward
    if getattr(forward, "_xpukit_chunked_loss", False):
        return "chunked cross-entropy already applied"
    head = model.lm_head
    vocab = int(head.weight.shape[0])
    size = chunk or chunk_tokens(vocab)

    def loss_of(hidden: torch.Tensor, labels: torch.Tensor, items: torch.Tensor | int | None) -> torch.Tensor:
        if kernel == "liger":
            c = liger_chunk_mem_const(hidden.numel() // hidden.shape[-1], vocab, hidden.shape[-1], size)
            return liger_linear_cross_entropy(
                hidden, head.weight, labels, chunk_mem_const=c, num_items_in_batch=items
            )
        return chunked_linear_cross_entropy(hidden, head.weight, labels, chunk=size, num_items_in_batch=items)

    @functools.wraps(forward)
    def chunked(*args: object, **kwargs: object) -> ModelOutput:
        labels = kwargs.get("labels")
        if labels is None or not torch.is_grad_enabled() or head.weight.requires_grad:
            return forward(*args, **kwargs)
        kwargs["labels"] = None
        items = kwargs.pop("num_items_in_batch", None)
        model.lm_head = torch.nn.Identity()
        try:
            out = forward(*args, **kwargs)
        finally:
            model.lm_head = head
        rest = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        return type(out)(loss=loss_of(out.logits, labels, items), logits=None, **rest)

    chunked._xpukit_chunked_loss = True  # type: ignore[attr-defined]
    model.forward = chunked
    if kernel == "liger":
        return (
            f"liger-kernel's fused linear cross-entropy in chunks of up to {size} tokens over the "
            f"{vocab}-word vocabulary (its chunk_mem_const set per call; its default chunk re-reads "
            "lm_head once per few dozen tokens)"
        )
    return (
        f"chunked cross-entropy: lm_head + loss in chunks of {size} tokens over the "
        f"{vocab}-word vocabulary (the logits are never materialised whole)"
    )
