"""Weight sizes of a model, from its layout, under every dtype and quantization (pure).

The tensors are those transformers' own ``compute_module_sizes`` (the function
``device_map="auto"`` uses) walks (:mod:`xpukit.planning.model.layout`), so tied weights, buffers
and the modules bitsandbytes leaves unquantised are counted exactly as transformers counts them
when it places the model (docs/known-issues.md "Size estimates without weights: Qwen3-0.6B":
Qwen3-0.6B bf16 1136.88 MiB, nf4 506.88 MiB). For 4-bit/8-bit sizes the bitsandbytes quantizer's
rules are applied without importing bitsandbytes, which costs seconds and can reach the Hub at
import (docs/known-issues.md "bitsandbytes: import reaches the Hub on avx512_bf16 CPUs"). The rule
is docs/planning.md "Size estimate"; :func:`xpukit.planning.model.facts.model_facts` records the
sizes in the model's facts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xpukit.planning.model.layout import Layout

logger = logging.getLogger(__name__)

__all__ = ["bytes_at_bits", "weight_sizes"]


def bytes_at_bits(four_bit_bytes: int, quantizable_numel: int, bits: float) -> int:
    """Bytes of weights with the quantizable ones at ``bits`` each, from the 4-bit size.

    ``four_bit_bytes`` holds those ``quantizable_numel`` elements at half a byte each (bitsandbytes'
    4-bit) and the rest in the load dtype; scales and zero points are not counted.
    """
    rest = four_bit_bytes - quantizable_numel * 0.5
    return int(rest + quantizable_numel * bits / 8)


def weight_sizes(layout: Layout) -> tuple[dict[str, int], int]:
    """Bytes of weights per ``"<dtype>"`` and ``"<4bit|8bit>/<dtype>"`` key (bfloat16, float16,
    float32), and the elements of the weights bitsandbytes would quantize.

    ``layout`` is the model as built in bf16 (:mod:`xpukit.planning.model.layout`): its tensors as
    transformers' ``compute_module_sizes`` counts them and the weights bitsandbytes would quantize.
    """
    as_built = sum(numel * element for _, numel, element, _ in layout.tensors)
    params = [name for name, _, _, _ in layout.tensors if name not in layout.buffers]
    fp32_for = {
        # transformers keeps `_keep_in_fp32_modules` in fp32 under fp16, and the strict list under any
        # 16-bit dtype (PreTrainedModel._get_dtype_plan).
        "float16": _matching(params, set(layout.keep_in_fp32) | set(layout.keep_in_fp32_strict)),
        "bfloat16": _matching(params, set(layout.keep_in_fp32_strict)),
        "float32": set(),
    }

    def total(dtype: str, float_bytes: int, names: frozenset[str], qbytes: float) -> int:
        size = 0.0
        for name, numel, element, floating in layout.tensors:
            if name in names:
                size += numel * qbytes
            elif name in layout.buffers or not floating:
                size += numel * element  # buffers (rotary inv_freq…) keep their own dtype
            elif name in fp32_for[dtype]:
                size += numel * 4
            else:
                size += numel * float_bytes
        return int(size)

    sizes: dict[str, int] = {}
    for dtype, float_bytes in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        sizes[dtype] = total(dtype, float_bytes, frozenset(), 0.0)
        for bits, (names, qbytes) in layout.quantized.items():
            sizes[f"{bits}/{dtype}"] = total(dtype, float_bytes, names, qbytes)
    if sizes["bfloat16"] != as_built:  # the model was built in bf16: the walk must add up the same
        logger.warning(
            "Size estimate differs from transformers' own: %d != %d bytes", sizes["bfloat16"], as_built
        )
    names4 = layout.quantized["4bit"][0]
    quantizable = sum(numel for name, numel, _, _ in layout.tensors if name in names4)
    return sizes, quantizable


def _matching(names: list[str], patterns: set[str]) -> set[str]:
    if not patterns:
        return set()
    # transformers matches these module names as substrings of parameter names.
    return {n for n in names if any(p in n for p in patterns)}
