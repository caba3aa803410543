"""Shapes of real models, built offline, for planning without the Hub.

``xpukit plan qwen3-8b --assume arc-b580`` and the planner's tests use them. The values are copied
from each model's ``config.json`` on the Hub (the model id is in the comment above each entry); only
the shape matters for planning, never weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.sources.model_config import BuiltinShapes

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["BUILTIN_SHAPES", "REFERENCE_CONFIGS", "REFERENCE_HUB_IDS", "reference_config"]

_QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "attention_bias": False,
}
_LLAMA31 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": _QWEN3
    | {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": _QWEN3
    | {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-32B
    "qwen3-32b": _QWEN3
    | {
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": _LLAMA31
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": _LLAMA31
    | {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}


# The Hub model each built-in shape copies the config of.
REFERENCE_HUB_IDS: dict[str, str] = {
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
}


def reference_config(name: str) -> PreTrainedConfig:
    """A config with the shape of a real model (see :data:`REFERENCE_CONFIGS`), built offline."""
    try:
        values = dict(REFERENCE_CONFIGS[name.lower()])
    except KeyError:
        raise InvalidRequestError(
            f"Unknown reference model {name!r}. Built-in shapes: {', '.join(sorted(REFERENCE_CONFIGS))}."
        ) from None
    from transformers import AutoConfig

    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._name_or_path = name.lower()
    return config


# The table as the config reader takes it (xpukit/sources/model_config.py): a name may mean a shape.
BUILTIN_SHAPES = BuiltinShapes(
    names=frozenset(REFERENCE_CONFIGS), hub_ids=REFERENCE_HUB_IDS, build=reference_config
)
