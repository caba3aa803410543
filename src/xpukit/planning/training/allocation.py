"""The largest single tensor of a LoRA step against the device's single-allocation cap (pure).

Arc GPUs refuse one allocation above about 4 GB unless ``UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1``
is set (docs/platform-install.md §6.5): a step whose largest tensor crosses that line fails with "XPU
out of memory" on a card with memory to spare. In a LoRA step the largest tensor is the loss's
float32 logits with the plain loss (transformers upcasts them: micro-batch × tokens × vocabulary ×
4 bytes; Qwen3-0.6B at 4 × 2 048 tokens: 4.98 GB). The fused losses never hold them whole: liger's
and xpukit's chunked cross-entropy work a chunk of tokens at a time. The training plan
(``planning/training/fit.py``) skips a plain loss whose logits would cross the cap, and says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.planning.budgets import format_bytes

if TYPE_CHECKING:
    from collections.abc import Mapping

    from xpukit.machine.facts import DeviceFacts

__all__ = [
    "ALLOCATION_CAP",
    "CAPPED_FAMILIES",
    "RELAXED_VARIABLE",
    "allocation_cap",
    "cap_text",
    "logits_bytes",
]

# One allocation at most on the capped families (Level Zero's maxMemAllocSize there: 4 GiB).
ALLOCATION_CAP = 4 * 2**30
CAPPED_FAMILIES = frozenset({"arc-a", "arc-b"})
RELAXED_VARIABLE = "UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS"


def allocation_cap(device: DeviceFacts, env: Mapping[str, str]) -> int | None:
    """The largest single allocation ``device`` accepts (``None``: no cap known)."""
    if device.backend != "xpu" or device.family not in CAPPED_FAMILIES:
        return None
    if env.get(RELAXED_VARIABLE, "").strip() == "1":
        return None
    return ALLOCATION_CAP


def logits_bytes(micro_batch: int, seq_len: int, vocab: int) -> int:
    """The plain loss's float32 logits of one micro-batch: its largest single tensor."""
    return micro_batch * seq_len * vocab * 4


def cap_text(size: int, cap: int) -> str:
    """Why a tensor of ``size`` bytes cannot be one allocation under ``cap``, with the fix."""
    return (
        f"the plain loss's float32 logits would be one {format_bytes(size)} tensor, above this GPU's "
        f"{format_bytes(cap)} single-allocation cap ({RELAXED_VARIABLE}=1 lifts it, "
        "docs/platform-install.md §6.5)"
    )
