"""nf4 dequantisation, bit-identical to bitsandbytes' ``dequantize_4bit``.

bitsandbytes stores a 4-bit weight as packed bytes, two codes a byte (the high nibble is the earlier
element), with one fp32 scale (``absmax``) per block of ``blocksize`` elements. An element is
``NF4[code] * absmax[block]``, computed in fp32 and rounded once to the output dtype. With double
quantisation (``quant_state.nested``) the scales are themselves 8-bit codes: ``absmax =
state2.code[q] * state2.absmax[q_block] + offset``, again in fp32, the product rounded before the add.
Source: bitsandbytes' ``functional.dequantize_4bit`` / ``dequantize_blockwise`` (the nested branch:
``dequantize_blockwise(absmax, state2)`` then ``absmax += offset``) and its CUDA kernel
``kDequantizeBlockwise`` with ``dDequantizeNF4``; the 16 NF4 values are listed in the QLoRA paper
(Dettmers et al. 2023, arXiv:2305.14314, appendix E) and in bitsandbytes' ``backends/utils.py``.

:func:`dequantize_nf4` dispatches: xpukit's Triton kernel (``xpukit.kernels._nf4_triton``) on CUDA and
XPU when triton imports, bitsandbytes' own ``dequantize_4bit`` everywhere else (CPU, MPS, no triton,
fp4). :func:`dequantize_nf4_reference` is the readable PyTorch statement of the same arithmetic.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from xpukit.kernels.nf4_table import NF4_VALUES

if TYPE_CHECKING:
    import torch
    from bitsandbytes.functional import QuantState

__all__ = ["NF4_VALUES", "dequantize_nf4", "dequantize_nf4_reference", "triton_available"]

_TRITON_DEVICES = ("cuda", "xpu")


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (it is what runs :mod:`xpukit.kernels._nf4_triton` on CUDA/XPU)."""
    try:
        import triton  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails on import
        return False
    return True


def dequantize_nf4(
    weight: torch.Tensor, quant_state: QuantState, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantise a bitsandbytes 4-bit weight into ``quant_state.dtype``, shaped ``quant_state.shape``.

    Args:
        weight: the packed ``uint8`` data (a ``Params4bit`` or its ``.data``).
        quant_state: its ``bitsandbytes.functional.QuantState``.
        out: an optional output tensor of that shape and dtype.

    Returns:
        The dequantised weight, the same bits as ``bitsandbytes.functional.dequantize_4bit``.
    """
    if (
        weight.device.type in _TRITON_DEVICES
        and quant_state.quant_type == "nf4"
        and weight.shape[0] != 1  # the transposed [1, n] form bitsandbytes still accepts
        and triton_available()
    ):
        from xpukit.kernels._nf4_triton import dequantize_nf4_triton

        return dequantize_nf4_triton(weight, quant_state, out=out)
    import bitsandbytes.functional as bnb_functional

    return bnb_functional.dequantize_4bit(weight, quant_state, out=out)


def nested_absmax_reference(quant_state: QuantState) -> torch.Tensor:
    """The fp32 per-block scales of a 4-bit weight, undoing double quantisation where it was used."""
    import torch

    if not quant_state.nested:
        return quant_state.absmax.float()
    state2 = quant_state.state2
    codes = quant_state.absmax.reshape(-1).long()
    scales = state2.absmax.float().repeat_interleave(state2.blocksize)[: codes.numel()]
    absmax = state2.code.float().to(codes.device)[codes] * scales  # rounded to fp32 before the add
    return absmax + torch.as_tensor(quant_state.offset, dtype=torch.float32, device=absmax.device)


def dequantize_nf4_reference(weight: torch.Tensor, quant_state: QuantState) -> torch.Tensor:
    """The plain PyTorch statement of nf4 dequantisation (module docstring); runs on any device."""
    import torch

    if quant_state.quant_type != "nf4":
        raise ValueError(f"dequantize_nf4_reference: quant_type {quant_state.quant_type!r}, expected 'nf4'")
    n = 1
    for size in quant_state.shape:
        n *= int(size)
    packed = weight.reshape(-1).view(torch.uint8)
    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:n].long()
    table = torch.tensor(NF4_VALUES, dtype=torch.float32, device=packed.device)
    scales = nested_absmax_reference(quant_state).repeat_interleave(quant_state.blocksize)[:n]
    return (table[codes] * scales).to(quant_state.dtype).reshape(tuple(quant_state.shape))
