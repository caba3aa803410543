"""Give a causal LM xpukit's chunked linear cross-entropy (:mod:`xpukit.kernels.chunked_ce`).

The model instance's ``forward`` is wrapped: a call with ``labels`` (and grad enabled) runs the
model's own forward with ``lm_head`` replaced by an identity for the call, so the "logits" that come
back are the final hidden states, and the loss is computed from them and ``lm_head``'s weight chunk
by chunk; the output's ``logits`` are ``None`` then, as with liger-kernel's fused loss. Every other
call (no labels, inference, a trainable ``lm_head``) runs the model unchanged. Models that change the
logits after ``lm_head`` (soft-capping, a logit scale) or whose head is not one ``nn.Linear`` keep
the plain loss: :func:`chunked_loss_problem` says why (docs/training.md "Chunked cross-entropy").
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["apply_chunked_loss", "chunked_loss_problem"]

# Config fields that transform the logits after lm_head (Gemma 2/3, Cohere, Granite, …).
_LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def chunked_loss_problem(model: Any) -> str | None:
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


def apply_chunked_loss(model: Any) -> str:
    """Wrap ``model.forward`` (a transformers causal LM) with the chunked loss; returns a note.

    Raises:
        ValueError: :func:`chunked_loss_problem` found a reason (the caller records it).
    """
    import torch

    from xpukit.kernels.chunked_ce import chunked_linear_cross_entropy
    from xpukit.planning.training.activation_memory import chunk_tokens

    problem = chunked_loss_problem(model)
    if problem is not None:
        raise ValueError(problem)
    forward = model.forward
    if getattr(forward, "_xpukit_chunked_loss", False):
        return "chunked cross-entropy already applied"
    head = model.lm_head
    vocab = int(head.weight.shape[0])

    @functools.wraps(forward)
    def chunked(*args: Any, **kwargs: Any) -> Any:
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
        loss = chunked_linear_cross_entropy(
            out.logits, head.weight, labels, chunk=chunk_tokens(vocab), num_items_in_batch=items
        )
        rest = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        return type(out)(loss=loss, logits=None, **rest)

    chunked._xpukit_chunked_loss = True  # type: ignore[attr-defined]
    model.forward = chunked
    return (
        f"chunked cross-entropy: lm_head + loss in chunks of {chunk_tokens(vocab)} tokens over the "
        f"{vocab}-word vocabulary (the logits are never materialised whole)"
    )
