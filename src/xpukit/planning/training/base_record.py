"""How an adapter's base was held while it was trained: the record xpukit writes beside the adapter.

peft's ``adapter_config.json`` says which model an adapter belongs to, not whether that model was
held in 4-bit or in full precision while the adapter trained; merging into the wrong one of the two
changes the model (docs/merging.md "Merging an adapter"). So when a model xpukit loaded with
trainable adapters is saved (``save_pretrained``, ``Trainer``'s checkpoints included), xpukit writes
:data:`RECORD_FILE` beside ``adapter_config.json`` (acting: :mod:`xpukit.loading.base_record`), and
``merge=True`` follows it (:mod:`xpukit.planning.training.merge`). This module is the record's
format: :func:`record_from` builds it from what the loaded model holds, :func:`parse_record` reads
the file's object (read with the adapter's other files, :mod:`xpukit.sources.adapter_files`),
:class:`BaseRecord` says what it means for a merge (pure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xpukit._compat import installed_version
from xpukit.errors import InvalidRequestError
from xpukit.machine.precision import DTYPES, normalize_dtype
from xpukit.sources.adapter_files import RECORD_FILE, record_problem

__all__ = ["RECORD_FILE", "BaseRecord", "held_as", "parse_record", "record_from"]

_FORMAT = 1
# The BitsAndBytesConfig keywords that decide which 4-bit weights the base had (the compute dtype
# does not change them; the merge dequantises in its own dtype).
_4BIT_KEYS = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "llm_int8_skip_modules")
# LLM.int8's: the outlier threshold and the skipped modules decide which weights the base had.
_8BIT_KEYS = ("llm_int8_threshold", "llm_int8_skip_modules", "llm_int8_has_fp16_weight")


@dataclass(frozen=True, kw_only=True, slots=True)
class BaseRecord:
    """How an adapter's base was held in training, as its :data:`RECORD_FILE` says.

    Attributes:
        quantization: ``"4bit"`` / ``"8bit"`` (bitsandbytes), another quantization method's name
            (``"gptq"`` …), or ``None`` for full precision.
        quantization_config: the quantization config's keywords as transformers serialises them
            (dtypes as names), or ``None``.
        dtype: the dtype the model was loaded to compute in, which its training computed in
            (``training_args`` follows it): the dtype a merge reproduces the trained model in.
        base_model: the base as it was loaded (a path or Hub id).
        path: the record file.
    """

    quantization: str | None
    quantization_config: dict[str, Any] | None
    dtype: str
    base_model: str
    path: str

    def held(self) -> str:
        """How the base was held, in words (``in 4-bit (nf4, double quantisation), computing in bf16``)."""
        if self.quantization == "4bit":
            config = self.quantization_config or {}
            double = ", double quantisation" if config.get("bnb_4bit_use_double_quant") else ""
            return f"in 4-bit ({config.get('bnb_4bit_quant_type', 'nf4')}{double}), computing in {self.dtype}"
        if self.quantization == "8bit":
            return f"in 8-bit (bitsandbytes LLM.int8), computing in {self.dtype}"
        if self.quantization is not None:
            return f"quantized by {self.quantization}, computing in {self.dtype}"
        return f"in full precision ({self.dtype})"

    def merge_base(self) -> tuple[str, str | None]:
        """The base a merge rebuilds for this adapter (``"dequantized"`` / ``"original"``), and a
        warning when xpukit cannot rebuild the base exactly (8-bit, another quantization method)."""
        if self.quantization == "4bit":
            return "dequantized", None
        if self.quantization is None:
            return "original", None
        return "original", (
            f"{self.path} says the adapter trained with its base held {self.held()}; xpukit rebuilds only "
            "a 4-bit bitsandbytes base, so it merges into the original weights, the nearest it has"
        )

    def training_mismatch(self, quantization: str | None) -> str | None:
        """A warning when an adapter trained further is held otherwise than it trained (``None`` if not)."""
        if quantization == self.quantization:
            return None
        now = held_as(quantization)
        fix = f"quantize={self.quantization!r}" if self.quantization in {"4bit", "8bit"} else "quantize=False"
        return (
            f"trainable=True: {self.path} says the adapter trained with its base held {self.held()}, and "
            f"this plan holds the base {now}: training goes on against other base weights. Fix: {fix}, "
            "as it trained"
        )

    def merge_quantization(self, dtype: str) -> dict[str, Any]:
        """The ``BitsAndBytesConfig`` keywords that rebuild the recorded 4-bit base, in ``dtype``."""
        config = self.quantization_config or {}
        kept = {k: config[k] for k in _4BIT_KEYS if config.get(k) is not None}
        return {"load_in_4bit": True, **kept, "bnb_4bit_compute_dtype": dtype}

    def load_quantization(self, dtype: str) -> dict[str, Any] | None:
        """The ``BitsAndBytesConfig`` keywords that hold the base as it trained (``None`` unless the
        record says bitsandbytes 4-bit or 8-bit): a load of the adapter gives the trained model."""
        if self.quantization == "4bit":
            return self.merge_quantization(dtype)
        if self.quantization == "8bit":
            config = self.quantization_config or {}
            kept = {k: config[k] for k in _8BIT_KEYS if config.get(k) is not None}
            return {"load_in_8bit": True, **kept}
        return None


def held_as(quantization: str | None) -> str:
    """How a base is held, in words, for a quantization kind (``"4bit"``, ``"8bit"``, ``None``, or a
    method's name): ``in 4-bit``, ``in full precision``, ``quantized by gptq``."""
    known = {"4bit": "in 4-bit", "8bit": "in 8-bit", None: "in full precision"}
    return known.get(quantization) or f"quantized by {quantization}"


def record_from(quantization_config: dict[str, Any] | None, *, dtype: str, base_model: str) -> dict[str, Any]:
    """The JSON object to write: the loaded model's quantization config (``to_dict()``) and dtype."""
    # Through JSON: enums (transformers' QuantizationMethod is a str enum) become their values.
    config = json.loads(json.dumps(quantization_config, default=str)) if quantization_config else None
    return {
        "format": _FORMAT,
        "written_by": f"xpukit {installed_version('xpukit') or '(source tree)'}",
        "about": "how the base model was held while this adapter trained; xpukit merge follows it",
        "base_model": base_model,
        "quantization": _kind(config),
        "quantization_config": config,
        "dtype": dtype,
    }


def parse_record(data: object, path: str) -> BaseRecord:
    """A record's JSON object as a :class:`BaseRecord` (``path``: where it was read, for messages).

    Raises:
        InvalidRequestError: it is not a record xpukit wrote.
    """
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise _bad(path, f"not a format-{_FORMAT} record")
    kind, config, dtype = data.get("quantization"), data.get("quantization_config"), data.get("dtype")
    if not (kind is None or isinstance(kind, str)) or not (config is None or isinstance(config, dict)):
        raise _bad(path, "its quantization fields have the wrong types")
    if not isinstance(dtype, str) or normalize_dtype(dtype) not in DTYPES:
        raise _bad(path, f"it names no dtype xpukit computes in ({dtype!r}; valid: {', '.join(DTYPES)})")
    return BaseRecord(
        quantization=kind,
        quantization_config=config,
        dtype=str(normalize_dtype(dtype)),
        base_model=str(data.get("base_model") or ""),
        path=path,
    )


def _kind(config: dict[str, Any] | None) -> str | None:
    if not config:
        return None
    method = str(config.get("quant_method") or "")
    if method == "bitsandbytes" or (
        not method and (config.get("load_in_4bit") or config.get("load_in_8bit"))
    ):
        return "4bit" if config.get("load_in_4bit") or config.get("_load_in_4bit") else "8bit"
    return method or "unknown"


def _bad(path: Path | str, what: str) -> InvalidRequestError:
    return record_problem(path, what)
