"""The shape of a decoder-only transformer, read from its config (pure).

One reading of the config fields that the memory estimates depend on: the KV cache per token
(``planning/model/facts.py``) and the activations of a training step
(``planning/training/activation_memory.py``) both start from :class:`ModelShape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpukit.planning.model.families import shape_traits

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["ModelShape", "model_shape"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its activations depend on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3; planning/model/families.py)
    norms: int = 2  # RMSNorms per decoder layer on the hidden states (Gemma 2/3: 4, pre and post)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def model_shape(config: PreTrainedConfig) -> ModelShape | None:
    """The decoder shape from a transformers config (its text config), or ``None`` when it has none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(text, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    hidden = first("hidden_size", "n_embd", "d_model")
    layers = first("num_hidden_layers", "n_layer", "num_layers")
    heads = first("num_attention_heads", "n_head")
    vocab = first("vocab_size")
    if hidden is None or layers is None or heads is None or vocab is None:
        return None
    intermediate = first("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    traits = shape_traits(getattr(text, "model_type", ""))
    return ModelShape(
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=first("num_key_value_heads") or heads,
        head_dim=first("head_dim") or hidden // heads,
        vocab=vocab,
        qk_norm=traits.qk_norm,
        norms=traits.norms,
    )
