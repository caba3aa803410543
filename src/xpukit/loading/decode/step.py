"""The prefill and the decode step of xpukit's loop: one token for every row, entirely on the device.

:func:`decode_step` is what :class:`xpukit.loading.decode.loop.DecodeLoop` compiles (and captures as
one device graph on CUDA); :func:`prefill_step` runs the prompt (captured per prompt bucket on CUDA,
uncompiled). Both read and write only fixed buffers, so one call can be one graph replay, and
nothing in them waits for the host. :func:`choose` applies transformers' processors in transformers' order
(minimum-length EOS suppression, temperature, top-k, top-p) and draws on the device
(docs/decode-internals.md "How the loop works").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.loading.decode.attention import WINDOW

if TYPE_CHECKING:
    import torch
    from transformers import StaticCache

    from xpukit.loading.decode.interfaces import DecodeModel

__all__ = ["choose", "decode_step", "first_new_position", "prefill_step", "prompt_positions"]


def prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded prompt (transformers' rule: count the real tokens; 1 on padding)."""
    mask = mask.long()
    positions = mask.cumsum(-1) - 1
    return positions.masked_fill_(mask == 0, 1)


def first_new_position(positions: torch.Tensor) -> torch.Tensor:
    """The position id of the first new token: one past each row's last prompt token."""
    return positions[:, -1:] + 1


def _last_logits(
    model: DecodeModel,
    cache: StaticCache,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    window: torch.Tensor | None,
    keep_one: bool,
) -> torch.Tensor:
    """The model's logits at the last position of ``ids``, the cache updated in place."""
    kwargs: dict[str, object] = {"logits_to_keep": 1} if keep_one else {}
    if window is not None:
        kwargs[WINDOW] = window
    output = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        **kwargs,
    )
    return output.logits[:, -1, :]


def choose(
    logits: torch.Tensor,
    is_eos: torch.Tensor,
    suppress: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None,
    do_sample: bool,
    top_k: int,
) -> torch.Tensor:
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


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row with probability ``probs``: the exponential race (no multinomial, no sync)."""
    import torch

    race = torch.empty_like(probs).exponential_(1).clamp_min_(1e-30)
    return (probs / race).argmax(-1)


def prefill_step(
    model: DecodeModel,
    cache: StaticCache,
    ids: torch.Tensor,
    mask: torch.Tensor,
    window: torch.Tensor | None,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    unfinished: torch.Tensor,
    out: torch.Tensor,
    index: torch.Tensor,
    is_eos: torch.Tensor,
    min_new: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None,
    do_sample: bool,
    top_k: int,
    keep_one: bool,
) -> None:
    """The prompt ``ids`` (b, n) into the cache and the first new token into the loop's buffers;
    ``mask`` is the loop's mask over the whole cache (the prompt's part first)."""
    prompt = prompt_positions(mask[:, : ids.shape[1]])
    logits = _last_logits(model, cache, ids, mask, prompt, window, keep_one)
    first = choose(logits, is_eos, min_new > 0, temperature, top_p, do_sample, top_k)
    unfinished.copy_(~is_eos[first])
    out[:, 0].copy_(first)
    tokens.copy_(first.unsqueeze(1))
    positions.copy_(first_new_position(prompt))
    index.fill_(1)


def decode_step(
    model: DecodeModel,
    cache: StaticCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    window: torch.Tensor | None,
    unfinished: torch.Tensor,
    out: torch.Tensor,
    index: torch.Tensor,
    is_eos: torch.Tensor,
    pad: torch.Tensor,
    min_new: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None,
    do_sample: bool,
    top_k: int,
    keep_one: bool,
) -> None:
    """One token for every row; everything it changes is one of its input buffers. ``window``: a view
    of the mask whose length is the cache slots attention reads, or ``None`` (all of them)."""
    import torch

    logits = _last_logits(model, cache, tokens, mask, positions, window, keep_one)
    chosen = choose(logits, is_eos, index < min_new, temperature, top_p, do_sample, top_k)
    chosen = torch.where(unfinished, chosen, pad)
    unfinished.logical_and_(~is_eos[chosen])
    out.index_copy_(1, index, chosen.unsqueeze(1))
    tokens.copy_(chosen.unsqueeze(1))
    positions.add_(1)
    index.add_(1)
