"""What the weights' format changes in the ``fast_decode`` plan (pure; ``decode.py`` decides).

* which torchao formats fuse q/k/v and gate/up (their inner tensors slice by rows: docs/decode-kernels.md
  "Fused projections");
* the label the compile cache keys the weights by;
* torchao int8 on CUDA: inductor's pattern matcher off for the step (docs/decode.md "Quantized models");
* which formats xpukit's own weight-only product serves at a decode step (docs/decode-kernels.md
  "Weight-only products").
"""

from __future__ import annotations

from typing import Any

__all__ = ["fusable", "int8_patterns_off", "weight_kernel", "weights_label"]

_GPU = {"cuda", "xpu"}
# torchao 0.18 formats whose inner tensors slice by rows (aten.slice), so that q/k/v and gate/up
# concatenate (docs/decode-kernels.md "Fused projections"); plain_int32 (XPU int4) has no row slicing.
# tinygemm's int4 (tile_packed_to_4d) is kept apart: its row slices leave scale_and_zero non-contiguous,
# which torchao's int4 matmul asserts against (H200, torchao 0.18, 2026-12-04).
_FUSABLE_TORCHAO = {("Int8WeightOnlyConfig", None)}
# The torchao configs whose weights xpukit's Triton product reads in their stored form
# (xpukit/kernels/woq.py), with the kernel's name: int8, 2.05x torchao's on the H200 (Qwen3-8B shape,
# batch 1, 2026-12-04). Its int4 kernel over tinygemm's layout read the weights at 0.53-0.69 TB/s there
# against tinygemm's 1.26-1.74, so tinygemm keeps int4 (docs/decode-kernels.md "Weight-only products").
_KERNELS = {("Int8WeightOnlyConfig", None): "int8"}


def _key(config: dict[str, Any] | None) -> tuple[Any, Any]:
    kwargs = (config or {}).get("quant_type_kwargs") or {}
    return (config or {}).get("quant_type"), kwargs.get("int4_packing_format")


def fusable(quantization: str | None, config: dict[str, Any] | None) -> bool:
    """Weights whose rows concatenate: float ones, and the torchao formats that slice by rows."""
    if quantization is None:
        return True
    if quantization != "torchao" or not config:
        return False
    return _key(config) in _FUSABLE_TORCHAO


def weights_label(dtype: str, config: dict[str, Any] | None) -> str:
    """The weights' format as the compile cache keys it (``bfloat16``, ``torchao Int8WeightOnlyConfig``…)."""
    if not config:
        return dtype
    quant_type, packing = _key(config)
    return f"torchao {quant_type}" + (f" ({packing})" if packing else "")


def int8_patterns_off(backend: str, config: dict[str, Any] | None) -> bool:
    """torchao int8 weight-only on CUDA: the pattern matcher's int8 rewrite is the slow kernel."""
    return backend == "cuda" and _key(config)[0] == "Int8WeightOnlyConfig"


def weight_kernel(backend: str, quantization: str | None, config: dict[str, Any] | None) -> str:
    """The name of xpukit's weight-only product for these weights at a decode step, or ``""``.

    On CUDA and XPU only (the kernel is Triton); the load checks each weight's product against
    torchao's before it routes anything through it, and keeps torchao's product when triton does not
    import.
    """
    if backend not in _GPU or quantization != "torchao":
        return ""
    return _KERNELS.get(_key(config), "")
