"""The decisions the training plan records, with their reasons (pure; ``fit.py`` chooses the values).

``gradient_checkpointing``, ``liger`` and ``loss`` each say what was chosen, why, and which cheaper
options were tried and rejected with their estimated peak (docs/training-plan.md "Training plan by fit").
"""

from __future__ import annotations

from xpukit.planning.budgets import format_bytes
from xpukit.planning.training.loss_chunk import LOSS_CHUNK_TOKENS
from xpukit.planning.vocabulary import Decision

__all__ = ["FUSED_LOSS", "PACKED_LOSS", "gc_decision", "liger_decision", "loss_decision", "partly"]


def partly(checkpointed: int | None, layers: int) -> str | None:
    """How many layers are checkpointed where not all of them are (``None``: all)."""
    if checkpointed is None:
        return None
    return (
        f"for {checkpointed} of the {layers} layers, the fewest whose step fits: the others keep their "
        'activations and are not recomputed (docs/training-plan.md "Fewer checkpointed layers")'
    )


def gc_decision(
    gc: bool | str, given: bool, fit_text: str, tried: list[tuple[str, int]], partial: str | None = None
) -> Decision:
    if given:
        return Decision(
            name="gradient_checkpointing",
            value=gc,
            source="user",
            reason=f"lora={{'gradient_checkpointing': {gc!r}}} given; {fit_text}",
        )
    if gc == "offload":
        what = "on, saved activations offloaded to host memory (asynchronous pinned copies on CUDA/XPU)"
    else:
        what = "on (non-reentrant)" if gc else "off: the fastest"
        what += f" {partial}" if partial else ""
    rejected = tuple((option, f"needs {format_bytes(b)}") for option, b in tried[:-1])
    return Decision(name="gradient_checkpointing", value=gc, reason=f"{what}; {fit_text}", rejected=rejected)


# Why the fused loss is taken first when packing is on (docs/training-plan.md
# "Packing: no compute on padding").
PACKED_LOSS = (
    "with packing the head still runs over the collator's padded batch, where the plain loss keeps logits "
    "for the padding too; liger's fused loss kept the step time and saved 3.7 GB there (H200 real run, "
    "Qwen3-8B shape: 226 ms a step both, peak 19.36 → 15.66 GB)"
)

# Why the fused LoRA path takes liger's loss first (docs/training-plan.md "liger's loss chunk"): in chunks
# of LOSS_CHUNK_TOKENS it is faster than the plain loss, and keeps no logits.
FUSED_LOSS = (
    f"liger's fused loss in chunks of {LOSS_CHUNK_TOKENS} tokens is faster than the plain loss and keeps "
    "no logits (H200, 2 048 tokens: Qwen3-8B's 151 936 words 8.1 against 10.4 ms, 0.17 against 3.75 GB; "
    "Gemma-3's 262 208 words 9.2 against 13.9 ms, 0.28 against 6.46 GB)"
)


def liger_decision(
    liger: bool, given: bool | None, ok: bool, why: str, fit_text: str, why_fused: str | None = None
) -> Decision:
    if given is not None:
        reason = f"lora={{'liger': {given!r}}} given" + (
            "" if ok or not given else f", but {why}: loading records the fallback"
        )
        return Decision(
            name="liger", value=liger, reason=reason, source="user" if liger == given else "fallback"
        )
    if not ok:
        return Decision(name="liger", value=False, reason=why)
    if liger:
        reason = why_fused or f"fused linear cross-entropy needed to fit: {fit_text}"
        return Decision(name="liger", value=True, reason=reason)
    return Decision(
        name="liger",
        value=False,
        reason="not needed to fit: on the unfused path liger's kernels cost speed (H200, Qwen3-8B shape: "
        "28 % fewer tokens/s, measured with liger's own loss chunks; docs/training.md "
        '"liger-kernel (extra `liger`)")',
        rejected=((True, "costs speed, and the step fits without it"),),
    )


def loss_decision(loss: str, liger_why: str, fit_text: str) -> Decision:
    """Which loss: plain when it fits on the unfused path, else a fused cross-entropy (docs/training-plan.md
    "Chunked cross-entropy", "liger's loss chunk"; H200 bench_loss, 2 048 tokens × 151 936 words:
    plain 10.4 ms and 3.75 GB, chunked 13.7 ms and 0.82 GB, liger in its own chunks 21.6 ms and
    0.04 GB, in 512-token chunks 8.1 ms and 0.17 GB)."""
    if loss == "plain":
        rejected = (("chunked", "not needed to fit"), ("liger", "not needed to fit"))
        return Decision(
            name="loss",
            value="plain",
            rejected=rejected,
            reason="lm_head + transformers' cross-entropy: it fits",
        )
    if loss == "liger":
        why = (
            f"liger-kernel's fused linear cross-entropy in chunks of up to {LOSS_CHUNK_TOKENS} tokens "
            f"(no logits kept whole): {fit_text}"
        )
        return Decision(name="loss", value="liger", reason=why)
    return Decision(
        name="loss",
        value="chunked",
        reason=f"xpukit's chunked cross-entropy (one chunk's logits at a time), since liger's cannot be "
        f"used ({liger_why}): {fit_text}",
    )
