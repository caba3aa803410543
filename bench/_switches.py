"""Measurement switches of the training benches: each replaces one piece of the stack in this
process (the bench loads one model a process), to measure what that piece costs or saves."""

from __future__ import annotations

from typing import Any

from _shapes import SHAPES


def liger_chunks(chunk_mem_const: int) -> None:
    """liger-kernel's fused linear cross-entropy with a larger logits chunk, in this process.

    liger sizes its chunk of tokens so that the chunk's logits (chunk × vocab) are about ``c`` × the
    hidden states (tokens × hidden): ``next_pow2(tokens / ceil(vocab / (c · hidden)))``. With c = 1
    and a large vocabulary the chunk is small (Gemma-3-4B at 2 048 tokens: 32 tokens, 64 chunks),
    and each chunk's two products read the whole ``lm_head`` weight (docs/benchmarks.md "Other
    families"). xpukit now passes its own per call (docs/training-plan.md "liger's loss chunk"); this
    fixed value replaces it, to try other chunk sizes."""
    import functools

    from liger_kernel.transformers import functional

    original = functional.liger_fused_linear_cross_entropy

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "chunk_mem_const": chunk_mem_const})

    functional.liger_fused_linear_cross_entropy = wrapped


def liger_rope(shape: str) -> str:
    """liger-kernel's RoPE kernel in place of transformers' ``apply_rotary_pos_emb`` of the shape's
    modeling module, for this process (the bench loads one model a process). transformers' RoPE is
    a handful of elementwise kernels each way (``rotate_half``'s slice, neg and cat, two products and
    a sum), part of the elementwise time that separates xpukit's device time from unsloth's
    (docs/benchmarks.md "Other families"). liger's kernel infers a partial rotary width (Phi-3) from
    ``cos``."""
    import importlib

    import transformers
    from liger_kernel.transformers import liger_rotary_pos_emb

    config_class = getattr(transformers, SHAPES[shape][0])
    module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    module.apply_rotary_pos_emb = liger_rotary_pos_emb  # type: ignore[attr-defined]
    return f"(bench) liger-kernel's RoPE as {module.__name__}.apply_rotary_pos_emb in this process"


def chunked_loss_instead(model: Any, tokens: int) -> str:
    """xpukit's chunked cross-entropy at ``tokens`` a chunk in place of the plan's loss (a bench
    switch: liger's fused loss is an instance ``forward``, removed here; the chunk size is set
    through the module constant it is computed from)."""
    from xpukit.loading.training.chunked_loss import apply_chunked_loss
    from xpukit.planning.training import activation_memory

    base = model.get_base_model()
    base.__dict__.pop("forward", None)
    activation_memory.CHUNK_BYTES = tokens * 4 * int(base.lm_head.weight.shape[0])
    return "(bench) " + apply_chunked_loss(base)
