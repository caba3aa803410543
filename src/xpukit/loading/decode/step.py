"""The decode step of xpukit's loop: one token for every row, entirely on the device.

:func:`decode_step` is what :class:`xpukit.loading.decode.loop.DecodeLoop` compiles (CUDA graphs on
CUDA): it reads and writes only fixed buffers, so one call is one graph replay, and nothing in it
waits for the host. :func:`choose` applies transformers' processors in transformers' order
(minimum-length EOS suppression, temperature, top-k, top-p) and draws on the device
(docs/decode.md "How the loop works").
"""

from __future__ import annotations

from typing import Any

__all__ = ["choose", "decode_step"]


def choose(
    logits: Any, is_eos: Any, suppress: Any, temperature: Any, top_p: Any, do_sample: bool, top_k: int
) -> Any:
    """The next token of each row, on the device (transformers' processors, in their order)."""
    import torch

    scores = logits.float().masked_fill(is_eos & suppress, float("-inf"))
    if not do_sample:
        return scores.argmax(-1)
    scores = scores / temperature
    if top_k:
        # Everything outside the top k is -inf for top-p and the draw: work on the k values only
        # (already sorted), then map back to token ids. Ties at the k-th value keep exactly k.
        values, ids = torch.topk(scores, min(top_k, scores.shape[-1]))
        if top_p is not None:
            probs = values.softmax(-1)
            # transformers removes a token when the ascending cumulative probability up to it is
            # <= 1 - top_p, i.e. when the probability of the more likely tokens is >= top_p.
            values = values.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
        return ids.gather(-1, _draw(values.softmax(-1)).unsqueeze(-1)).squeeze(-1)
    if top_p is not None:
        ordered, order = torch.sort(scores, descending=False)
        remove = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return _draw(scores.softmax(-1))


def _draw(probs: Any) -> Any:
    """One index per row with probability ``probs``: the exponential race (no multinomial, no sync)."""
    import torch

    race = torch.empty_like(probs).exponential_(1).clamp_min_(1e-30)
    return (probs / race).argmax(-1)


def decode_step(
    model: Any,
    cache: Any,
    tokens: Any,
    positions: Any,
    mask: Any,
    unfinished: Any,
    out: Any,
    index: Any,
    is_eos: Any,
    pad: Any,
    min_new: Any,
    temperature: Any,
    top_p: Any,
    do_sample: bool,
    top_k: int,
    keep_one: bool,
) -> None:
    """One token for every row; everything it changes is one of its input buffers."""
    import torch

    kwargs = {"logits_to_keep": 1} if keep_one else {}
    logits = model(
        input_ids=tokens,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        **kwargs,
    ).logits[:, -1, :]
    chosen = choose(logits, is_eos, index < min_new, temperature, top_p, do_sample, top_k)
    chosen = torch.where(unfinished, chosen, pad)
    unfinished.logical_and_(~is_eos[chosen])
    out.index_copy_(1, index, chosen.unsqueeze(1))
    tokens.copy_(chosen.unsqueeze(1))
    positions.add_(1)
    index.add_(1)
