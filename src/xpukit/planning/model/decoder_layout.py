"""The layout of a common decoder family's causal LM, written from its config alone (pure but for
reading transformers' source files).

The causal LMs of the families with layout rules in :mod:`xpukit.planning.model.families` (Llama,
Mistral, Qwen2, Qwen3, Gemma 3 text, Granite) share one structure: an embedding,
``num_hidden_layers`` decoder layers of q/k/v/o projections (Qwen3 and Gemma 3 add per-head q/k
RMSNorms), a gated MLP and two RMSNorms (Gemma 3: four), a final norm, a rotary embedding with two
float32 buffers (Gemma 3: two per layer type, and a scale buffer on its embedding), and an
``lm_head`` tied to the embedding or not. :func:`decoder_layout` writes the
:class:`~xpukit.planning.model.layout.Layout` a meta-device build of such a model has, with its
class attributes read from the installed modeling source (:mod:`xpukit.machine.library_source`),
so planning it imports no modeling code (docs/planning.md "Model facts from the config alone").
Anything else (another family or class, a pre-quantized or remote-code checkpoint, a RoPE type whose
buffers are sized otherwise, a source that does not state an attribute as a literal) returns
``None`` and the caller builds the model. tests/planning/model/test_decoder_layout.py holds the two
ways equal for every tiny architecture and built-in shape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, cast

from xpukit.machine.library_source import MISSING, ModuleSource, module_source, pretrained_defaults
from xpukit.planning.model.families import FAMILIES as ALL_FAMILIES
from xpukit.planning.model.families import LayoutRules, ModelFamily
from xpukit.planning.model.layout import Layout, Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = ["FAMILIES", "decoder_layout"]


# The families written here: those of xpukit.planning.model.families with layout rules.
FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {t: f for t, f in ALL_FAMILIES.items() if f.layout is not None}
)
# RoPE types whose inverse frequencies have ceil(int(head_dim * partial_rotary_factor) / 2) elements.
_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3"})
_SUPPORTS = ("_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn")


def decoder_layout(
    config: PreTrainedConfig, model_class: type[PreTrainedModel] | str | None = None
) -> Layout | None:
    """The layout of ``config``'s causal LM, or ``None`` when it is not one this module writes.

    Args:
        config: a transformers config (not modified).
        model_class: the class the load uses (``None``, ``"AutoModelForCausalLM"`` or the family's
            ``<Prefix>ForCausalLM`` name are written; any other is left to the meta-device build).
    """
    model_type = getattr(config, "model_type", None)
    entry = FAMILIES.get(str(model_type))
    family = None if entry is None else entry.layout
    if family is None:
        return None
    package = family.source or str(model_type)
    if type(config).__module__ != f"transformers.models.{package}.configuration_{package}":
        return None  # remote code: its own classes
    causal = f"{family.prefix}ForCausalLM"
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures[:1] not in ([], [causal]) or model_class not in (None, "AutoModelForCausalLM", causal):
        return None
    if getattr(config, "quantization_config", None) is not None or getattr(config, "auto_map", None):
        return None
    sizes = _sizes(config, family)
    source = module_source(f"models/{package}/modeling_{package}.py")
    if sizes is None or source is None:
        return None
    attrs = _class_attributes(source, family)
    kernels = _kernel_layers(source, family, str(getattr(config, family.activation, "")))
    if attrs is None or kernels is None:
        return None
    return _layout(config, family, sizes, attrs, kernels)


@dataclass(frozen=True, slots=True)
class _Sizes:
    """The config's sizes the layout is written from, and the rotary buffers: (name prefix, elements)
    per pair of inv_freq / original_inv_freq."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope: tuple[tuple[str, int], ...]


def _sizes(config: PreTrainedConfig, family: LayoutRules) -> _Sizes | None:
    def value(name: str) -> int | None:
        v = getattr(config, name, None)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    h, i, layers = value("hidden_size"), value("intermediate_size"), value("num_hidden_layers")
    heads, vocab = value("num_attention_heads"), value("vocab_size")
    tie = getattr(config, "tie_word_embeddings", None)
    if (
        h is None
        or i is None
        or layers is None
        or heads is None
        or vocab is None
        or not isinstance(tie, bool)
    ):
        return None
    d = value("head_dim") or h // heads
    rope = getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return None
    # The rotary buffers: (name prefix, elements) per pair of inv_freq / original_inv_freq.
    if family.rope_per_layer_type:
        types = getattr(config, "layer_types", None)
        if not isinstance(types, list) or not all(isinstance(rope.get(t), dict) for t in set(types)):
            return None
        groups = [(f"{t}_", rope[t]) for t in sorted(set(types))]
    else:
        groups = [("", rope)]
    buffers: list[tuple[str, int]] = []
    for prefix, params in groups:
        if params.get("rope_type", "default") not in _ROPE_TYPES:
            return None
        buffers.append((prefix, len(range(0, int(d * params.get("partial_rotary_factor", 1.0)), 2))))
    kv = value("num_key_value_heads") or heads
    return _Sizes(
        hidden=h,
        intermediate=i,
        layers=layers,
        heads=heads,
        kv_heads=kv,
        head_dim=d,
        vocab=vocab,
        rope=tuple(buffers),
    )


@dataclass(frozen=True, slots=True)
class _ClassAttributes:
    """The class attributes the layout needs, as the installed modeling source states them."""

    supports: dict[str, object]  # _supports_sdpa, _supports_flash_attn, _supports_flex_attn
    no_split_modules: frozenset[str]
    keep_in_fp32: frozenset[str]
    keep_in_fp32_strict: frozenset[str]


def _class_attributes(source: ModuleSource, family: LayoutRules) -> _ClassAttributes | None:
    defaults = pretrained_defaults()
    if defaults is None:
        return None

    def lookup(class_name: str, attr: str) -> object:
        found = source.attribute(class_name, attr)
        return defaults.attribute("PreTrainedModel", attr) if found is MISSING else found

    top, base = f"{family.prefix}ForCausalLM", family.prefix + family.base
    supports = {attr: lookup(top, attr) for attr in _SUPPORTS}
    # post_init gathers these lists from every PreTrainedModel in the tree (here the model and its base).
    lists: dict[str, frozenset[str]] = {}
    for attr in ("_no_split_modules", "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        values = [lookup(top, attr), lookup(base, attr)]
        if any(v is MISSING for v in values):
            return None
        # literals of the source: lists of module names, or None
        lists[attr] = frozenset(x for v in values for x in cast("Iterable[str]", v or ()))
    if any(v is MISSING for v in supports.values()):
        return None
    return _ClassAttributes(
        supports=supports,
        no_split_modules=lists["_no_split_modules"],
        keep_in_fp32=lists["_keep_in_fp32_modules"],
        keep_in_fp32_strict=lists["_keep_in_fp32_modules_strict"],
    )


def _kernel_layers(source: ModuleSource, family: LayoutRules, hidden_act: str) -> tuple[str, ...] | None:
    """The names of the Hub kernels the built model would register (none without `kernels`)."""
    from transformers.utils import is_kernels_available

    classes = ["RMSNorm", "RotaryEmbedding", "Attention", "MLP", "DecoderLayer", family.base, "ForCausalLM"]
    if family.scaled_embedding:
        classes.append(family.scaled_embedding)
    names: set[str] = set()
    for suffix in classes:
        found = source.kernel_names(family.prefix + suffix)
        if found is None:
            return None
        names |= found
    activations = module_source("activations.py")
    act_class = None if activations is None else activations.mapping_entry("ACT2CLS", hidden_act)
    if activations is None or act_class is None:
        return None
    if act_class in activations.classes:  # torch's own (nn.SiLU…) register none
        names |= activations.kernel_names(act_class) or set()
    return tuple(sorted(names)) if is_kernels_available() else ()


def _layout(
    config: PreTrainedConfig,
    family: LayoutRules,
    s: _Sizes,
    attrs: _ClassAttributes,
    kernels: tuple[str, ...],
) -> Layout:
    def bias(rule: str, key: str) -> bool:
        return rule == "always" or (rule == "config" and bool(getattr(config, key, False)))

    qkv, o_bias = bias(family.qkv_bias, "attention_bias"), bias(family.o_bias, "attention_bias")
    mlp = bias(family.mlp_bias, "mlp_bias")
    h, i, d, heads, kv = s.hidden, s.intermediate, s.head_dim, s.heads, s.kv_heads
    modules: list[str] = ["model", "model.embed_tokens", "model.layers"]
    linear: list[str] = []
    params: list[Tensor] = [("model.embed_tokens.weight", s.vocab * h, 2, True)]

    def add_linear(name: str, n_in: int, n_out: int, with_bias: bool) -> None:
        modules.append(name)
        linear.append(name)
        params.append((f"{name}.weight", n_in * n_out, 2, True))
        if with_bias:
            params.append((f"{name}.bias", n_out, 2, True))

    def add_norm(name: str, size: int) -> None:
        modules.append(name)
        params.append((f"{name}.weight", size, 2, True))

    for layer in range(s.layers):
        at = f"model.layers.{layer}"
        modules += [at, f"{at}.self_attn"]
        add_linear(f"{at}.self_attn.q_proj", h, heads * d, qkv)
        add_linear(f"{at}.self_attn.k_proj", h, kv * d, qkv)
        add_linear(f"{at}.self_attn.v_proj", h, kv * d, qkv)
        add_linear(f"{at}.self_attn.o_proj", heads * d, h, o_bias)
        if family.qk_norm:
            add_norm(f"{at}.self_attn.q_norm", d)
            add_norm(f"{at}.self_attn.k_norm", d)
        modules.append(f"{at}.mlp")
        add_linear(f"{at}.mlp.gate_proj", h, i, mlp)
        add_linear(f"{at}.mlp.up_proj", h, i, mlp)
        add_linear(f"{at}.mlp.down_proj", i, h, mlp)
        modules.append(f"{at}.mlp.act_fn")
        add_norm(f"{at}.input_layernorm", h)
        add_norm(f"{at}.post_attention_layernorm", h)
        if family.feedforward_norms:
            add_norm(f"{at}.pre_feedforward_layernorm", h)
            add_norm(f"{at}.post_feedforward_layernorm", h)
    add_norm("model.norm", h)
    modules += ["model.rotary_emb", "lm_head"]
    linear.append("lm_head")
    tied = bool(config.tie_word_embeddings)
    if not tied:
        params.append(("lm_head.weight", s.vocab * h, 2, True))
    # The scale is a 0-d tensor made in the build's default dtype (bf16); the rotary buffers float32.
    buffers: list[Tensor] = (
        [("model.embed_tokens.embed_scale", 1, 2, True)] if family.scaled_embedding else []
    )
    for prefix, numel in s.rope:
        buffers += [
            (f"model.rotary_emb.{prefix}{b}", numel, 4, True) for b in ("inv_freq", "original_inv_freq")
        ]
    # transformers' get_keys_to_not_convert: tied weights, the last parameter, the output embedding;
    # then the quantizer adds the keep-in-fp32 modules.
    skip = {"lm_head", params[-1][0].removesuffix(".weight")}
    if tied:
        skip |= {"model.embed_tokens"}
    skip |= attrs.keep_in_fp32
    quantized = frozenset(f"{name}.weight" for name in linear if _should_convert(name, skip))
    return Layout(
        architecture=f"{family.prefix}ForCausalLM",
        modules=tuple(modules),
        linear_modules=tuple(linear),
        tensors=tuple(params + buffers),
        buffers=frozenset(name for name, *_ in buffers),
        num_parameters=sum(numel for _, numel, _, _ in params),
        # bitsandbytes stores 4-bit weights two to a byte and 8-bit weights one to a byte.
        quantized={"4bit": (quantized, 0.5), "8bit": (quantized, 1.0)},
        keep_in_fp32=attrs.keep_in_fp32,
        keep_in_fp32_strict=attrs.keep_in_fp32_strict,
        supports_sdpa=bool(attrs.supports["_supports_sdpa"]),
        supports_flash_attn=bool(attrs.supports["_supports_flash_attn"]),
        supports_flex_attn=bool(attrs.supports["_supports_flex_attn"]),
        no_split_modules=tuple(sorted(attrs.no_split_modules)),
        kernel_layers=kernels,
    )


_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def _should_convert(full_name: str, patterns: set[str]) -> bool:
    """transformers' ``should_convert_module`` (quantizers_utils), whose package imports torchao.

    A pattern skips a module when it matches from the start up to a module boundary (as a regex) or
    ends its name.
    """
    return not any(
        re.match(rf"(?:{key}){_BOUNDARY}", full_name) or full_name.endswith(key) for key in patterns
    )
