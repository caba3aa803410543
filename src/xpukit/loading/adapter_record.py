"""The base record written beside an adapter xpukit trained (its format:
:mod:`xpukit.planning.training.base_record`).

:func:`record_on_save` gives a ``PeftModel`` that :func:`xpukit.load_for_xpu` loaded with trainable
adapters its own ``save_pretrained``: peft's, then :data:`RECORD_FILE` beside each
``adapter_config.json`` it wrote. ``Trainer`` (and TRL's trainers) save a ``PeftModel`` through its
``save_pretrained``, so every checkpoint gets the record too. The record is what the loaded model
really holds: its quantization config as transformers serialises it, and the dtype it computes in.

The method is bound to the model (``types.MethodType``): a deep copy gets its own, bound to the
copy, and the model keeps it only as long as it lives.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

from xpukit.planning.training.base_record import RECORD_FILE, parse_record, record_from

__all__ = ["record_on_save", "write_record"]


def record_on_save(model: Any, *, dtype: str, base_model: str) -> str:
    """Make ``model.save_pretrained`` also write the base record; returns the note for the plan."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()
    record = record_from(config if isinstance(config, dict) else None, dtype=dtype, base_model=base_model)
    model.xpukit_base_record = record
    model.save_pretrained = types.MethodType(_save_pretrained, model)
    return (
        f"save_pretrained also writes {RECORD_FILE} beside the adapter: the base is held "
        f"{parse_record(record, RECORD_FILE).held()}, which merge=True / xpukit merge follow"
    )


def write_record(directory: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` as ``directory/RECORD_FILE``."""
    path = Path(directory) / RECORD_FILE
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def _save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """peft's ``save_pretrained``, then the base record beside each adapter it wrote."""
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if not kwargs.get("is_main_process", True):
        return result  # peft wrote nothing in this process
    for name in kwargs.get("selected_adapters") or list(getattr(self, "peft_config", {}) or ["default"]):
        where = Path(save_directory) if name == "default" else Path(save_directory) / str(name)
        if (where / "adapter_config.json").is_file():
            write_record(where, self.xpukit_base_record)
    return result
