"""A trained adapter's files, read once before planning: its config, its tensor table, its base record.

:func:`read_adapter_files` reads ``adapter_config.json``, the header of ``adapter_model.safetensors``
(names, dtypes, shapes; never a weight) and xpukit's ``xpukit_base.json`` when present. Planning
decides from the :class:`AdapterFiles` it returns (:mod:`xpukit.planning.training.adapter_fit`,
:mod:`xpukit.planning.training.base_record`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xpukit.errors import InvalidRequestError

__all__ = ["RECORD_FILE", "AdapterFiles", "read_adapter_files", "read_record_data", "read_safetensors_header"]

RECORD_FILE = "xpukit_base.json"  # the base record xpukit writes beside a saved adapter
_TENSORS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True, kw_only=True)
class AdapterFiles:
    """What a trained adapter's directory holds, as read.

    Attributes:
        path: the directory.
        config: ``adapter_config.json``'s object.
        tensors: the safetensors header (tensor name → dtype, shape), ``None`` without the file.
        record: ``xpukit_base.json``'s JSON value, ``None`` without the file (an adapter from elsewhere).
        record_path: where the record is (or would be).
    """

    path: str
    config: dict[str, Any]
    tensors: dict[str, Any] | None
    record: object | None
    record_path: str


def read_adapter_files(path: Path) -> AdapterFiles:
    """Read a trained adapter's directory (``lora=DIR``); never a weight.

    Raises:
        InvalidRequestError: no such directory, no or an unreadable ``adapter_config.json``, or a
            tensor file or record that cannot be read.
    """
    config_file = path / "adapter_config.json"
    if not path.is_dir():
        raise InvalidRequestError(
            f"lora={str(path)!r}: no such directory. A trained adapter is a directory written by "
            "PeftModel.save_pretrained (adapter_config.json + adapter_model.safetensors); download a Hub "
            "adapter first with huggingface_hub.snapshot_download."
        )
    if not config_file.is_file():
        present = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
        raise InvalidRequestError(
            f"lora={str(path)!r}: adapter_config.json is missing (found: {present}). Point lora= at the "
            "directory PeftModel.save_pretrained wrote, or use lora=True for new adapters."
        )
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"lora={str(path)!r}: adapter_config.json is unreadable: {exc}") from exc
    if not isinstance(saved, dict):
        raise InvalidRequestError(f"lora={str(path)!r}: adapter_config.json does not hold a JSON object.")
    tensors_file = path / _TENSORS_FILE
    record = read_record_data(path)
    return AdapterFiles(
        path=str(path),
        config=saved,
        tensors=read_safetensors_header(tensors_file) if tensors_file.is_file() else None,
        record=record[0] if record is not None else None,
        record_path=str(path / RECORD_FILE),
    )


def read_record_data(adapter: str | Path) -> tuple[object, str] | None:
    """``xpukit_base.json``'s JSON value and its path, or ``None`` when the adapter has none.

    Raises:
        InvalidRequestError: the file is there but cannot be read as JSON.
    """
    path = Path(adapter) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8")), str(path)
    except (OSError, ValueError) as exc:
        raise record_problem(path, f"unreadable ({exc})") from None


def record_problem(path: Path | str, what: str) -> InvalidRequestError:
    """The error for a base record xpukit did not write (or that cannot be read)."""
    return InvalidRequestError(
        f"{path}: {what}. xpukit writes this file beside a saved adapter to record how its base was held "
        "in training. Fix: save the adapter again from the model xpukit loaded, or delete the file and pass "
        "merge='dequantized' (a 4-bit base) or merge='original' (a full-precision base)."
    )


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a ``.safetensors`` file (names → dtype, shape), read without its weights.

    Raises:
        InvalidRequestError: the file is not a readable safetensors file.
    """
    try:
        with path.open("rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > 100 * 2**20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise InvalidRequestError(
            f"{path}: not a readable safetensors file ({exc}). Fix: save the adapter again with "
            "PeftModel.save_pretrained."
        ) from exc
    if not isinstance(header, dict):
        raise InvalidRequestError(f"{path}: the safetensors header is not a table of tensors.")
    header.pop("__metadata__", None)
    return header
