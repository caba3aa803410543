"""How a packed training row's attention keeps its examples apart: varlen attention or a mask (pure).

Packing (:mod:`xpukit.planning.training.packing`) runs a padded batch as one row of its real tokens,
positions restarting per example. With SDPA, transformers then builds a block-diagonal causal mask
from those positions on every step. On CUDA, torch's ``varlen_attn`` (``torch.nn.attention.varlen``,
from torch 2.10) takes the examples' boundaries instead and runs FlashAttention's variable-length
kernel: no mask is built, and no attention is computed across examples (docs/training-plan.md
"Packed rows without a mask"; docs/known-issues.md "torch: varlen_attn").

The decision's value is ``varlen`` where all of these hold: packing is on, the attention is SDPA that
xpukit chose (a user's ``attn="sdpa"`` keeps what was asked), the device is CUDA from compute
capability 8.0 (the kernel's documented floor), the dtype is bf16 or fp16, and torch is 2.10 or later.
Otherwise ``mask``, with the reason. There is no decision where packing is off or the attention is
not SDPA. ``loading/training/varlen_attention.py`` acts on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.planning.training.graphs import torch_release
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.machine.facts import DeviceFacts

__all__ = ["VARLEN_MIN_CC", "VARLEN_TORCH", "decide_packed_attention", "varlen_problem"]

# The first torch with torch.nn.attention.varlen.varlen_attn (docs/known-issues.md "torch: varlen_attn").
VARLEN_TORCH = (2, 10)
# FlashAttention's kernels behind varlen_attn: NVIDIA A100 (compute capability 8.0) or newer.
VARLEN_MIN_CC = (8, 0)
_HALF = ("bfloat16", "float16")
_KERNEL = "torch's varlen_attn runs FlashAttention's CUDA kernels (NVIDIA, compute capability 8.0+)"


def varlen_problem(device: DeviceFacts, dtype: str, torch_version: str | None) -> str | None:
    """Why a packed row's attention cannot run through ``varlen_attn`` here (``None`` when it can)."""
    if device.backend == "cuda" and device.family == "amd":
        return f"{_KERNEL}; on AMD GPUs (ROCm) it is not documented to run"
    if device.backend == "cpu":
        return f"{_KERNEL}; on the CPU it raises NotImplementedError (measured on torch 2.13)"
    if device.backend != "cuda":
        return f"{_KERNEL}, not {device.backend.upper()} ({device.name})"
    cc = device.compute_capability
    if cc is not None and cc < VARLEN_MIN_CC:
        return f"{_KERNEL}; {device.name} has compute capability {cc[0]}.{cc[1]}"
    if dtype not in _HALF:
        return f"varlen_attn computes in bf16 or fp16, the plan's dtype is {dtype}"
    release = torch_release(torch_version)
    if release is None or release < VARLEN_TORCH:
        need = ".".join(map(str, VARLEN_TORCH))
        return f"varlen_attn arrived in torch {need}; this is torch {torch_version or 'unknown'}"
    return None


def decide_packed_attention(
    packing: Decision | None,
    attention: Decision,
    *,
    device: DeviceFacts,
    dtype: str,
    torch_version: str | None,
) -> Decision | None:
    """The ``packed_attention`` decision (``None`` where packing is off or the attention is not SDPA).

    Args:
        packing: the ``packing`` decision (its value: the bucket, or ``False``).
        attention: the ``attn_implementation`` decision.
        device: the device the model trains on.
        dtype: the plan's compute dtype.
        torch_version: the installed torch version.
    """
    if packing is None or not packing.value or attention.value != "sdpa":
        return None
    if attention.source == "user":
        return Decision(
            name="packed_attention",
            value="mask",
            source="user",
            reason="attn='sdpa' given: SDPA runs the packed row with the block-diagonal causal mask "
            "transformers builds from the restarting positions",
            rejected=(("varlen", "attn='sdpa' was asked for"),),
        )
    problem = varlen_problem(device, dtype, torch_version)
    if problem is not None:
        return Decision(
            name="packed_attention",
            value="mask",
            reason="the packed row runs through SDPA with the block-diagonal causal mask transformers "
            f"builds from the restarting positions: {problem}",
            rejected=(("varlen", problem),),
        )
    return Decision(
        name="packed_attention",
        value="varlen",
        reason="the packed row's attention runs through torch's varlen_attn (FlashAttention's "
        "variable-length kernel) from the examples' boundaries: no mask is built and nothing is "
        "computed across examples; evaluation and generate keep SDPA (attn='sdpa' keeps the mask)",
        rejected=(("mask", "transformers would build a block-diagonal causal mask on every step"),),
    )
