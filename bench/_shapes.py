"""The model shapes the training benches build with random weights (nothing is downloaded).

``--shape`` picks one; ``--tiny`` keeps its family at tiny widths (a CPU check in seconds).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

from _harness import pick_device

# Qwen3-8B (config.json of Qwen/Qwen3-8B): 8.2 B parameters, untied embeddings.
QWEN3_8B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# More families' shapes (``--shape``), from their config.json files; RoPE scaling is left out (it
# changes no step's arithmetic cost) so the configs build under transformers 5.17 and 5.22 alike.
LLAMA31_8B = {  # meta-llama/Llama-3.1-8B
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
PHI4_MINI = {  # microsoft/Phi-4-mini-instruct: stored qkv_proj and gate_up_proj, partial RoPE
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "pad_token_id": 199999,
}
GEMMA3_4B = {  # google/gemma-3-4b-pt's text model: GeGLU (tanh), 5 sliding-window layers to 1 global
    "vocab_size": 262208,
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b": ("Qwen3Config", QWEN3_8B),
    "llama-3.1-8b": ("LlamaConfig", LLAMA31_8B),
    "phi-4-mini": ("Phi3Config", PHI4_MINI),
    "gemma-3-4b": ("Gemma3TextConfig", GEMMA3_4B),
}
TINY = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def build_model(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Random bf16 weights of the chosen shape, saved with transformers (built on the device: fast).
    ``--tiny`` keeps the family of ``--shape`` at the tiny widths."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, full = SHAPES[args.shape]
    shape = {**full, **TINY} if args.tiny else dict(full)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.tiny and "pad_token_id" in shape:
        shape["pad_token_id"] = 0
    device = pick_device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        config = getattr(transformers, config_class)(**shape)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    return {"shape": args.shape, **shape}


# Small shapes for the CPU: xpukit's tiny qwen3, and a ~100M-parameter qwen3 (hidden 1024, 8 layers).
SMALL_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "tiny-36": {"num_hidden_layers": 36},  # the tiny widths, Qwen3-8B's 36 layers: a compile's trace
    "small": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
}


def build_decode_model(shape: str, root: Path, device: str) -> Path:
    """Write a model of ``shape`` with random weights to ``root / shape``; return its directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from xpukit.demo.tiny import build_tiny_model
    from xpukit.planning.model.reference_models import reference_config

    out = root / shape
    if (out / "config.json").is_file():
        return out
    if shape in SMALL_SHAPES:
        return build_tiny_model("qwen3", out, **SMALL_SHAPES[shape])
    config = reference_config(shape)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    del model
    gc.collect()
    return out
