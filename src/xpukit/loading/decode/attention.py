"""Grouped decode attention: a decode step's attention without the ``repeat_kv`` copy of the cache.

transformers' SDPA attention on CUDA expands the key/value heads to the query heads (``repeat_kv``)
whenever there is an attention mask, because torch's masked SDPA kernels did not take grouped heads
(``enable_gqa``) on CUDA (``transformers.integrations.sdpa_attention.use_gqa_in_sdpa``). A static
cache always has a mask (it hides the cache's empty tail), so every decode step of a grouped-query
model copies the whole cache of every layer: Qwen3-8B (32 query heads, 8 key/value heads) at a
cache of 4 096 tokens writes and reads again 2.4 GB per token at batch 1, 8 × that at batch 8.

When a step has one query token, the query heads that share a key/value head have the same mask, so
they can be laid out as that head's ``groups`` rows: ``(b, kv_heads, groups, d)`` against
``(b, kv_heads, L, d)``, the mask ``(b, 1, 1, L)`` broadcast over them. The attention is then two
batched matrix products and a softmax: ``q @ kᵀ`` (bf16 in, fp32 accumulation), scaled and masked
in fp32, softmax in fp32, cast back, ``@ v``: the numerics of transformers' eager attention. Not one
fused SDPA call over the grouped rows: measured on an H200 (docs/decode.md "Grouped decode
attention"), cuDNN's SDPA kernel gives each (batch, head) one thread block that walks all 4 096 keys,
so 8 heads at batch 1 took 3.0 ms a token against 1.7 ms for transformers' copy + SDPA, while the
products spread the keys over the whole device.

xpukit's loop also passes the step's attention window (:data:`WINDOW`, a tensor whose last dimension
is the window's length; docs/decode-internals.md "Attention window"): the keys, values and mask are cut to
that many cache slots first, whichever path then runs, so a short call does not attend over the
whole static cache.

Every other call (prefill, training, one key/value head per query head, dropout, soft-capping,
attention weights asked for) goes to transformers' own ``sdpa_attention_forward`` unchanged.
The function is registered under :data:`NAME` in transformers' attention and mask interfaces (the
mask is SDPA's), and :func:`use_grouped_decode_attention` sets it on one model's config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch

    from xpukit.loading.decode.interfaces import DecodeModel

__all__ = ["NAME", "WINDOW", "grouped_decode_sdpa", "use_grouped_decode_attention"]

NAME = "xpukit_grouped_sdpa"
# The keyword xpukit's loop passes through the model's forward (transformers hands it on to the
# attention function): a view of the loop's mask, ``(batch, window)``; only its length is read.
WINDOW = "xpukit_window"


def grouped_decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; one query token of a grouped model is grouped."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = cast("torch.Tensor | None", kwargs.pop(WINDOW, None))  # the loop's (step.py)
    if window is not None:  # the cache past the window is empty (or the future): not read at all
        length = window.shape[-1]
        key, value = key[:, :, :length], value[:, :, :length]
        if attention_mask is not None:
            attention_mask = attention_mask[..., :length]
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    batch, heads, q_len, dim = query.shape
    special = dropout or kwargs.get("softcap") is not None or kwargs.get("output_attentions")
    if q_len != 1 or groups == 1 or special or kwargs.get("cache") is not None:
        result: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
        return result
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, groups, dim)  # head h = kv head h // groups (repeat_kv)
    scale = scaling if scaling is not None else dim**-0.5
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale  # (b, kv_heads, groups, L)
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]  # (b, 1, 1, L): the same for every head and query
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(-1).to(value.dtype)
    out = torch.matmul(probs, value)  # (b, kv_heads, groups, d)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :data:`NAME` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, grouped_decode_sdpa)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_grouped_decode_attention(model: DecodeModel) -> str | None:
    """Set :data:`NAME` as ``model``'s attention when it runs transformers' SDPA; returns a note, or
    ``None`` when the model keeps its attention (another implementation, or no grouped heads)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(config, "_attn_implementation", None) != "sdpa" or not heads or heads == kv_heads:
        return None
    register()
    config._attn_implementation = NAME
    if text is not config:
        text._attn_implementation = NAME
    return (
        f"decode attention: {heads} query heads over {kv_heads} key/value heads in one SDPA call per "
        "decode step (no repeat_kv copy of the cache); everything else runs transformers' SDPA"
    )
