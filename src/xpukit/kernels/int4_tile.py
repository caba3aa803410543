"""tinygemm's int4 weight layout, read in plain PyTorch (the reference of xpukit's int4 kernel).

torchao's ``Int4TilePackedTo4dTensor`` (``Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")``,
what ``quantize="4bit"`` loads on CUDA) holds the output of CUDA's ``aten._convert_weight_to_int4pack``
with 8 inner k-tiles (docs/decode-kernels.md "Weight-only products" has the derivation and its sources:
PyTorch's ``aten/src/ATen/native/cuda/int4mm.cu``, ``matrix_to_m16n8k16_Bint4_layout`` and the
consuming ``tinygemm_m16n8k16_chunk_kernel``; torchao's ``int4_tile_packed_to_4d_tensor.py``):

* ``qdata``: int32 ``[ceil(N/8), K/(16 t), 32, t/2]`` for ``t`` inner k-tiles (torchao: ``t = 8``,
  ``K`` padded to a multiple of 1 024);
* the 4-bit value of weight ``(n, k)`` is ``(qdata[n // 8, k // (16 t), (n % 8) * 4 + (k % 8) // 2,
  (k % (16 t)) // 32] >> 4 * (4 * (k % 2) + (k % 32) // 8)) & 0xF``: the 32 lanes of the tensor-core
  fragment, each word 8 values 8 apart in pairs;
* ``scale_and_zero``: bf16 ``[K / group, N_pad, 2]``, scale then zero; the weight is
  ``(q - 8) * scale + zero``.

This is the NVIDIA layout; ROCm builds pack differently, and the XPU's int4 is torchao's
``plain_int32``, which this does not read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["int4_tile_mm_reference", "pack_tile_int4", "unpack_tile_int4"]


def pack_tile_int4(q: torch.Tensor, inner_k_tiles: int = 8) -> torch.Tensor:
    """``[N, K]`` values in 0..15 into tinygemm's layout (what CUDA's op returns for them)."""
    import torch

    rows, width = q.shape
    step = inner_k_tiles * 16
    if width % step:
        raise ValueError(
            f"the width {width} is not a multiple of {step} (16 × {inner_k_tiles} inner k-tiles)"
        )
    tiles = -(-rows // 8)
    q = torch.cat([q.long(), q.new_zeros(tiles * 8 - rows, width).long()]) if tiles * 8 != rows else q.long()
    # k = i1*step + i3*32 + c*8 + l*2 + o and n = i0*8 + g  →  [i0, i1, g*4 + l, i3, nibble o*4 + c]
    x = q.view(tiles, 8, width // step, inner_k_tiles // 2, 4, 4, 2).permute(0, 2, 1, 5, 3, 6, 4)
    x = x.reshape(tiles, width // step, 32, inner_k_tiles // 2, 8)
    word = (x << (torch.arange(8) * 4)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def unpack_tile_int4(qdata: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``[rows, K]`` int32 values (0..15) held in tinygemm's layout."""
    import torch

    tiles, blocks, _, half = qdata.shape  # [N/8, K/(16 t), 32 lanes, t/2]
    nib = (qdata.to(torch.int32).unsqueeze(-1) >> (torch.arange(8, device=qdata.device) * 4).int()) & 0xF
    x = nib.view(tiles, blocks, 8, 4, half, 2, 4).permute(0, 2, 1, 4, 6, 3, 5)
    return x.reshape(tiles * 8, blocks * half * 2 * 16)[:rows].contiguous()


def int4_tile_mm_reference(
    x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group: int, rows: int
) -> torch.Tensor:
    """``x @ W.T`` in fp32, rounded once to ``x``'s dtype, ``W = (q - 8) * scale + zero``."""
    q = unpack_tile_int4(qdata, rows)[:, : x.shape[-1]].float()
    groups = scale_and_zero[:, :rows].float().repeat_interleave(group, 0)[: x.shape[-1]]  # [K, rows, 2]
    weight = (q - 8.0) * groups[..., 0].t() + groups[..., 1].t()
    return (x.float() @ weight.t()).to(x.dtype)
