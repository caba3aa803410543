"""The layout of a model: its modules, tensors and class attributes, as the size and LoRA facts need them.

A :class:`Layout` is plain data. :func:`layout_of` reads it from a model built on the ``meta`` device
(transformers' own ``compute_module_sizes`` walk and bitsandbytes quantizer rules);
:mod:`xpukit.planning.model.decoder_layout` writes the same layout from the config alone for the
common decoder families, so planning them imports no modeling code (docs/planning.md "Model facts
from the config alone"). Every fact in :class:`xpukit.planning.model.facts.ModelFacts` that depends
on the model's structure is computed from a layout, whichever way it was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = ["Layout", "layout_of"]

Tensor = tuple[str, int, int, bool]  # name, elements, bytes per element (as built in bf16), floating


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A model's structure as the planner needs it.

    Attributes:
        architecture: the model class name (``Qwen3ForCausalLM``).
        modules: every module's full name (``named_modules``, the root left out), in order.
        linear_modules: full names of the ``nn.Linear`` / ``Conv1D`` modules.
        tensors: the tensors transformers' ``compute_module_sizes`` counts (parameters, then buffers,
            tied weights once), as built in bfloat16.
        buffers: names of the buffers among them.
        num_parameters: parameters, tied ones counted once.
        quantized: per ``"4bit"``/``"8bit"``: the weights bitsandbytes would quantize and the bytes
            per quantized element.
        keep_in_fp32: the model's ``_keep_in_fp32_modules``; ``keep_in_fp32_strict`` its strict list.
        supports_sdpa, supports_flash_attn, supports_flex_attn: the class's attention support.
        no_split_modules: module classes ``device_map="auto"`` must keep on one device (sorted).
        kernel_layers: layer/function names the model registers for Hub kernels (sorted).
    """

    architecture: str
    modules: tuple[str, ...] = field(repr=False)
    linear_modules: tuple[str, ...] = field(repr=False)
    tensors: tuple[Tensor, ...] = field(repr=False)
    buffers: frozenset[str] = field(repr=False)
    num_parameters: int
    quantized: dict[str, tuple[frozenset[str], float]] = field(repr=False)
    keep_in_fp32: frozenset[str] = frozenset()
    keep_in_fp32_strict: frozenset[str] = frozenset()
    supports_sdpa: bool = False
    supports_flash_attn: bool = False
    supports_flex_attn: bool = False
    no_split_modules: tuple[str, ...] = ()
    kernel_layers: tuple[str, ...] = ()

    @property
    def linear_layers(self) -> tuple[str, ...]:
        """Distinct last name parts of the linear modules (what LoRA ``target_modules`` can name)."""
        return tuple(sorted({name.rsplit(".", 1)[-1] for name in self.linear_modules}))


class _TensorRecorder:
    """Stands in for the quantizer in ``compute_module_sizes(model, hf_quantizer=...)``.

    transformers walks the tensors it counts (parameters and buffers, tied weights once) and asks
    ``param_element_size(model, name, tensor)`` for each; this answers with the tensor's own size and
    records it, so one walk gives the sizes under every dtype and quantization rule.
    """

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def param_element_size(self, model: torch.nn.Module, name: str, tensor: torch.Tensor) -> float:
        self.tensors.append(
            (name, int(tensor.numel()), int(tensor.element_size()), bool(tensor.is_floating_point()))
        )
        return float(tensor.element_size())


def layout_of(model: PreTrainedModel, skip: tuple[str, ...] | None = None) -> Layout:
    """The layout of a model built on the meta device in bfloat16.

    ``skip`` names modules bitsandbytes keeps unquantized beside the quantizer's defaults (a task head).
    """
    import torch
    from transformers.integrations.accelerate import compute_module_sizes

    recorder = _TensorRecorder()
    compute_module_sizes(model, hf_quantizer=recorder)
    linear = tuple(
        name
        for name, module in model.named_modules()
        if name and (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D")
    )
    return Layout(
        architecture=type(model).__name__,
        modules=tuple(name for name, _ in model.named_modules() if name),
        linear_modules=linear,
        tensors=tuple(recorder.tensors),
        buffers=frozenset(name for name, _ in model.named_buffers()),
        num_parameters=sum(p.numel() for p in model.parameters()),
        quantized={bits: _bnb_quantized_weights(model, bits, skip) for bits in ("4bit", "8bit")},
        keep_in_fp32=frozenset(getattr(model, "_keep_in_fp32_modules", None) or ()),
        keep_in_fp32_strict=frozenset(getattr(model, "_keep_in_fp32_modules_strict", None) or ()),
        supports_sdpa=bool(getattr(model, "_supports_sdpa", False)),
        supports_flash_attn=bool(getattr(model, "_supports_flash_attn", False)),
        supports_flex_attn=bool(getattr(model, "_supports_flex_attn", False)),
        no_split_modules=tuple(sorted(getattr(model, "_no_split_modules", None) or ())),
        kernel_layers=_kernel_layers(model),
    )


def _bnb_quantized_weights(
    model: PreTrainedModel, bits: str, skip_modules: tuple[str, ...] | None = None
) -> tuple[frozenset[str], float]:
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
    return frozenset(names), float(element_size)


def _kernel_layers(model: PreTrainedModel) -> tuple[str, ...]:
    # Classes decorated with use_kernel_forward_from_hub carry `kernel_layer_name`; functions
    # registered with use_kernel_func_from_hub live in a module's `_kernel_funcs`.
    names: set[str] = set()
    for module in model.modules():
        layer = getattr(type(module), "kernel_layer_name", None)
        if isinstance(layer, str):
            names.add(layer)
        funcs = getattr(module, "_kernel_funcs", None)
        if isinstance(funcs, dict):
            names.update(str(k) for k in funcs)
    return tuple(sorted(names))
