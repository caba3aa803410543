"""The lengths xpukit's decode loop rounds to: the attention window and the prompt's prefill.

docs/decode-internals.md "Attention window" and "Captured prefill". Both are powers of two from a smallest
size, so a call sees a handful of shapes, each captured once as a device graph and replayed after:

* **window**: a decode step attends over the first ``window_length(n)`` slots of the static cache,
  not all ``max_cache_len`` of them (a 32-token prompt + 128 new tokens attends over 256 slots
  instead of 4 096); every slot past the window is empty or in the future, so the result is the same;
* **prompt bucket**: a prompt is left-padded to ``prompt_length(n)`` tokens (padding the attention
  mask hides), so a prefill of any length up to :data:`PREFILL_LARGEST` replays one of a few captures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "PREFILL_LARGEST",
    "PREFILL_SMALLEST",
    "WINDOW_SMALLEST",
    "left_pad",
    "prompt_length",
    "window_length",
    "window_lengths",
]

WINDOW_SMALLEST = 256  # cache slots of the smallest attention window
PREFILL_SMALLEST = 16  # tokens of the shortest prompt bucket
PREFILL_LARGEST = 2048  # longer prompts run their prefill uncaptured (compute-bound there)


def _power_of_two_from(smallest: int, n: int) -> int:
    size = smallest
    while size < n:
        size *= 2
    return size


def window_length(needed: int, cache_len: int, smallest: int = WINDOW_SMALLEST) -> int:
    """Cache slots a step attends over when ``needed`` of them hold tokens (at most the cache)."""
    return min(_power_of_two_from(smallest, needed), cache_len)


def window_lengths(cache_len: int, smallest: int = WINDOW_SMALLEST) -> list[int]:
    """Every window a step of a ``cache_len``-slot cache may attend over, smallest first."""
    sizes = [min(smallest, cache_len)]
    while sizes[-1] < cache_len:
        sizes.append(min(sizes[-1] * 2, cache_len))
    return sizes


def prompt_length(tokens: int, room: int, smallest: int = PREFILL_SMALLEST) -> int | None:
    """The bucket a ``tokens``-long prompt is padded to, or ``None`` (run it as it is): past
    :data:`PREFILL_LARGEST`, or when the padded prompt would not leave ``room`` for it."""
    if tokens > PREFILL_LARGEST:
        return None
    length = _power_of_two_from(smallest, tokens)
    return length if length <= room else None


def left_pad(ids: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` and ``mask`` (b, n) left-padded to (b, ``length``) with tokens the mask hides: copies of
    each row's first token, which the embedding surely has (a configured pad id may not be one)."""
    extra = length - ids.shape[1]
    if extra <= 0:
        return ids, mask
    import torch

    pad = ids[:, :1].expand(ids.shape[0], extra)
    return torch.cat([pad, ids], dim=1), torch.cat([mask.new_zeros(pad.shape), mask], dim=1)
