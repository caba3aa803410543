"""The base record written beside an adapter xpukit trained (its format:
:mod:`xpukit.planning.training.base_record`).

:func:`record_on_save` gives a ``PeftModel`` that :func:`xpukit.load_for_xpu` loaded with trainable
adapters its own ``save_pretrained``: peft's, then :data:`RECORD_FILE` beside each
``adapter_config.json`` it wrote. ``Trainer`` (and TRL's trainers) save a ``PeftModel`` through its
``save_pretrained``, so every checkpoint gets the record too. The record is what the loaded model
really holds: its quantization config as transformers serialises it, and the dtype it computes in.

The method is an instance of :class:`SaveWithRecord` (a module-level class, so the model can still
be deep-copied, each copy saving itself, and pickled); it refers to the model, so the two are
freed together by the garbage collector.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from xpukit._partial import write_file
from xpukit.planning.training.base_record import RECORD_FILE, BaseRecord, parse_record, record_from
from xpukit.sources.adapter_files import read_record_data

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["SaveWithRecord", "read_base_record", "record_on_save", "write_record"]


def read_base_record(adapter: str | Path) -> BaseRecord | None:
    """The record in an adapter directory, or ``None`` when it has none (an adapter from elsewhere).

    Raises:
        InvalidRequestError: the file is there but is not a record xpukit wrote.
    """
    found = read_record_data(adapter)
    return parse_record(*found) if found is not None else None


def record_on_save(model: PeftModel, *, dtype: str, base_model: str) -> str:
    """Make ``model.save_pretrained`` also write the base record; returns the note for the plan."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()
    record = record_from(config if isinstance(config, dict) else None, dtype=dtype, base_model=base_model)
    model.save_pretrained = SaveWithRecord(model, record)
    return (
        f"save_pretrained also writes {RECORD_FILE} beside the adapter: the base is held "
        f"{parse_record(record, RECORD_FILE).held()}, which merge=True / xpukit merge follow"
    )


def write_record(directory: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` as ``directory/RECORD_FILE``, whole or not at all (:mod:`xpukit._partial`)."""
    return write_file(Path(directory) / RECORD_FILE, json.dumps(record, indent=2) + "\n")


class SaveWithRecord:
    """A model's ``save_pretrained``: peft's, then the base record beside each adapter it wrote."""

    def __init__(self, model: PeftModel, record: dict[str, Any]) -> None:
        self.model = model
        self.record = record

    def __call__(self, save_directory: str | os.PathLike[str], *args: object, **kwargs: object) -> object:
        model = self.model
        result: object = type(model).save_pretrained(model, save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return result  # peft wrote nothing in this process
        selected = cast("list[str] | None", kwargs.get("selected_adapters"))  # peft's keyword
        names = selected or list(getattr(model, "peft_config", {}) or ["default"])
        for name in names:
            where = Path(save_directory) if name == "default" else Path(save_directory) / str(name)
            if (where / "adapter_config.json").is_file():
                write_record(where, self.record)
        return result
