"""Writing one GGUF file with the ``gguf`` package (llama.cpp's own Python writer), as a plan says.

:func:`write_gguf` takes the plan (:mod:`xpukit.planning.model.gguf_export`), the model's config and
tensors and a folder with its tokenizer files, and writes: the architecture's metadata, the
tokenizer (tokens, types, merges or scores, special token ids, chat template), then every tensor,
renamed with ``gguf``'s tensor-name map, permuted or shifted where the family needs it, and encoded
in its planned type with ``gguf.quants``. Tensors are converted and written one at a time, so the
export holds one tensor beyond the model. docs/export.md "What the exporter relies on" says what
each step follows in llama.cpp's converter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.model.gguf_export import GgufExportPlan, rope_parameters

if TYPE_CHECKING:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType

__all__ = ["gguf_tensor_name", "llama3_rope_factors", "write_gguf"]

_FILE_TYPES = {"bf16": "MOSTLY_BF16", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}


def write_gguf(
    path: Path,
    plan: GgufExportPlan,
    config: Mapping[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer_dir: Path,
    *,
    name: str,
) -> None:
    """Write the GGUF file ``path`` (a new file) from ``tensors`` (checkpoint name, tensor)."""
    import gguf

    writer = gguf.GGUFWriter(path, plan.family.arch)
    try:
        _metadata(writer, plan, config, name)
        _vocabulary(writer, plan, config, tokenizer_dir)
        items = [(gguf_tensor_name(plan, config, n), n, t) for n, t in tensors if n in plan.tensor_types]
        extra = _extra_tensors(plan, config)
        for gguf_name, hf_name, tensor in items:
            kind = plan.tensor_types[hf_name]
            shape, nbytes = _encoded_layout(tuple(tensor.shape), kind)
            writer.add_tensor_info(gguf_name, shape, _np_dtype(kind), nbytes, raw_dtype=_raw(kind))
        for gguf_name, array in extra:
            writer.add_tensor_info(gguf_name, array.shape, array.dtype, array.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, hf_name, tensor in items:
            writer.write_tensor_data(
                _encode(_prepared(plan, config, hf_name, tensor), plan.tensor_types[hf_name])
            )
        for _, array in extra:
            writer.write_tensor_data(array)
    finally:
        writer.close()


def gguf_tensor_name(plan: GgufExportPlan, config: Mapping[str, Any], hf_name: str) -> str:
    """llama.cpp's name for a checkpoint tensor (``model.layers.0.self_attn.q_proj.weight`` →
    ``blk.0.attn_q.weight``), from the ``gguf`` package's tensor-name map."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == plan.family.arch)
    mapping = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    found = mapping.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise InvalidRequestError(
            f"GGUF export: the tensor {hf_name!r} has no name in llama.cpp's {plan.family.arch!r} "
            "architecture, so llama.cpp could not run the file. Fix: export the model as transformers "
            "defines it (no extra modules), or use llama.cpp's convert_hf_to_gguf.py."
        )
    return str(found)


def llama3_rope_factors(config: Mapping[str, Any]) -> list[float]:
    """The ``rope_freqs`` tensor llama.cpp reads for Llama 3.1's rope (docs/export.md "Llama")."""
    params = rope_parameters(config)
    base = float(params.get("rope_theta", 10000.0))
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    factor = float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old = float(params.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _metadata(writer: GGUFWriter, plan: GgufExportPlan, config: Mapping[str, Any], name: str) -> None:
    import gguf

    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    rope = rope_parameters(config)
    writer.add_name(name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[plan.type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(int(config["vocab_size"]))
    if plan.family.arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if plan.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if plan.family.arch == "gemma3":
        writer.add_sliding_window(int(config["sliding_window"]))
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def _vocabulary(
    writer: GGUFWriter, plan: GgufExportPlan, config: Mapping[str, Any], tokenizer_dir: Path
) -> None:
    """The tokenizer as llama.cpp's converter writes it: tokens padded to the embedding's rows."""
    import gguf

    rows = int(config["vocab_size"])
    if plan.tokenizer_model == "llama":
        vocab = gguf.LlamaHfVocab(tokenizer_dir)
        tokens, scores, types = [], [], []
        for text, score, kind in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(kind)
        _pad(tokens, types, rows, scores)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        gguf.SpecialVocab(tokenizer_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
        return
    tokens, types = _byte_level_tokens(tokenizer_dir, rows)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(plan.tokenizer_pre or "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _byte_level_tokens(tokenizer_dir: Path, rows: int) -> tuple[list[str], list[int]]:
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= rows:
        raise InvalidRequestError(
            f"GGUF export: the tokenizer has token ids up to {max(vocab.values())} and the model's embedding "
            f"{rows} rows. Fix: resize the embeddings (model.resize_token_embeddings(len(tokenizer))) first."
        )
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(rows):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            special = added[i].special or (by_id[i].startswith("<|") and by_id[i].endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _pad(tokens: list[bytes], types: list[TokenType], rows: int, scores: list[float]) -> None:
    import gguf

    if len(tokens) > rows:
        raise InvalidRequestError(
            f"GGUF export: the tokenizer has {len(tokens)} tokens and the model's embedding {rows} rows. "
            "Fix: resize the embeddings (model.resize_token_embeddings(len(tokenizer))) first."
        )
    for i in range(len(tokens), rows):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)


def _extra_tensors(plan: GgufExportPlan, config: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    import numpy as np

    if plan.rope_type != "llama3":
        return []
    return [("rope_freqs.weight", np.asarray(llama3_rope_factors(config), dtype=np.float32))]


def _prepared(
    plan: GgufExportPlan, config: Mapping[str, Any], name: str, tensor: torch.Tensor
) -> torch.Tensor:
    """The tensor as llama.cpp reads it: float32 on the CPU, q/k rows permuted, Gemma norms + 1."""
    import torch

    data = tensor.detach().to(device="cpu", dtype=torch.float32)
    if plan.family.permute_qk and name.endswith(
        ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
    ):
        heads = int(config["num_attention_heads"])
        if ".k_proj." in name:
            heads = int(config.get("num_key_value_heads") or heads)
        data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2)
        data = data.reshape(tensor.shape)
    if plan.family.norm_shift and name.endswith("norm.weight"):
        data = data + plan.family.norm_shift
    return data.contiguous()


def _raw(kind: str) -> GGMLQuantizationType | None:
    import gguf

    return None if kind in ("F32", "F16") else getattr(gguf.GGMLQuantizationType, kind)


def _np_dtype(kind: str) -> type[np.generic]:
    import numpy as np

    floats: dict[str, type[np.generic]] = {"F32": np.float32, "F16": np.float16}
    return floats.get(kind, np.uint8)


def _encoded_layout(shape: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], int]:
    import gguf

    raw = _raw(kind)
    if raw is None:
        count = math.prod(shape)
        return shape, count * (4 if kind == "F32" else 2)
    byte_shape = tuple(gguf.quant_shape_to_byte_shape(shape, raw))
    return byte_shape, math.prod(byte_shape)


def _encode(data: torch.Tensor, kind: str) -> np.ndarray:
    import gguf
    import numpy as np
    import torch

    if kind == "F32":
        encoded = data
    elif kind == "F16":
        encoded = data.to(torch.float16)
    elif kind == "BF16":  # torch rounds to nearest even, as gguf's BF16 does; bf16 weights stay exact
        encoded = data.to(torch.bfloat16).view(torch.uint8)
    else:
        return np.asarray(gguf.quants.quantize(data.numpy(), _raw(kind)))
    return np.asarray(encoded.numpy())
