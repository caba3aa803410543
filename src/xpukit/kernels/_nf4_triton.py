"""The Triton nf4 dequantisation kernel behind :func:`xpukit.kernels.nf4.dequantize_nf4` on CUDA/XPU.

One program turns ``BLOCK`` packed bytes into ``2 * BLOCK`` contiguous outputs: it splits each byte
into its high (earlier element) and low nibble, looks both up in the NF4 table, multiplies by the
block's fp32 scale and rounds once to the output dtype; the arithmetic of
:func:`~xpukit.kernels.nf4.dequantize_nf4_reference`. With double quantisation the scale is decoded
in the same program (``code2[q] * absmax2[q_block] + offset``). The kernel is launched with
``enable_fp_fusion=False`` so that product and add are not contracted into one FMA, which would round
differently from bitsandbytes (it decodes the scales in one kernel and adds ``offset`` in another).

triton is imported at module level but guarded, so importing this module never fails; it is imported
only from :func:`~xpukit.kernels.nf4.dequantize_nf4`, on a CUDA/XPU tensor, once triton imported.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except Exception:  # no triton here: the module still imports; nothing in it can be called
    triton = None

from xpukit.kernels._launch import on_device

if TYPE_CHECKING:
    import torch
    from bitsandbytes.functional import QuantState

__all__ = ["dequantize_nf4_triton"]

_BLOCK = 1024  # packed bytes per program: 2 048 outputs

if triton is not None:

    @triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
    def _nf4_dequant_kernel(  # type: ignore[no-untyped-def]
        packed_ptr,
        absmax_ptr,
        code_ptr,
        absmax2_ptr,
        code2_ptr,
        offset_ptr,
        out_ptr,
        n_bytes,
        n_out,
        BLOCKSIZE: tl.constexpr,
        BLOCKSIZE2: tl.constexpr,
        NESTED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        byte_idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = byte_idx < n_bytes
        byte = tl.load(packed_ptr + byte_idx, mask=in_range, other=0).to(tl.int32)
        # Both nibbles of a byte lie in one scale block: blocksize is even, the first element is even.
        block = (byte_idx * 2) // BLOCKSIZE
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=in_range, other=0).to(tl.int32)
            scale2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=in_range, other=0.0)
            scale = tl.load(code2_ptr + q) * scale2 + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + block, mask=in_range, other=0.0)
        high = tl.load(code_ptr + (byte >> 4)) * scale
        low = tl.load(code_ptr + (byte & 15)) * scale
        values = tl.interleave(high, low)  # element 2i from the high nibble, 2i + 1 from the low
        out_idx = pid.to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + out_idx, values.to(out_ptr.dtype.element_ty), mask=out_idx < n_out)


@functools.cache
def _nf4_table(device: torch.device) -> torch.Tensor:
    import torch

    from xpukit.kernels.nf4_table import NF4_VALUES

    return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)


def dequantize_nf4_triton(
    weight: torch.Tensor, quant_state: QuantState, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantise an nf4 weight on a CUDA/XPU device with the Triton kernel (see the module docstring)."""
    import torch

    if triton is None:
        raise RuntimeError("dequantize_nf4_triton: triton is not installed")
    shape = tuple(int(s) for s in quant_state.shape)
    n_out = 1
    for size in shape:
        n_out *= size
    if out is None:
        out = torch.empty(shape, dtype=quant_state.dtype, device=weight.device)
    packed = weight.reshape(-1).view(torch.uint8)
    if quant_state.nested:
        state2 = quant_state.state2
        absmax, absmax2 = quant_state.absmax, state2.absmax.float()
        code2 = state2.code.float().to(weight.device)
        # A device tensor, read in the kernel: float() of it would wait for the device every call.
        offset = torch.as_tensor(quant_state.offset, dtype=torch.float32, device=weight.device).reshape(1)
        blocksize2 = int(state2.blocksize)
    else:
        absmax = quant_state.absmax.float()
        absmax2 = code2 = offset = absmax  # unused when NESTED is false
        blocksize2 = 1
    n_bytes = packed.numel()
    grid = (triton.cdiv(n_bytes, _BLOCK),)
    with on_device(weight.device):
        _nf4_dequant_kernel[grid](
            packed,
            absmax,
            _nf4_table(weight.device),
            absmax2,
            code2,
            offset,
            out,
            n_bytes,
            n_out,
            BLOCKSIZE=int(quant_state.blocksize),
            BLOCKSIZE2=blocksize2,
            NESTED=bool(quant_state.nested),
            BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )
    return out
