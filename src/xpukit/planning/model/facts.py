"""Facts about a model, read from its config alone: architecture, attention support and weight sizes.

:func:`model_facts` reads the model's layout (:mod:`xpukit.planning.model.layout`) and records what
the planner needs in a frozen :class:`ModelFacts`: the class, the attention implementations it
supports, its module and linear-layer names, a pre-quantized checkpoint's method and bits, and the
weight sizes under every dtype and quantization, measured by :mod:`xpukit.planning.model.weight_sizes`.
The layout of a Llama, Mistral, Qwen2, Qwen3 or Gemma 3 causal LM is written from the config
(:mod:`xpukit.planning.model.decoder_layout`, no modeling code imported); any other model is built
on the ``meta`` device (no memory, no weights; :func:`xpukit.planning.model.classes.build_meta_model`).

Real-size shapes to plan with, offline, are in :mod:`xpukit.planning.model.reference_models`.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.model.classes import (
    ClassFacts,
    auto_class_for,
    build_meta_model,
    choose_model_class,
    class_facts,
)
from xpukit.planning.model.decoder_layout import decoder_layout
from xpukit.planning.model.layout import Layout, layout_of
from xpukit.planning.model.shape import model_shape
from xpukit.planning.model.weight_sizes import bytes_at_bits, weight_sizes

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = ["SIZE_KEYS", "ModelFacts", "auto_class_for", "model_facts", "model_layout", "quantized_bits"]

# Every (dtype, quantization) pair the planner may ask for; sizes are computed for all of them.
SIZE_KEYS = (
    "bfloat16",
    "float16",
    "float32",
    "4bit/bfloat16",
    "4bit/float16",
    "4bit/float32",
    "8bit/bfloat16",
    "8bit/float16",
    "8bit/float32",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFacts:
    """What the planner needs to know about a model, read from its config (never its weights).

    Attributes:
        name: the Hub id, local path or config name the facts were read from.
        model_type: the config's ``model_type`` (``qwen3``, ``llama``…).
        architecture: the model class that will be built (``Qwen3ForCausalLM``).
        auto_class: the transformers Auto class that loads it (``AutoModelForCausalLM``).
        num_parameters: parameters, tied ones counted once.
        weight_bytes: bytes of weights (parameters and buffers) per :data:`SIZE_KEYS` entry.
        kv_bytes_per_token: KV-cache bytes per token at 16-bit (``None`` when the config lacks the
            attention shape).
        max_positions: the context length the config allows, when it says.
        supports_sdpa: the architecture implements SDPA attention.
        supports_flash_attn: the architecture implements flash-attention (packages or Hub kernels).
        supports_flex_attn: the architecture implements flex attention.
        no_split_modules: module classes ``device_map="auto"`` must keep on one device.
        kernel_layers: layer/function names the model registers for Hub kernels (``use_kernels``).
        pre_quantized: the quantization method of a pre-quantized checkpoint, else ``None``.
        pre_quantized_bits: bits per quantized weight of a pre-quantized checkpoint, when its
            ``quantization_config`` says (``load_in_4bit`` → 4, GPTQ/AWQ ``bits``); its sizes under
            every dtype are then the quantized sizes.
        quantizable_numel: elements of the weights a weight-only quantizer replaces (the linear
            layers bitsandbytes would convert); sizes at other bit widths derive from it.
        linear_layers: distinct names (last path part) of the linear layers, what LoRA
            ``target_modules`` can name.
        module_names: every module's full name, for matching LoRA targets before loading.
        config_dtype: the dtype the checkpoint declares, when it does.
        sizing: how the sizes were computed (stated in plans).
        head_modules: the task head of a classification class (trained in full with LoRA).
        quantization_skip: modules bitsandbytes leaves unquantized beside its defaults (the head).
        language_model: a VLM's language model module path; ``language_linear_layers`` its linear
            layer names (LoRA's default targets there; docs/planning.md "Model class (`model_class=`)").
        mlp_activation: the (text) config's MLP activation name (``hidden_activation`` where it is
            set, as Gemma 2/3 name it, else ``hidden_act``), when it says.
        num_experts: experts per mixture-of-experts block (``num_experts`` / ``num_local_experts``),
            0 for a dense model.
    """

    name: str
    model_type: str
    architecture: str
    auto_class: str
    num_parameters: int
    weight_bytes: dict[str, int]
    kv_bytes_per_token: int | None = None
    max_positions: int | None = None
    supports_sdpa: bool = True
    supports_flash_attn: bool = False
    supports_flex_attn: bool = False
    no_split_modules: tuple[str, ...] = ()
    kernel_layers: tuple[str, ...] = ()
    pre_quantized: str | None = None
    pre_quantized_bits: int | None = None
    quantizable_numel: int = 0
    linear_layers: tuple[str, ...] = ()
    module_names: tuple[str, ...] = field(default=(), repr=False)
    config_dtype: str | None = None
    sizing: str = "transformers compute_module_sizes on the meta device"
    notes: tuple[str, ...] = field(default=())
    head_modules: tuple[str, ...] = ()
    quantization_skip: tuple[str, ...] = ()
    language_model: str | None = None
    language_linear_layers: tuple[str, ...] = ()
    mlp_activation: str | None = None
    num_experts: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_bytes", dict(self.weight_bytes))

    def weights(self, dtype: str, quantization: str | None = None) -> int:
        """Bytes of weights when loaded in ``dtype``, optionally quantized (``4bit``/``8bit``)."""
        key = f"{quantization}/{dtype}" if quantization else dtype
        try:
            return self.weight_bytes[key]
        except KeyError:
            raise InvalidRequestError(
                f"No size for dtype={dtype!r}, quantization={quantization!r}."
            ) from None

    def weights_at_bits(self, dtype: str, bits: float) -> int:
        """Bytes of weights with the quantizable weights at ``bits`` each and the rest in ``dtype``.

        An estimate for weight-only quantizers other than bitsandbytes (GPTQ, AWQ, quanto, torchao):
        their scales and zero points (about 3 % at group size 128) are not counted.
        """
        return bytes_at_bits(self.weights(dtype, "4bit"), self.quantizable_numel, bits)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "name": self.name,
            "model_type": self.model_type,
            "architecture": self.architecture,
            "auto_class": self.auto_class,
            "num_parameters": self.num_parameters,
            "weight_bytes": dict(self.weight_bytes),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_positions": self.max_positions,
            "supports_sdpa": self.supports_sdpa,
            "supports_flash_attn": self.supports_flash_attn,
            "supports_flex_attn": self.supports_flex_attn,
            "no_split_modules": list(self.no_split_modules),
            "kernel_layers": list(self.kernel_layers),
            "pre_quantized": self.pre_quantized,
            "pre_quantized_bits": self.pre_quantized_bits,
            "quantizable_numel": self.quantizable_numel,
            "linear_layers": list(self.linear_layers),
            "config_dtype": self.config_dtype,
            "sizing": self.sizing,
            "notes": list(self.notes),
            "head_modules": list(self.head_modules),
            "language_model": self.language_model,
            "mlp_activation": self.mlp_activation,
            "num_experts": self.num_experts,
        }


# Facts are a pure function of the config: the last few are kept, keyed by the config's full JSON,
# so loading the same model again in a process skips the meta-device build (about 8 ms for a tiny
# model, 40 ms for an 8B shape).
_CACHE: OrderedDict[str, ModelFacts] = OrderedDict()
_CACHE_SIZE = 8


def model_facts(
    config: PreTrainedConfig,
    *,
    name: str | None = None,
    trust_remote_code: bool = False,
    cache: bool = True,
    model_class: type[PreTrainedModel] | str | None = None,
) -> ModelFacts:
    """Read a model's facts from its config by building it on the meta device.

    Args:
        config: the model's config (it is not modified).
        name: what to call the model in plans (default: the config's ``_name_or_path``).
        trust_remote_code: passed to the Auto class for configs whose model code lives in the repo.
        cache: reuse the facts of an identical config read before in this process.
        model_class: the class (or name) to build; default: the one the config's ``architectures``
            names (:func:`xpukit.planning.model.classes.choose_model_class`).

    Raises:
        InvalidRequestError: no transformers Auto class can build this config.
    """
    kind = f"{type(config).__module__}.{type(config).__name__}"
    built = model_class if model_class is None or isinstance(model_class, str) else id(model_class)
    key = f"{kind}:{trust_remote_code}:{built}:{config.to_json_string(use_diff=False)}"
    if cache and key in _CACHE:
        _CACHE.move_to_end(key)
        facts = _CACHE[key]
        wanted = name or str(getattr(config, "_name_or_path", "") or "<config>")
        return facts if facts.name == wanted else replace(facts, name=wanted)
    facts = _read_facts(config, name=name, trust_remote_code=trust_remote_code, model_class=model_class)
    _CACHE[key] = facts
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return facts


def model_layout(
    config: PreTrainedConfig,
    *,
    trust_remote_code: bool = False,
    model_class: type[PreTrainedModel] | str | None = None,
) -> tuple[str, Layout, ClassFacts]:
    """The Auto class that loads the model, its layout, and the facts that follow from its class.

    Written from the config for the decoder families :mod:`xpukit.planning.model.decoder_layout`
    knows (no modeling code imported), else read from a build on the meta device.
    """
    choice = choose_model_class(config, model_class)
    auto_name = choice.kind.auto_class if choice.kind is not None else choice.name
    if auto_name == "AutoModelForCausalLM" and choice.cls is None:
        layout = decoder_layout(config, model_class)
        if layout is not None:
            return auto_name, layout, {}  # a causal LM: no task head, no language model inside
    auto_name, model = build_meta_model(config, model_class, trust_remote_code=trust_remote_code)
    by_class = class_facts(model, auto_name)
    return auto_name, layout_of(model, by_class.get("quantization_skip")), by_class


def _read_facts(
    config: PreTrainedConfig,
    *,
    name: str | None,
    trust_remote_code: bool,
    model_class: type[PreTrainedModel] | str | None,
) -> ModelFacts:
    auto_name, layout, by_class = model_layout(
        config, trust_remote_code=trust_remote_code, model_class=model_class
    )
    weight_bytes, quantizable = weight_sizes(layout)
    text = config.get_text_config()
    quant = getattr(config, "quantization_config", None)
    pre_quantized = None
    pre_bits = None
    notes: list[str] = []
    if quant is not None:
        method = (
            quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        )
        pre_quantized = str(getattr(method, "value", method) or "unknown")
        pre_bits = quantized_bits(quant)
        if pre_bits is not None:
            # The checkpoint loads quantized whatever dtype is asked: every size is the quantized one.
            for dtype in ("bfloat16", "float16", "float32"):
                weight_bytes[dtype] = bytes_at_bits(weight_bytes[f"4bit/{dtype}"], quantizable, pre_bits)
            notes.append(
                f"pre-quantized checkpoint ({pre_quantized}, {pre_bits}-bit): sized with its linear "
                f"weights at {pre_bits} bits (scales and zero points not counted)"
            )
        else:
            notes.append(
                f"pre-quantized checkpoint ({pre_quantized}, bit width not stated): sizes are for "
                "unquantized weights (an upper bound)"
            )
    config_dtype = getattr(config, "dtype", None)
    return ModelFacts(
        name=name or str(getattr(config, "_name_or_path", "") or "<config>"),
        model_type=str(getattr(config, "model_type", "") or "unknown"),
        architecture=layout.architecture,
        auto_class=auto_name,
        num_parameters=layout.num_parameters,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=_kv_bytes_per_token(config),
        max_positions=getattr(text, "max_position_embeddings", None),
        supports_sdpa=layout.supports_sdpa,
        supports_flash_attn=layout.supports_flash_attn,
        supports_flex_attn=layout.supports_flex_attn,
        no_split_modules=layout.no_split_modules,
        kernel_layers=layout.kernel_layers,
        pre_quantized=pre_quantized,
        pre_quantized_bits=pre_bits,
        quantizable_numel=quantizable,
        linear_layers=layout.linear_layers,
        module_names=layout.modules,
        config_dtype=str(config_dtype).removeprefix("torch.") if config_dtype is not None else None,
        notes=tuple(notes),
        mlp_activation=_mlp_activation(text),
        num_experts=int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0),
        **by_class,
    )


def quantized_bits(quant: object) -> int | None:
    """Bits per weight a quantization config states (dict or object), else ``None``.

    bitsandbytes: ``load_in_4bit`` / ``load_in_8bit``; GPTQ, AWQ, AutoRound, HQQ…: ``bits``;
    quanto: ``weights`` ``"int8"``/``"int4"``/``"int2"``/``"float8"``; torchao: its config's class
    (``Int4WeightOnlyConfig`` → 4, ``Int8WeightOnlyConfig`` → 8).
    """

    def get(key: str) -> object:
        return quant.get(key) if isinstance(quant, dict) else getattr(quant, key, None)

    if get("load_in_4bit"):
        return 4
    if get("load_in_8bit"):
        return 8
    bits = get("bits")
    if isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 16:
        return bits
    torchao = _torchao_bits(get("quant_type"))
    if torchao is not None:
        return torchao
    weights = get("weights")
    if isinstance(weights, str):
        match = re.fullmatch(r"(?:int|float)(\d+)", weights.strip().lower())
        if match and 1 <= int(match[1]) <= 16:
            return int(match[1])
    return None


def _torchao_bits(quant_type: object) -> int | None:
    """The bits of a torchao config's weights, from its class name (``Int4WeightOnlyConfig`` → 4),
    as transformers' torchao quantizer reads them; ``quant_type`` as config.json holds it
    (``{"default": {"_type": "Int4WeightOnlyConfig", ...}}``) or as an object."""
    if isinstance(quant_type, dict):
        names = [str(v.get("_type")) for v in quant_type.values() if isinstance(v, dict)]
    elif quant_type is not None and not isinstance(quant_type, str | int | float):
        names = [type(quant_type).__name__]
    else:
        names = [str(quant_type)] if isinstance(quant_type, str) else []
    found = {int(m[1]) for n in names if (m := re.search(r"int(\d)weight", n.lower()))}
    return found.pop() if len(found) == 1 else None


def _mlp_activation(text: PreTrainedConfig) -> str | None:
    act = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None)
    return act if isinstance(act, str) else None


def _kv_bytes_per_token(config: PreTrainedConfig) -> int | None:
    """K and V of every layer, 2 bytes each at 16-bit; from the one reading of the decoder's shape."""
    shape = model_shape(config)
    return None if shape is None else 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
