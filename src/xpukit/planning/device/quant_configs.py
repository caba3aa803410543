"""The plan's quantization as transformers' config objects: ``BitsAndBytesConfig``, ``TorchAoConfig``.

Building them is acting on a plan, never deciding one: the deciders (:mod:`.quantization`,
:mod:`.serve_quant`) hold the quantization as plain, JSON-able values, and these builders import
torch, transformers and torchao to turn such values into the objects ``from_pretrained`` takes.
They live in planning, not in :mod:`xpukit.loading`, because :meth:`LoadPlan.from_pretrained_kwargs
<xpukit.planning.loadplan.LoadPlan.from_pretrained_kwargs>` (the plan's own, documented keywords for
``from_pretrained``) returns them and planning imports nothing of loading; the loader's merge, the
quantized checkpoint writer and doctor's self-test take the same objects from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig, TorchAoConfig

__all__ = ["quantization_config", "torchao_config"]

# The torchao config classes xpukit names, and the modules they live in (torchao 0.18).
_CONFIG_MODULES = {
    "Int4WeightOnlyConfig": "torchao.quantization",
    "Int8WeightOnlyConfig": "torchao.quantization",
    "PrototypeInt4WeightOnlyConfig": "torchao.prototype.quantization.int4",
}


def quantization_config(values: Mapping[str, object]) -> BitsAndBytesConfig | TorchAoConfig:
    """The transformers quantization config a plan's ``quantization_config`` dict describes.

    :func:`~xpukit.planning.device.quantization.bnb_kwargs`-style keywords (dtypes by name) give a
    ``BitsAndBytesConfig``; a torchao format (``quant_method: torchao``,
    :mod:`xpukit.planning.device.serve_quant`) a ``TorchAoConfig``.
    """
    if values.get("quant_method") == "torchao":
        return torchao_config(values)
    import torch
    from transformers import BitsAndBytesConfig

    kwargs = dict(values)
    for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        name = kwargs.get(key)
        if isinstance(name, str):
            kwargs[key] = getattr(torch, name)
    return BitsAndBytesConfig(**kwargs)


def torchao_config(values: Mapping[str, object]) -> TorchAoConfig:
    """A ``transformers.TorchAoConfig`` from :class:`~xpukit.planning.device.serve_quant.ServeFormat`'s
    ``config`` (``{"quant_type": <class name>, "quant_type_kwargs": {...}}``; imports torchao)."""
    import importlib

    from transformers import TorchAoConfig

    name = str(values["quant_type"])
    # The CUDA-extension noise torchao logs on import is filtered by xpukit._compat.quiet_torchao_import.
    module = importlib.import_module(_CONFIG_MODULES[name])
    kwargs = cast("Mapping[str, object]", values.get("quant_type_kwargs") or {})  # JSON-able keywords
    quant_type = getattr(module, name)(**dict(kwargs))
    return TorchAoConfig(quant_type=quant_type)
