"""What a GGUF export of a model will write, decided before any weight is read.

Pure: the model's config (as a dict), the names and shapes of its tensors (a safetensors header or a
loaded model's state dict), its ``tokenizer.json``, the type asked for and the free space where the
file goes decide. Everything it relies on about llama.cpp's format is in docs/export.md "What the
exporter relies on", with its public source:

* the families and their llama.cpp architecture (``llama`` for Llama and Mistral, ``qwen2``,
  ``qwen3``, ``gemma3``; each family's ``gguf`` in :mod:`xpukit.planning.model.families`), and what
  each needs beyond renaming (the q/k row permutation of the ``llama`` architecture, Gemma's
  ``norm + 1``);
* the rope and attention settings llama.cpp can express for each (refused otherwise, with why);
* each tensor's type: 1-D tensors in F32, the matrices in the asked type, Q8_0 / Q4_0 only for rows
  that are a whole number of 32-value blocks (else F16, as llama.cpp's converter does), and for
  ``q4_0`` the embedding and output matrices in Q8_0;
* the tokenizer: byte-level BPE (``gpt2``, its pre-tokenizer named by its split rule) or
  sentencepiece-style BPE with byte fallback (``llama``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.planning.model.families import FAMILIES as ALL_FAMILIES
from xpukit.planning.model.families import GgufFamily
from xpukit.planning.vocabulary import Decision

__all__ = [
    "FAMILIES",
    "GGUF_TYPES",
    "K_QUANTS",
    "ExportFacts",
    "GgufExportPlan",
    "GgufFamily",
    "gguf_type",
    "plan_gguf_export",
    "tokenizer_kind",
]

GGUF_TYPES = ("bf16", "f16", "q8_0", "q4_0")
# Types llama.cpp's own tools make from an exported file (the gguf package writes none of them).
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
QUANT_BLOCK = 32  # values per Q8_0 / Q4_0 block (ggml's QK8_0 = QK4_0 = 32)
# bytes per value of each tensor type: F32 4, F16/BF16 2, Q8_0 34 bytes per 32, Q4_0 18 bytes per 32
BYTES_PER_VALUE = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}
_TYPE_OF = {"bf16": "BF16", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
# room kept free beyond the estimate (metadata, the filesystem's own blocks)
DISK_MARGIN = 64 * 1024 * 1024


# The families exported, by model_type: those of xpukit.planning.model.families with a GGUF
# architecture, in that table's order.
FAMILIES: Mapping[str, GgufFamily] = MappingProxyType(
    {t: f.gguf for t, f in ALL_FAMILIES.items() if f.gguf is not None}
)
# llama.cpp's Gemma 3 (docs/export.md "Gemma 3"): every 6th layer global, the rest sliding windows
# with rope base 10000, and queries scaled by 1/sqrt(head_dim).
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportFacts:
    """What the export plan is decided from.

    Attributes:
        config: the model's config as a dict (``config.to_dict()`` or config.json).
        tensors: every tensor's name and shape, as the checkpoint names them.
        tokenizer_json: the parsed ``tokenizer.json`` (``None``: there is none).
        free_bytes: free space on the file system OUT goes to (``None``: unknown, not checked).
        out_exists: whether OUT exists and is not an empty folder.
    """

    config: Mapping[str, Any]
    tensors: Mapping[str, tuple[int, ...]]
    tokenizer_json: Mapping[str, Any] | None
    free_bytes: int | None = None
    out_exists: bool = False
    out: str = "OUT"


@dataclass(frozen=True, kw_only=True, slots=True)
class GgufExportPlan:
    """What the export writes: the architecture, each tensor's type, the tokenizer and the size."""

    family: GgufFamily
    model_type: str
    type: str
    tensor_types: Mapping[str, str]  # checkpoint tensor name -> GGUF type (F32, BF16, F16, Q8_0, Q4_0)
    tokenizer_model: str  # gpt2 / llama
    tokenizer_pre: str | None
    estimated_bytes: int
    rope_type: str
    decisions: tuple[Decision, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``xpukit export --json``)."""
        counts: dict[str, int] = {}
        for kind in self.tensor_types.values():
            counts[kind] = counts.get(kind, 0) + 1
        return {
            "arch": self.family.arch,
            "family": self.family.label,
            "type": self.type,
            "tensor_types": counts,
            "tokenizer": {"model": self.tokenizer_model, "pre": self.tokenizer_pre},
            "estimated_bytes": self.estimated_bytes,
            "decisions": [d.to_dict() for d in self.decisions],
            "notes": list(self.notes),
        }


def plan_gguf_export(facts: ExportFacts, type: str = "bf16") -> GgufExportPlan:
    """Decide the export, or refuse it before anything is read or written.

    Raises:
        InvalidRequestError: an unknown or k-quant type, a family llama.cpp does not run as xpukit
            exports it, settings of that family it cannot express, a tokenizer it cannot describe,
            or OUT exists.
        PlanError: too little free disk for the file.
    """
    asked = gguf_type(type)
    if facts.out_exists:
        raise InvalidRequestError(
            f"OUT={facts.out!r} already exists and is not an empty folder. Fix: pass a new folder, or "
            "remove that one first."
        )
    model_type = str(facts.config.get("model_type"))
    family = FAMILIES.get(model_type)
    if family is None:
        raise InvalidRequestError(
            f"GGUF export of model_type {model_type!r}: not a family xpukit exports. Valid: "
            f"{', '.join(f.label + ' (' + t + ')' for t, f in FAMILIES.items())}. Fix: export another model, "
            "or use llama.cpp's convert_hf_to_gguf.py, which knows more families."
        )
    rope_type = _rope_type(facts.config, family)
    if family.arch == "gemma3":
        _check_gemma3(facts.config)
    model, pre = tokenizer_kind(facts.tokenizer_json)
    types = {name: tensor_type(name, shape, asked) for name, shape in facts.tensors.items()}
    size = estimate_bytes(facts.tensors, types, facts.tokenizer_json)
    if facts.free_bytes is not None and facts.free_bytes < size + DISK_MARGIN:
        raise PlanError(
            f"GGUF export to {facts.out!r}: the file needs about {size / 2**20:.1f} MiB (+ "
            f"{DISK_MARGIN // 2**20} MiB kept free) and the disk has {facts.free_bytes / 2**20:.1f} MiB "
            "free. Nothing was written. Fix: free space, write OUT on another disk, or pick a smaller --type "
            "(sizes per type: docs/export.md)."
        )
    decisions = (
        Decision(
            name="gguf_type",
            value=asked,
            reason=_type_reason(asked, types),
            rejected=tuple((k, "llama.cpp's llama-quantize makes it from this file") for k in ("q4_k_m",)),
            source="user",
        ),
        Decision(name="gguf_arch", value=family.arch, reason=_arch_reason(family)),
        Decision(
            name="gguf_tokenizer", value=f"{model}/{pre}" if pre else model, reason=_tok_reason(model, pre)
        ),
    )
    return GgufExportPlan(
        family=family,
        model_type=model_type,
        type=asked,
        tensor_types=types,
        tokenizer_model=model,
        tokenizer_pre=pre,
        estimated_bytes=size,
        rope_type=rope_type,
        decisions=decisions,
        notes=_notes(facts.config, family),
    )


def gguf_type(type: str) -> str:
    """The asked type, normalised; an unknown type or a k-quant refused with the fix."""
    asked = str(type).strip().lower()
    if asked in GGUF_TYPES:
        return asked
    if asked in K_QUANTS:
        raise InvalidRequestError(
            f"--type {type!r}: a k-quant, which the gguf package cannot write. Export --type bf16 (or f16) "
            f"first, then make it with llama.cpp: `llama-quantize OUT/model-bf16.gguf OUT/model-{asked}.gguf "
            f"{asked.upper()}`, or with Ollama: `ollama create --quantize {asked} NAME -f OUT/Modelfile` "
            "(export with --ollama)."
        )
    raise InvalidRequestError(
        f"--type {type!r} is not a GGUF type xpukit writes. Valid: {', '.join(GGUF_TYPES)} (k-quants "
        f"such as q4_k_m: export bf16, then llama-quantize)."
    )


def tensor_type(name: str, shape: Sequence[int], asked: str) -> str:
    """The GGUF type one tensor is written in (docs/export.md "Tensor types")."""
    if len(shape) <= 1 or name.endswith("norm.weight"):
        return "F32"
    wanted = _TYPE_OF[asked]
    if asked == "q4_0" and ("embed_tokens" in name or name.startswith("lm_head")):
        wanted = "Q8_0"
    if wanted in ("Q8_0", "Q4_0") and shape[-1] % QUANT_BLOCK:
        return "F16"
    return wanted


def estimate_bytes(
    tensors: Mapping[str, tuple[int, ...]], types: Mapping[str, str], tokenizer_json: Mapping[str, Any] | None
) -> int:
    """The file's size: every tensor in its type, plus the vocabulary and merges as metadata."""
    total = 0.0
    for name, shape in tensors.items():
        count = 1
        for n in shape:
            count *= n
        total += count * BYTES_PER_VALUE[types[name]]
    if tokenizer_json is not None:
        model = tokenizer_json.get("model", {})
        vocab = model.get("vocab", {}) or {}
        merges = model.get("merges", []) or []
        total += sum(len(str(t)) + 16 for t in vocab) + sum(len(str(m)) + 12 for m in merges)
    return int(total) + 1024 * 1024  # header, metadata keys, alignment


def tokenizer_kind(tokenizer_json: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """``(tokenizer.ggml.model, tokenizer.ggml.pre)`` for a ``tokenizer.json`` (docs/export.md "Tokenizer").

    Raises:
        InvalidRequestError: no tokenizer.json, or a tokenizer llama.cpp's two BPE kinds do not describe.
    """
    if tokenizer_json is None:
        raise InvalidRequestError(
            "GGUF export needs the model's tokenizer (a tokenizer.json) and found none. Fix: pass a model "
            "folder that has one (AutoTokenizer.from_pretrained(...).save_pretrained(folder)), or tokenizer=."
        )
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise InvalidRequestError(
            f"GGUF export: the tokenizer is a {model.get('type')!r} model; xpukit writes BPE tokenizers "
            "(byte-level, or with byte fallback). Fix: use llama.cpp's convert_hf_to_gguf.py for this model."
        )
    if model.get("byte_fallback"):
        return "llama", None
    split = _split_rule(tokenizer_json.get("pre_tokenizer"))
    if split is None:
        raise InvalidRequestError(
            "GGUF export: the tokenizer's pre-tokenizer is not one llama.cpp names (found "
            f"{tokenizer_json.get('pre_tokenizer')!r}). Valid: GPT-2's byte-level split, Llama 3's, Qwen2's. "
            "Fix: use llama.cpp's convert_hf_to_gguf.py, which knows more tokenizers by their hash."
        )
    return "gpt2", split


# Split rules of the byte-level tokenizers and the pre-tokenizer name llama.cpp gives each
# (docs/export.md "Tokenizer").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
SPLIT_RULES = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


def _split_rule(pre: object) -> str | None:
    if not isinstance(pre, Mapping):
        return None
    if pre.get("type") == "ByteLevel":
        return "gpt-2" if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    if pre.get("type") != "Sequence":
        return None
    steps = list(pre.get("pretokenizers") or ())
    if len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel":
        return None
    if steps[1].get("use_regex", True):
        return None
    pattern = steps[0].get("pattern") or {}
    return SPLIT_RULES.get(pattern.get("Regex", ""))


def rope_parameters(config: Mapping[str, Any], layer_type: str = "full_attention") -> Mapping[str, Any]:
    """The rope settings of one kind of layer, from transformers 5's ``rope_parameters`` (or the older
    ``rope_scaling`` + ``rope_theta``)."""
    params = config.get("rope_parameters") or {}
    if isinstance(params, Mapping) and layer_type in params and isinstance(params[layer_type], Mapping):
        params = params[layer_type]
    merged = dict(config.get("rope_scaling") or {})
    merged.update(params if isinstance(params, Mapping) else {})
    if "rope_theta" not in merged and config.get("rope_theta") is not None:
        merged["rope_theta"] = config["rope_theta"]
    return merged


def _rope_type(config: Mapping[str, Any], family: GgufFamily) -> str:
    params = rope_parameters(config)
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind not in family.rope_types:
        raise InvalidRequestError(
            f"GGUF export of this {family.label} model: its rope_type {kind!r} is not one xpukit writes for "
            f"llama.cpp's {family.arch!r} architecture. Valid: {', '.join(family.rope_types)}. Fix: use "
            "llama.cpp's convert_hf_to_gguf.py for this model."
        )
    return kind


def _check_gemma3(config: Mapping[str, Any]) -> None:
    """llama.cpp's Gemma 3 fixes what Gemma 3's config leaves free (docs/export.md "Gemma 3")."""
    layers = int(config.get("num_hidden_layers", 0))
    expected = [
        "full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(layers)
    ]
    found = list(config.get("layer_types") or expected)
    head_dim = int(config.get("head_dim") or 0)
    scalar = config.get("query_pre_attn_scalar")
    local = rope_parameters(config, "sliding_attention").get("rope_theta", GEMMA3_LOCAL_ROPE_BASE)
    problems = []
    if found != expected:
        problems.append(f"layer_types {found} (llama.cpp: every {GEMMA3_PATTERN}th layer global, {expected})")
    if scalar is not None and int(scalar) != head_dim and layers != 62:
        problems.append(
            f"query_pre_attn_scalar {scalar} (llama.cpp scales queries by 1/sqrt(head_dim {head_dim}))"
        )
    if float(local) != GEMMA3_LOCAL_ROPE_BASE:
        problems.append(f"sliding layers' rope_theta {local} (llama.cpp: {GEMMA3_LOCAL_ROPE_BASE:g})")
    if problems:
        raise InvalidRequestError(
            "GGUF export of this Gemma 3 model: llama.cpp's gemma3 architecture fixes settings this model "
            f"changes: {'; '.join(problems)}. llama.cpp would run another model than this one. Fix: export "
            "a Gemma 3 with the released settings (1B, 4B, 12B, 27B)."
        )


def _type_reason(asked: str, types: Mapping[str, str]) -> str:
    kinds = sorted(set(types.values()))
    reason = f"asked; tensors written as {', '.join(kinds)} (1-D tensors and norms in F32)"
    if asked == "q4_0":
        reason += "; the embedding and output matrices in Q8_0"
    if "F16" in kinds and asked in ("q8_0", "q4_0"):
        reason += "; rows that are not whole 32-value blocks in F16"
    return reason


def _arch_reason(family: GgufFamily) -> str:
    parts = [f"llama.cpp runs {family.label} as its {family.arch!r} architecture"]
    if family.permute_qk:
        parts.append("q/k rows permuted for its rope")
    if family.norm_shift:
        parts.append("norm weights stored + 1")
    return "; ".join(parts)


def _tok_reason(model: str, pre: str | None) -> str:
    if model == "llama":
        return "BPE with byte fallback: llama.cpp's sentencepiece-style vocabulary"
    return f"byte-level BPE; its split rule is llama.cpp's {pre!r} pre-tokenizer"


def _notes(config: Mapping[str, Any], family: GgufFamily) -> tuple[str, ...]:
    window = config.get("sliding_window")
    limit = config.get("max_position_embeddings") or 0
    if family.arch == "llama" and window and limit and int(window) < int(limit):
        return (
            f"sliding_window {window}: llama.cpp's llama architecture attends to the whole context; "
            f"prompts up to {window} tokens run as in transformers",
        )
    return ()
