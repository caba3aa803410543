"""The Triton kernels behind :mod:`xpukit.kernels.woq`: weight-only products for a few input rows.

A decode step multiplies one row per sequence by every weight, so its time is the time to read the
weights (docs/decode-kernels.md "Weight-only products"). These kernels read a quantized weight once, in its
stored form, and dequantize it in registers: no bf16 copy of the weight is written or read back.

* **Many programs, each a slice of the output.** One program computes ``BLOCK_N`` outputs for
  ``BLOCK_M`` rows and walks the whole input width in steps of ``BLOCK_K``. With
  ``BLOCK_N`` of 8–32 a 4 096-wide output is 128–512 programs, enough to keep every multiprocessor
  reading.
* **One row** (``BLOCK_M == 1``): elementwise multiply-adds into an fp32 tile, summed across once
  after the loop (no reduction across threads per step).
  **Two to 16 rows**: ``tl.dot`` over the rows padded to 16 (the smallest tile it takes), the weight
  converted to the input's dtype first (exact for int8; fp32 inputs use IEEE products, not TF32).
* **int8** (torchao's ``Int8Tensor``, one fp32 scale per output row): ``y = (x @ q.T) * scale``, the
  scale applied once to the fp32 sum.
* **int4 in tinygemm's layout** (torchao's ``Int4TilePackedTo4dTensor``; the layout is in
  :mod:`xpukit.kernels.int4_tile`): a program loads, for each of its rows, the 16 int32 words of one
  128-wide block of the input width (contiguous: 64 bytes a row, 512 bytes for 8 rows), splits each
  word into its 8 nibbles, and gathers the input at the positions those nibbles stand for (the same
  for every row), so each weight byte is read once. ``w = (q - 8) * scale + zero`` with the word's
  group's bf16 scale and zero, in fp32.

triton is imported at module level but guarded, so importing this module never fails; it is imported
only from :mod:`xpukit.kernels.woq` once triton imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except Exception:  # no triton here: the module still imports; nothing in it can be called
    triton = None

from xpukit.kernels._launch import on_device

if TYPE_CHECKING:
    import torch

__all__ = ["int4_tile_mm_triton", "int8_mm_triton", "pick_blocks"]

if triton is not None:

    @triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
    def _int8_mm_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        q_ptr,
        s_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_qn,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_m = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        wide = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # one row: summed once, after the loop
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < K
            w = tl.load(
                q_ptr + offs_n[:, None] * stride_qn + kk[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0,
            )
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            if BLOCK_M == 1:
                wide += x.to(tl.float32) * w.to(tl.float32)
            elif IEEE:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if BLOCK_M == 1:
            acc = tl.sum(wide, axis=1)[None, :]
        scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = acc * scale[None, :]
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )

    @triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
    def _int4_tile_mm_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        q_ptr,
        sz_ptr,
        y_ptr,
        M,
        N,
        K,
        K_TILES,
        N_PAD,
        stride_xm,
        stride_ym,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILES: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        WORDS: tl.constexpr = TILES * 16
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        mask_m = offs_m < M
        word = tl.arange(0, WORDS)
        nibble = tl.arange(0, 8)
        tile, u = word // 16, word % 16
        # int4_tile.py: word u = 4 * lane_k + i3 of a row's block; nibble j = 4 * (k % 2) + (k % 32) // 8
        k_word = tile * 128 + (u % 4) * 32 + (u // 4) * 2  # [WORDS]
        k_in = k_word[:, None] + 8 * (nibble % 4)[None, :] + (nibble // 4)[None, :]  # [WORDS, 8]
        row = (offs_n // 8) * K_TILES * 128 + (offs_n % 8) * 16  # [BLOCK_N]: its words of block 0
        at = tile * 128 + u  # [WORDS]: a block's 8 rows × 16 words are 128 contiguous words
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        wide = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)  # one row: summed once, after the loop
        for t0 in range(0, K_TILES, TILES):
            mask_w = (t0 + tile) < K_TILES
            mask_s = mask_n[:, None] & mask_w[None, :]
            words = tl.load(q_ptr + row[:, None] + (t0 * 128 + at)[None, :], mask=mask_s, other=0)
            group = (t0 * 128 + k_word) // GROUP  # every nibble of a word is in its word's group
            where = (group[None, :] * N_PAD + offs_n[:, None]) * 2
            scale = tl.load(sz_ptr + where, mask=mask_s, other=0.0).to(tl.float32)
            zero = tl.load(sz_ptr + where + 1, mask=mask_s, other=0.0).to(tl.float32)
            if BLOCK_M == 1:
                # sum_j ((q - 8) s + z) x_j = s * sum_j q x_j + (z - 8 s) * sum_j x_j, per word: per
                # nibble a shift, a mask, a conversion and one multiply-add.
                m = tl.program_id(1)  # the one row
                dot = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
                xsum = tl.zeros((WORDS,), dtype=tl.float32)
                for j in tl.static_range(8):
                    kj = t0 * 128 + k_word + 8 * (j % 4) + j // 4
                    xj = tl.load(x_ptr + m * stride_xm + kj, mask=kj < K, other=0.0).to(tl.float32)
                    dot += ((words >> (4 * j)) & 0xF).to(tl.float32) * xj[None, :]
                    xsum += xj
                wide += scale * dot + (zero - 8.0 * scale) * xsum[None, :]
            else:
                q = (words[:, :, None] >> (4 * nibble)[None, None, :]) & 0xF  # [BLOCK_N, WORDS, 8]
                w = (q.to(tl.float32) - 8.0) * scale[:, :, None] + zero[:, :, None]
                flat = tl.reshape(t0 * 128 + k_in, (WORDS * 8,))
                x = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + flat[None, :],
                    mask=mask_m[:, None] & (flat < K)[None, :],
                    other=0.0,
                )
                wt = tl.reshape(w, (BLOCK_N, WORDS * 8)).to(x.dtype)
                if IEEE:
                    acc += tl.dot(x, tl.trans(wt), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(wt))
        if BLOCK_M == 1:
            acc = tl.sum(wide, axis=1)[None, :]
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


def pick_blocks(rows: int, n: int, k: int, programs: int = 0) -> dict[str, int]:
    """The launch's tile sizes and warps for ``rows`` input rows and an ``n × k`` weight.

    One row: 8 outputs by 512 inputs a step with 4 warps, and for an output at least ``64 *
    programs`` wide (the 8B model's gate/up product: 24 576 against 16 896 on the H200) 32 by 128 with
    8 warps: the fastest settings of the H200 sweep on the Qwen3-8B projections (docs/decode-kernels.md
    "Weight-only products"). More rows take the ``tl.dot`` path, 16 rows by 16 or 32 outputs
    (32 where that still gives ``programs`` programs: two per multiprocessor, or 264 when not given).
    """
    want = programs or 264
    if rows == 1:  # the H200 sweep (bench_woq --sweep, 2026-12-04): narrow tiles, wide steps
        if n >= 64 * want:  # gate/up of an 8B model: 24 576 rows
            return {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8}
        return {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": min(512, _pow2(k)), "num_warps": 4}
    block_m, block_n = 16, 16
    if -(-n // 32) >= want:
        block_n = 32
    block_k = min(128, _pow2(k))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4}


def _pow2(k: int) -> int:
    """``k`` rounded up to a power of two, at least 16."""
    return max(16, 1 << (max(k, 1) - 1).bit_length())


def _programs(device: torch.device) -> int:
    """Two programs per multiprocessor (CUDA) or execution unit group (XPU), 264 if unknown."""
    import torch

    module = getattr(torch, device.type, None)
    try:
        props = module.get_device_properties(device) if module is not None else None
    except Exception:  # the interpreter's CPU tensors, a runtime that cannot say
        props = None
    count = getattr(props, "multi_processor_count", None) or getattr(props, "gpu_subslice_count", None)
    return 2 * int(count) if count else 264


def int8_mm_triton(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, blocks: dict[str, int] | None = None
) -> torch.Tensor:
    """``(x @ qdata.T) * scale`` for a 2-D ``x``, in ``x``'s dtype (each 16 rows read the weight once).

    Args:
        x: ``[M, K]`` activations (bf16, fp16 or fp32).
        qdata: ``[N, K]`` int8 weight, rows contiguous.
        scale: ``N`` per-row scales (any shape with ``N`` elements).
        blocks: tile sizes to use instead of :func:`pick_blocks`' (the benchmark's sweep).
    """
    import torch

    if triton is None:
        raise RuntimeError("int8_mm_triton: triton is not installed")
    rows, width = x.shape
    n = qdata.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    qdata = qdata if qdata.stride(-1) == 1 else qdata.contiguous()
    scale = scale.reshape(-1)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    chosen = dict(blocks or pick_blocks(rows, n, width, _programs(x.device)))
    warps = chosen.pop("num_warps", 4)
    grid = (triton.cdiv(n, chosen["BLOCK_N"]), triton.cdiv(rows, chosen["BLOCK_M"]))
    with on_device(x.device):
        _int8_mm_kernel[grid](
            x,
            qdata,
            scale,
            y,
            rows,
            n,
            width,
            x.stride(0),
            qdata.stride(0),
            y.stride(0),
            IEEE=x.dtype == torch.float32,
            num_warps=warps,
            **chosen,
        )
    return y


def int4_tile_mm_triton(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale_and_zero: torch.Tensor,
    group: int,
    n: int,
    blocks: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for an int4 weight ``W`` (``n`` rows) in tinygemm's layout, in ``x``'s dtype.

    Args:
        x: ``[M, K]`` activations (bf16, fp16 or fp32).
        qdata: int32 ``[ceil(n/8), K_pad/128, 32, 4]`` (inner k-tiles 8, what torchao stores).
        scale_and_zero: ``[K_pad/group, n_pad, 2]`` bf16 (scale, zero).
        group: the group size (32, 64, 128 or 256).
        n: the weight's rows (the output's width).
        blocks: ``BLOCK_M``, ``BLOCK_N`` (a multiple of 8), ``TILES`` and ``num_warps`` instead of the
            defaults (the benchmark's sweep).
    """
    import torch

    if triton is None:
        raise RuntimeError("int4_tile_mm_triton: triton is not installed")
    rows, width = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    chosen = dict(blocks or {"BLOCK_M": 1 if rows == 1 else 16, "BLOCK_N": 16, "TILES": 2, "num_warps": 4})
    warps = chosen.pop("num_warps", 4)
    grid = (triton.cdiv(n, chosen["BLOCK_N"]), triton.cdiv(rows, chosen["BLOCK_M"]))
    with on_device(x.device):
        _int4_tile_mm_kernel[grid](
            x,
            qdata,
            scale_and_zero,
            y,
            rows,
            n,
            width,
            qdata.shape[1],
            scale_and_zero.shape[1],
            x.stride(0),
            y.stride(0),
            GROUP=group,
            IEEE=x.dtype == torch.float32,
            num_warps=warps,
            **chosen,
        )
    return y
