"""Writing a quantized checkpoint: the merged weights quantized by torchao and saved in safetensors.

The format is decided by :func:`xpukit.planning.device.saved_quant.saved_format` (the one a
quantized load on the target device family takes). The weights are quantized exactly as a
quantized load quantizes them: the full-precision checkpoint is loaded with transformers'
``TorchAoConfig`` of that format on the device that packs it (``write_on``), and saved with
``save_pretrained``, whose torchao quantizer writes the tensors torchao can store in safetensors
(``flatten_tensor_state_dict``) and the ``quantization_config`` that loads them again without
quantizing. xpukit's record of the family goes beside it in config.json (docs/export.md "To another
machine").
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from xpukit.loading.quantized_layers import quantized_layers_event
from xpukit.planning.device.quant_configs import torchao_config
from xpukit.planning.device.saved_quant import SAVED_KEY, SavedFormat

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["free_bytes", "write_quantized"]


def write_quantized(
    model_class: type[PreTrainedModel], full: Path, out: Path, saved: SavedFormat
) -> list[str]:
    """Quantize the checkpoint in ``full`` to ``saved``'s format and write it to ``out``; returns notes.

    ``full`` is a full-precision checkpoint ``save_pretrained`` wrote, in ``saved.dtype``.
    """
    import torch

    if saved.config is None:
        raise ValueError("write_quantized: the format has no on-disk form (saved.on_disk is False)")
    model = model_class.from_pretrained(
        full,
        dtype=getattr(torch, saved.dtype),
        device_map=saved.write_on,
        quantization_config=torchao_config(saved.config),
    )
    try:
        done = str(quantized_layers_event(model, saved.label).actual)
        model.config.__dict__.pop("xpukit_quantize", None)  # the older record: not for these weights
        setattr(model.config, SAVED_KEY, saved.record())
        model.save_pretrained(out)
    finally:
        del model
    return [
        f"{done} on {saved.write_on} by transformers' TorchAoConfig; written for {saved.family} "
        f"(loads on {', '.join(saved.runs_on)})"
    ]


def free_bytes(out: Path) -> int | None:
    """Free space on the file system ``out`` goes to (its nearest existing folder), or ``None``."""
    here = out.resolve()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return int(shutil.disk_usage(here).free)
    except OSError:
        return None
