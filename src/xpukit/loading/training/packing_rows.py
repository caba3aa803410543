"""The arithmetic of packed rows (:mod:`.packing`): the lengths a row is padded to, the passes a row
over the token budget is split into, the examples a flattened row holds, and the decoder call's
tensors by name."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch

__all__ = ["example_groups", "example_lengths", "padded_length", "tensor_arg", "token_groups", "tokens_arg"]


def padded_length(
    tokens: int, captured: Iterable[int], bucket: int, *, full: bool = False, seen: int | None = None
) -> int:
    """The length a packed row of ``tokens`` is padded to where the layers run as graphs: the next
    multiple of ``bucket``; when the graphs capture no more shapes (``full``) and that one is not
    among the ``captured`` row lengths, the shortest captured length that holds the row instead, so
    that the step replays rather than running eagerly beside the graphs' memory. With ``seen`` (how
    often this bucket came before), a bucket seen for the first time also takes the shortest captured
    length that holds it: a shape is captured only once it recurs. ``bucket`` 1: not padded."""
    if bucket <= 1:
        return tokens
    target = -(-tokens // bucket) * bucket
    shapes = list(captured)
    if target in shapes or not (full or seen == 0):
        return target
    above = [s for s in shapes if s >= tokens]
    return min(above) if above else target


def example_groups(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """The packed row's examples (``lengths``, in order) gathered into passes of at most ``max_tokens``
    tokens, whole examples each, greedily in order; returns each pass's examples' lengths. One pass
    when the row fits or no budget is set; an example longer than the budget is a pass of its own."""
    if not max_tokens or sum(lengths) <= max_tokens:
        return [list(lengths)]
    groups: list[list[int]] = []
    current: list[int] = []
    for n in lengths:
        if current and sum(current) + n > max_tokens:
            groups.append(current)
            current = []
        current.append(n)
    groups.append(current)
    return groups


def token_groups(lengths: list[int], max_tokens: int | None) -> list[int]:
    """Each pass's tokens of :func:`example_groups`."""
    return [sum(group) for group in example_groups(lengths, max_tokens)]


def tensor_arg(kwargs: Mapping[str, object], name: str) -> torch.Tensor | None:
    """The decoder call's tensor argument ``name`` (``input_ids``, ``attention_mask`` …), or ``None``."""
    return cast("torch.Tensor | None", kwargs.get(name))


def tokens_arg(kwargs: Mapping[str, object]) -> torch.Tensor | None:
    """The call's ``input_ids`` (``[B, L]``), else its ``inputs_embeds`` (``[B, L, H]``), else ``None``."""
    ids = tensor_arg(kwargs, "input_ids")
    return ids if ids is not None else tensor_arg(kwargs, "inputs_embeds")


def example_lengths(positions: torch.Tensor) -> list[int]:
    """The examples' lengths in one flattened row whose ``positions`` restart per example: a new
    example starts wherever a position is not the one before plus 1 (transformers' rule,
    ``find_packed_sequence_indices``). Read on the host."""
    import torch

    flat = positions.reshape(-1).to("cpu")
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    index = [*starts.nonzero().squeeze(1).tolist(), int(flat.numel())]
    return [b - a for a, b in itertools.pairwise(index)]
