"""How many tokens a chunk of liger-kernel's fused linear cross-entropy holds (pure).

liger-kernel computes ``lm_head`` and the loss chunk by chunk of tokens, and each chunk's two
products (its logits, and the hidden states' gradient) read the whole ``lm_head`` weight. It sizes
the chunk so that its logits are about ``chunk_mem_const`` times the hidden states:
``min(next_pow2(ceil(tokens / ceil(vocab / (c · hidden)))), tokens)`` (liger-kernel 0.8.5,
``ops/fused_linear_cross_entropy.py``), and its model forwards leave ``c = 1``. With a large
vocabulary that makes chunks of 32 tokens (Gemma-3-4B at 2 048 tokens: 64 chunks, 172 GB of head
reads a step, 41 ms of a 134 ms step on an H200). xpukit asks for chunks of :data:`LOSS_CHUNK_TOKENS`
instead, by passing the ``c`` that gives them for each call's token count
(docs/training-plan.md "liger's loss chunk").
"""

from __future__ import annotations

__all__ = ["LOSS_CHUNK_TOKENS", "liger_chunk", "liger_chunk_mem_const"]

# Tokens per chunk: each of a chunk's products then does 512 flops per byte of lm_head it reads (2
# flops per token and bf16 weight of 2 bytes), above the ~206 of an H200 (989 dense bf16 TFLOP/s
# over 4.8 TB/s), so the re-reads of the head no longer bound the loss (docs/training-plan.md "liger's
# loss chunk").
LOSS_CHUNK_TOKENS = 512

# liger checks chunk_mem_const is a positive int; past vocab / hidden every call is one chunk.
_C_MAX = 1 << 20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def liger_chunk(tokens: int, vocab: int, hidden: int, mem_const: int) -> int:
    """liger-kernel's chunk of tokens for ``tokens`` × ``hidden`` inputs and a ``vocab``-word head."""
    factor = _cdiv(vocab, mem_const * hidden)
    return min(_next_pow2(_cdiv(tokens, factor)), tokens)


def liger_chunk_mem_const(tokens: int, vocab: int, hidden: int, chunk: int = LOSS_CHUNK_TOKENS) -> int:
    """The largest ``chunk_mem_const`` whose chunk holds at most ``max(chunk, liger's own)`` tokens.

    1 (liger's default) when its own chunk is already that large or larger; otherwise the chunk
    grows toward ``chunk``, never past it (the power of two liger rounds up to is checked).
    """
    if tokens <= 0 or liger_chunk(tokens, vocab, hidden, 1) >= chunk:
        return 1
    low, high = 1, max(1, min(_C_MAX, _cdiv(vocab, hidden)))  # at ``high`` one chunk covers all
    while low < high:  # the chunk grows with c: the largest c whose chunk is <= chunk
        mid = (low + high + 1) // 2
        if liger_chunk(tokens, vocab, hidden, mid) <= chunk:
            low = mid
        else:
            high = mid - 1
    return low
