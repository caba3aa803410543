"""Weight-only quantized products for decoding: read the quantized weight once, at the bandwidth.

On CUDA, torchao 0.18's int8 weight-only product is either ``aten._weight_int8pack_mm`` (read the
weights at 0.15–0.24 TB/s on the H200) or, with inductor's pattern matcher off, a kernel that writes
a bf16 copy of each weight and a cuBLAS product that reads it back: three times the bytes of reading
int8 once. Its int4 product (tinygemm) read the weights at 1.4 TB/s at batch 1 (docs/decode.md
"Quantized models", docs/decode-kernels.md "Weight-only products"). No installed library gave a
product that reads them at the bandwidth, so xpukit has one, in Triton so that it runs on CUDA and XPU:

* :func:`weight_only_linear` is ``F.linear`` for every weight and input, except a supported
  quantized weight times at most :data:`MAX_ROWS` input rows on CUDA/XPU (a decode step, a short
  prompt), which goes to the custom ops ``xpukit::int8_weight_only_mm`` / ``xpukit::int4_tile_mm``;
* each op runs xpukit's Triton kernel (:mod:`xpukit.kernels._woq_triton`) on CUDA/XPU and its
  reference elsewhere; dynamo traces it as one opaque call, so a compiled and captured decode step
  keeps it;
* the references state the arithmetic: :func:`int8_mm_reference` (the fp32 sum of ``x * q`` times
  the row's fp32 scale) and :func:`xpukit.kernels.int4_tile.int4_tile_mm_reference` (``(q - 8) *
  scale + zero`` per group), each rounded once to ``x``'s dtype. torchao rounds in other places
  (the int8 product to bf16 before its scale; tinygemm dequantizes in bf16); they differ by bf16
  rounding only.

Supported: torchao's ``Int8Tensor`` weight-only with one scale per output row (``Int8WeightOnlyConfig``,
what ``quantize="8bit"`` loads on a GPU) and ``Int4TilePackedTo4dTensor`` (``quantize="4bit"`` on
CUDA), without activation quantization or a pre-scale. Anything else goes to ``F.linear`` and
torchao's own dispatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.kernels.int4_tile import int4_tile_mm_reference
from xpukit.kernels.nf4 import triton_available

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_ROWS",
    "int4_tile_mm",
    "int8_mm",
    "int8_mm_reference",
    "kernel_of",
    "register",
    "unsupported",
    "weight_only_linear",
]

MAX_ROWS = 16  # input rows the kernels serve: a decode step up to batch 16; a longer prefill is torchao's
_DEVICES = ("cuda", "xpu")
_GROUPS = (32, 64, 128, 256)  # tinygemm's group sizes
_REGISTERED = False  # set once xpukit's ops exist in this process


_KINDS = {"Int8Tensor": "int8", "Int4TilePackedTo4dTensor": "int4"}  # torchao's class → xpukit's kernel


def kernel_of(weight: torch.Tensor) -> str | None:
    """The name of xpukit's kernel for ``weight`` (``int8``, ``int4``), ``None`` when it has none."""
    return _KINDS.get(type(weight).__name__) if unsupported(weight) is None else None


def unsupported(weight: torch.Tensor) -> str | None:
    """``None`` when :func:`weight_only_linear` has a kernel for ``weight``, else why not."""
    kind = type(weight).__name__
    if kind not in ("Int8Tensor", "Int4TilePackedTo4dTensor") or not hasattr(weight, "qdata"):
        return f"{kind} weights have no xpukit kernel (torchao int8 weight-only and tinygemm int4 only)"
    if any(getattr(weight, name, None) is not None for name in ("act_quant_kwargs", "act_pre_scale")):
        return f"{kind} with activation quantization or a pre-scale is torchao's own product"
    block = list(getattr(weight, "block_size", []) or [])
    if kind == "Int8Tensor":
        if weight.qdata.dim() != 2 or not block or block[-1] != weight.qdata.shape[-1]:
            return "int8 with per-group scales is torchao's own product (one scale per row only)"
        if weight.scale.numel() != weight.qdata.shape[0]:
            return "int8 with a scale that is not one per output row"
        return None
    q = weight.qdata
    if q.dim() != 4 or tuple(q.shape[2:]) != (32, 4):
        return f"int4 packed with {tuple(q.shape)} (xpukit reads 8 inner k-tiles: [N/8, K/128, 32, 4])"
    if not block or block[-1] not in _GROUPS:
        return f"int4 with group size {block[-1] if block else None} (tinygemm's are {_GROUPS})"
    return None


def int8_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x @ qdata.T) * scale`` summed and scaled in fp32, rounded once to ``x``'s dtype."""
    return ((x.float() @ qdata.float().t()) * scale.float().reshape(1, -1)).to(x.dtype)


def register() -> None:
    """Register xpukit's ops once per process (before anything is compiled: dynamo does not trace
    the registration)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import torch

    # The schemas are spelled out: this module's annotations are strings (no torch at import).
    int8 = torch.library.custom_op(
        "xpukit::int8_weight_only_mm",
        mutates_args=(),
        schema="(Tensor x, Tensor qdata, Tensor scale) -> Tensor",
    )(int8_mm_reference)
    int4 = torch.library.custom_op(
        "xpukit::int4_tile_mm",
        mutates_args=(),
        schema="(Tensor x, Tensor qdata, Tensor scale_and_zero, int group, int rows) -> Tensor",
    )(int4_tile_mm_reference)

    def int8_on_device(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not triton_available():
            return int8_mm_reference(x, qdata, scale)
        from xpukit.kernels._woq_triton import int8_mm_triton

        return int8_mm_triton(x, qdata, scale)

    def int4_on_device(
        x: torch.Tensor, qdata: torch.Tensor, sz: torch.Tensor, group: int, rows: int
    ) -> torch.Tensor:
        if not triton_available():
            return int4_tile_mm_reference(x, qdata, sz, group, rows)
        from xpukit.kernels._woq_triton import int4_tile_mm_triton

        return int4_tile_mm_triton(x, qdata, sz, group, rows)

    for device in _DEVICES:
        int8.register_kernel(device)(int8_on_device)
        int4.register_kernel(device)(int4_on_device)
    int8.register_fake(lambda x, qdata, scale: x.new_empty((x.shape[0], qdata.shape[0])))
    int4.register_fake(lambda x, qdata, sz, group, rows: x.new_empty((x.shape[0], rows)))
    _REGISTERED = True


def int8_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``xpukit::int8_weight_only_mm`` on a 2-D ``x``: the kernel on CUDA/XPU, the reference elsewhere.
    (Registered on the first call, eagerly; a traced call finds it in ``torch.ops``.)"""
    import torch

    if not _REGISTERED:
        register()
    return torch.ops.xpukit.int8_weight_only_mm(x, qdata, scale)  # type: ignore[no-any-return, unused-ignore]


def int4_tile_mm(
    x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group: int, rows: int
) -> torch.Tensor:
    """``xpukit::int4_tile_mm`` on a 2-D ``x`` (``rows``: the weight's output rows)."""
    import torch

    if not _REGISTERED:
        register()
    return torch.ops.xpukit.int4_tile_mm(x, qdata, scale_and_zero, group, rows)


def weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    devices: tuple[str, ...] = _DEVICES,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through xpukit's kernel where it serves (module docstring).

    Args:
        x: the input, ``[..., K]``.
        weight: the layer's weight (a plain tensor or a torchao tensor subclass).
        bias: the layer's bias.
        devices: the device types the kernels serve (the tests add ``cpu`` to run the references
            through the same dispatch).
    """
    import torch

    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if (
        0 < rows <= MAX_ROWS
        and x.device.type in devices
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and (kind := kernel_of(weight)) is not None
    ):
        flat = x.reshape(rows, width)
        if kind == "int8":
            out = int8_mm(flat, weight.qdata, weight.scale)
        else:
            out = int4_tile_mm(
                flat, weight.qdata, weight.scale_and_zero, int(weight.block_size[-1]), weight.shape[0]
            )
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)
