"""Weight sizes of a model built on the meta device, under every dtype and quantization.

The sizes are measured with transformers' own ``compute_module_sizes`` — the function
``device_map="auto"`` uses — so tied weights, buffers and the modules bitsandbytes leaves
unquantised are counted exactly as transformers counts them when it places the model
(docs/known-issues.md "Size estimates without weights: Qwen3-0.6B": Qwen3-0.6B bf16 1136.88 MiB,
nf4 506.88 MiB). For 4-bit/8-bit sizes the bitsandbytes quantizer's rules are applied without
importing bitsandbytes, which costs seconds and can reach the Hub at import (docs/known-issues.md
"bitsandbytes: import reaches the Hub on avx512_bf16 CPUs"). The rule is docs/planning.md "Size
estimate"; :func:`xpukit.planning.model.facts.model_facts` records the sizes in the model's facts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

__all__ = ["bytes_at_bits", "weight_sizes"]


def bytes_at_bits(four_bit_bytes: int, quantizable_numel: int, bits: float) -> int:
    """Bytes of weights with the quantizable ones at ``bits`` each, from the 4-bit size.

    ``four_bit_bytes`` holds those ``quantizable_numel`` elements at half a byte each (bitsandbytes'
    4-bit) and the rest in the load dtype; scales and zero points are not counted.
    """
    rest = four_bit_bytes - quantizable_numel * 0.5
    return int(rest + quantizable_numel * bits / 8)


class _TensorRecorder:
    """Stands in for the quantizer in ``compute_module_sizes(model, hf_quantizer=...)``.

    transformers walks the tensors it counts (parameters and buffers, tied weights once) and asks
    ``param_element_size(model, name, tensor)`` for each; this answers with the tensor's own size and
    records it, so one walk gives the sizes under every dtype and quantization rule.
    """

    def __init__(self) -> None:
        self.tensors: list[tuple[str, int, int, bool]] = []  # name, numel, element size, floating

    def param_element_size(self, model: Any, name: str, tensor: Any) -> float:
        self.tensors.append(
            (name, int(tensor.numel()), int(tensor.element_size()), bool(tensor.is_floating_point()))
        )
        return float(tensor.element_size())


def weight_sizes(model: PreTrainedModel, skip: tuple[str, ...] | None = None) -> tuple[dict[str, int], int]:
    """Bytes of weights per ``"<dtype>"`` and ``"<4bit|8bit>/<dtype>"`` key (bfloat16, float16,
    float32), and the elements of the weights bitsandbytes would quantize.

    ``model`` was built on the meta device in bf16; ``skip`` names modules kept unquantized beside
    the quantizer's defaults (a task head).
    """
    from transformers.integrations.accelerate import compute_module_sizes

    recorder = _TensorRecorder()
    as_built = int(compute_module_sizes(model, hf_quantizer=recorder)[0][""])
    buffers = {name for name, _ in model.named_buffers()}
    params = [name for name, _ in model.named_parameters()]
    fp32_for = {
        # transformers keeps `_keep_in_fp32_modules` in fp32 under fp16, and the strict list under any
        # 16-bit dtype (PreTrainedModel._get_dtype_plan).
        "float16": _matching(
            params, _patterns(model, "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
        ),
        "bfloat16": _matching(params, _patterns(model, "_keep_in_fp32_modules_strict")),
        "float32": set(),
    }
    quantized = {bits: _bnb_quantized_weights(model, bits, skip) for bits in ("4bit", "8bit")}

    def total(dtype: str, float_bytes: int, names: set[str], qbytes: float) -> int:
        size = 0.0
        for name, numel, element, floating in recorder.tensors:
            if name in names:
                size += numel * qbytes
            elif name in buffers or not floating:
                size += numel * element  # buffers (rotary inv_freq…) keep their own dtype
            elif name in fp32_for[dtype]:
                size += numel * 4
            else:
                size += numel * float_bytes
        return int(size)

    sizes: dict[str, int] = {}
    for dtype, float_bytes in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        sizes[dtype] = total(dtype, float_bytes, set(), 0.0)
        for bits, (names, qbytes) in quantized.items():
            sizes[f"{bits}/{dtype}"] = total(dtype, float_bytes, names, qbytes)
    if sizes["bfloat16"] != as_built:  # the model was built in bf16: the walk must add up the same
        logger.warning(
            "Size estimate differs from transformers' own: %d != %d bytes", sizes["bfloat16"], as_built
        )
    names4 = quantized["4bit"][0]
    quantizable = sum(numel for name, numel, _, _ in recorder.tensors if name in names4)
    return sizes, quantizable


def _bnb_quantized_weights(
    model: PreTrainedModel, bits: str, skip_modules: tuple[str, ...] | None = None
) -> tuple[set[str], float]:
    """Names of the weights bitsandbytes would quantize, and bytes per quantized element.

    Mirrors transformers' ``replace_with_bnb_linear`` (plain ``nn.Linear`` and ``Conv1D`` modules not
    matched by the quantizer's ``modules_to_not_convert``) and ``param_needs_quantization`` (weights,
    not biases), using the quantizer's own skip list and element size — without importing
    bitsandbytes (``transformers.integrations.bitsandbytes`` imports it at module load).
    """
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    extra = {"llm_int8_skip_modules": list(skip_modules)} if skip_modules else {}  # a task head: kept
    bnb = BitsAndBytesConfig(**{f"load_in_{bits}": True}, **extra)
    quantizer = AutoHfQuantizer.from_config(bnb, pre_quantized=False)
    skip = quantizer.get_modules_to_not_convert(model, bnb.llm_int8_skip_modules, model._keep_in_fp32_modules)
    names = set()
    for module_name, module in model.named_modules():
        if (type(module) is torch.nn.Linear or isinstance(module, Conv1D)) and should_convert_module(
            module_name, skip
        ):
            names.add(f"{module_name}.weight")
    # `quantized_element_size` appeared after transformers 5.17; bitsandbytes stores 4-bit weights
    # as two values per byte and 8-bit weights as one.
    element_size = getattr(quantizer, "quantized_element_size", 0.5 if bits == "4bit" else 1.0)
    return names, float(element_size)


def _patterns(model: PreTrainedModel, *attrs: str) -> set[str]:
    out: set[str] = set()
    for attr in attrs:
        out |= set(getattr(model, attr, None) or ())
    return out


def _matching(names: list[str], patterns: set[str]) -> set[str]:
    if not patterns:
        return set()
    # transformers matches these module names as substrings of parameter names.
    return {n for n in names if any(p in n for p in patterns)}
