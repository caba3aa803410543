"""The model families xpukit knows, one entry each: everything it relies on about a family, in one place.

Each :class:`ModelFamily` says, for one transformers ``model_type``:

- ``layout``: how its causal LM is written from the config alone (:class:`LayoutRules`, read by
  :mod:`xpukit.planning.model.decoder_layout`; ``None``: the model is built on the meta device);
- ``shape``: what its decoder block adds to the activation and cache sizes (:class:`ShapeTraits`,
  read by :mod:`xpukit.planning.model.shape`);
- ``attention`` / ``mlp``: the projections its blocks have, one of the block shapes the fused LoRA
  path computes (:data:`SEPARATE_QKV`, :data:`STORED_QKV`, :data:`SEPARATE_GATE_UP`,
  :data:`STORED_GATE_UP`; read by ``planning/training/fused.py``, which matches any model by these
  names, so the entry records what the family's blocks are, and a test holds it true);
- ``tiny``: the tiny random-weight model ``xpukit.demo.tiny`` builds of it (:class:`TinyShape`);
- ``gguf``: the llama.cpp architecture a GGUF export writes it as (:class:`GgufFamily`, read by
  :mod:`xpukit.planning.model.gguf_export`; ``None``: not exported);
- ``no_liger_loss``: why liger-kernel's fused loss does not run for the family (read by the training
  plan, ``planning/training/fit.py``; ``None``: it runs where liger runs).

Pure data: nothing here imports torch or transformers. CONTRIBUTING.md "A new model family" says
how to add one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "SEPARATE_GATE_UP",
    "SEPARATE_QKV",
    "STORED_GATE_UP",
    "STORED_QKV",
    "GgufFamily",
    "LayoutRules",
    "ModelFamily",
    "ShapeTraits",
    "TinyShape",
    "family",
    "shape_traits",
]

# The projections of the block shapes the fused LoRA path computes (docs/planning.md "Fused LoRA").
SEPARATE_QKV = ("q_proj", "k_proj", "v_proj", "o_proj")
STORED_QKV = ("qkv_proj", "o_proj")
SEPARATE_GATE_UP = ("gate_proj", "up_proj", "down_proj")
STORED_GATE_UP = ("gate_up_proj", "down_proj")

Bias = Literal["config", "always", "never"]


@dataclass(frozen=True, slots=True)
class LayoutRules:
    """How :mod:`~xpukit.planning.model.decoder_layout` writes the family's causal LM from its config.

    Biases: ``"config"`` where the config's ``attention_bias`` / ``mlp_bias`` decides, ``"always"``,
    ``"never"``.
    """

    prefix: str  # class name prefix: Qwen3 -> Qwen3ForCausalLM, Qwen3RMSNorm…
    qk_norm: bool  # per-head RMSNorm on q and k
    qkv_bias: Bias
    o_bias: Bias
    mlp_bias: Bias
    source: str = ""  # the modeling file's package under transformers.models (default: model_type)
    base: str = "Model"  # the base model's class name after the prefix
    scaled_embedding: str = ""  # an embedding class with an `embed_scale` buffer (Gemma 3)
    feedforward_norms: bool = False  # RMSNorms before and after the MLP too (Gemma 2/3)
    rope_per_layer_type: bool = False  # one pair of rotary buffers per layer type (Gemma 3)
    activation: str = "hidden_act"  # the config field the MLP's activation is read from


@dataclass(frozen=True, slots=True)
class ShapeTraits:
    """What a decoder block of the family adds to :class:`~xpukit.planning.model.shape.ModelShape`.

    ``prefix``: the model types these traits cover (those that start with it: ``qwen3`` covers
    ``qwen3_moe``, ``gemma3`` covers Gemma 3's multimodal and text configs).
    """

    prefix: str
    qk_norm: bool = False  # per-head RMSNorm on q and k
    norms: int = 2  # RMSNorms per decoder layer on the hidden states


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyShape:
    """The tiny model ``xpukit.demo.tiny`` builds of the family.

    ``config``: the config fields of this family; with ``decoder=True`` they go over the sizes every
    tiny decoder shares (``xpukit.demo.tiny``), else they are the whole config.
    """

    name: str  # the architecture's name in xpukit.demo.tiny.ARCHITECTURES
    config_class: str  # name in the `transformers` namespace
    model_class: str
    config: Mapping[str, Any]
    decoder: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class GgufFamily:
    """How one transformers family becomes one llama.cpp architecture (docs/export.md)."""

    arch: str  # llama.cpp's general.architecture
    label: str
    permute_qk: bool = False  # the llama architecture's rope pairs rows differently: q/k rows permuted
    norm_shift: float = 0.0  # Gemma stores norm weights as w - 1; llama.cpp wants w
    rope_types: tuple[str, ...] = ("default",)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """Everything xpukit relies on about one model family (one config ``model_type``)."""

    model_type: str
    label: str
    layout: LayoutRules | None = None
    shape: ShapeTraits | None = None
    attention: tuple[str, ...] | None = None  # the projections of its attention block
    mlp: tuple[str, ...] | None = None  # of its MLP block (None: experts, or another shape)
    tiny: TinyShape | None = None
    gguf: GgufFamily | None = None
    # Why liger-kernel's fused loss refuses the family (its model patch raises), or None where it runs.
    no_liger_loss: str | None = None


def _rows(*families: ModelFamily) -> Mapping[str, ModelFamily]:
    return MappingProxyType({f.model_type: f for f in families})


_TIED = {"head_dim": 16, "tie_word_embeddings": True}
_UNTIED = {"head_dim": 16, "tie_word_embeddings": False}

# In the order users meet them (error messages list them in this order).
FAMILIES: Mapping[str, ModelFamily] = _rows(
    ModelFamily(
        model_type="llama",
        label="Llama",
        layout=LayoutRules("Llama", False, "config", "config", "config"),
        attention=SEPARATE_QKV,
        mlp=SEPARATE_GATE_UP,
        tiny=TinyShape(
            name="llama", config_class="LlamaConfig", model_class="LlamaForCausalLM", config=_UNTIED
        ),
        gguf=GgufFamily(
            arch="llama", label="Llama", permute_qk=True, rope_types=("default", "llama3", "linear")
        ),
    ),
    ModelFamily(
        model_type="mistral",
        label="Mistral",
        layout=LayoutRules("Mistral", False, "never", "never", "never"),
        attention=SEPARATE_QKV,
        mlp=SEPARATE_GATE_UP,
        tiny=TinyShape(
            name="mistral", config_class="MistralConfig", model_class="MistralForCausalLM", config=_UNTIED
        ),
        gguf=GgufFamily(arch="llama", label="Mistral", permute_qk=True, rope_types=("default",)),
    ),
    ModelFamily(
        model_type="qwen2",
        label="Qwen2",
        layout=LayoutRules("Qwen2", False, "always", "never", "never"),
        attention=SEPARATE_QKV,
        mlp=SEPARATE_GATE_UP,
        gguf=GgufFamily(arch="qwen2", label="Qwen2", rope_types=("default",)),
    ),
    ModelFamily(
        model_type="qwen3",
        label="Qwen3",
        layout=LayoutRules("Qwen3", True, "config", "config", "never"),
        shape=ShapeTraits("qwen3", qk_norm=True),
        attention=SEPARATE_QKV,
        mlp=SEPARATE_GATE_UP,
        tiny=TinyShape(
            name="qwen3", config_class="Qwen3Config", model_class="Qwen3ForCausalLM", config=_TIED
        ),
        gguf=GgufFamily(arch="qwen3", label="Qwen3", rope_types=("default",)),
    ),
    # Gemma 3's text model (Gemma 3 1B, and the tiny "gemma" architecture).
    ModelFamily(
        model_type="gemma3_text",
        label="Gemma 3",
        layout=LayoutRules(
            "Gemma3",
            True,
            "config",
            "config",
            "never",
            source="gemma3",
            base="TextModel",
            scaled_embedding="TextScaledWordEmbedding",
            feedforward_norms=True,
            rope_per_layer_type=True,
            activation="hidden_activation",
        ),
        shape=ShapeTraits("gemma3", qk_norm=True, norms=4),
        attention=SEPARATE_QKV,
        mlp=SEPARATE_GATE_UP,
        # Gemma 2 soft-caps attention logits, which SDPA cannot do; Gemma 3 dropped that. One
        # sliding-window layer (window 16, shorter than a test prompt) and one global layer, so both
        # mask paths run.
        tiny=TinyShape(
            name="gemma",
            config_class="Gemma3TextConfig",
            model_class="Gemma3ForCausalLM",
            config={
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"],
                "tie_word_embeddings": True,
            },
        ),
        gguf=GgufFamily(arch="gemma3", label="Gemma 3", norm_shift=1.0, rope_types=("default", "linear")),
    ),
    # Phi-3 fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; head_dim is derived.
    ModelFamily(
        model_type="phi3",
        label="Phi-3",
        attention=STORED_QKV,
        mlp=STORED_GATE_UP,
        tiny=TinyShape(
            name="phi3",
            config_class="Phi3Config",
            model_class="Phi3ForCausalLM",
            config={"original_max_position_embeddings": 512, "tie_word_embeddings": False},
        ),
    ),
    # GPT-2: no GQA, learned positions, Conv1D projections (peft treats them specially).
    ModelFamily(
        model_type="gpt2",
        label="GPT-2",
        tiny=TinyShape(
            name="gpt2",
            config_class="GPT2Config",
            model_class="GPT2LMHeadModel",
            config={"vocab_size": 1024, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
            decoder=False,
        ),
    ),
    # Families whose only fact here is their block's norms (their models are built on the meta device).
    ModelFamily(model_type="gemma2", label="Gemma 2", shape=ShapeTraits("gemma2", norms=4)),
    ModelFamily(model_type="olmo2", label="OLMo 2", shape=ShapeTraits("olmo2", qk_norm=True)),
    # IBM Granite (3.x dense): Llama's block, scaled by four config multipliers (embedding, residual,
    # attention, logits) that change no weight's shape; the tiny one sets them as Granite 3 does
    # (attention scaled by 1/head_dim, logits divided by 8).
    ModelFamily(
        model_type="granite",
        label="Granite",
        layout=LayoutRules("Granite", False, "config", "config", "config"),
        attention=SEPARATE_QKV,
        mlp=SEPARATE_GATE_UP,
        # liger-kernel 0.8.5's apply_liger_kernel_to_granite raises NotImplementedError for its fused
        # linear cross-entropy (the logits are divided by logits_scaling after lm_head)
        no_liger_loss="liger-kernel has no fused loss for Granite (it scales the logits after lm_head)",
        tiny=TinyShape(
            name="granite",
            config_class="GraniteConfig",
            model_class="GraniteForCausalLM",
            config={
                **_TIED,
                "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22,
                "attention_multiplier": 0.0625,
                "logits_scaling": 8.0,
            },
        ),
    ),
)

_PLAIN = ShapeTraits("")


def family(model_type: object) -> ModelFamily | None:
    """The family of a config's ``model_type`` (exactly), or ``None``."""
    return FAMILIES.get(str(model_type))


def shape_traits(model_type: object) -> ShapeTraits:
    """The block traits of the first family whose :attr:`ShapeTraits.prefix` starts ``model_type``;
    plain (no q/k norm, two norms) for any other."""
    name = str(model_type)
    return next(
        (f.shape for f in FAMILIES.values() if f.shape is not None and name.startswith(f.shape.prefix)),
        _PLAIN,
    )
