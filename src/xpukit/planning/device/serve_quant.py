"""The weight-only format a model loaded to run (no LoRA, no training) is quantized to, chosen for speed.

Pure: the device, the compute dtype, the bit width and the installed torchao version decide. The
rules and the measurements behind them are in docs/planning.md "Quantization for inference":

* torchao int4 weight-only through transformers' ``TorchAoConfig``: CUDA (compute capability ≥ 8.0,
  bfloat16) ``Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`` (tinygemm); XPU
  (bfloat16 or float16) ``int4_packing_format="plain_int32"`` (oneDNN); the CPU in bfloat16
  ``PrototypeInt4WeightOnlyConfig`` (``_weight_int4pack_mm_for_cpu``). Group size 128.
* torchao int8 weight-only (``Int8WeightOnlyConfig``, per row) on CUDA, XPU and the CPU.
* ``set_inductor_config=False``: torchao's default would change inductor settings for the whole
  process when the weights are quantized (docs/planning.md "Quantization for inference").
* bitsandbytes (nf4 + double quant, LLM.int8) where none of these runs, or torchao is missing or
  too old: the fallback is recorded with what would fix it.

Training (QLoRA) keeps bitsandbytes nf4: this module is asked only for loads without adapters.
Nothing here imports torchao: its version comes from package metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xpukit._compat import EXTRAS, installed_version, is_installed, version_at_least
from xpukit.machine.facts import DeviceFacts

__all__ = [
    "INT4_GROUP_SIZE",
    "TORCHAO_MIN",
    "ServeFormat",
    "serve_format",
    "torchao_version",
]

# The release these rules were checked against (docs/planning.md "Quantization for inference").
TORCHAO_MIN = EXTRAS["torchao"].minimum or "0"
# torchao's default group; a layer whose input width it does not divide stays unquantized.
INT4_GROUP_SIZE = 128
_TORCHAO_FIX = f"pip install 'xpukit[{EXTRAS['torchao'].extra}]'"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeFormat:
    """The format chosen for a ``4bit`` / ``8bit`` request without adapters.

    Attributes:
        library: ``torchao`` or ``bitsandbytes``.
        label: what the plan shows (``torchao int4 (plain_int32)``, ``bitsandbytes nf4``…).
        config: for torchao, the config class name and its keyword arguments (JSON-able:
            ``{"quant_method": "torchao", "quant_type": ..., "quant_type_kwargs": {...}}``);
            ``None`` for bitsandbytes (its keywords come from ``bnb_kwargs``).
        reason: why this format.
        rejected: the formats not taken, each with why not.
        torchao_missing: torchao's format would run here, but torchao is missing or too old.
    """

    library: str
    label: str
    config: dict[str, Any] | None
    reason: str
    rejected: tuple[tuple[str, str], ...] = field(default=())
    torchao_missing: bool = False


def torchao_version() -> str | None:
    """The installed torchao version (package metadata, no import), or ``None`` when it is missing or
    cannot be imported from here: the plan asks what the load's ``require`` will (metadata and an
    importable module), so a plan never picks torchao for a load that would then refuse it."""
    return installed_version("torchao") if is_installed("torchao") else None


def serve_format(device: DeviceFacts, kind: str, dtype: str, torchao: str | None) -> ServeFormat:
    """The fastest weight-only format for ``kind`` (``4bit``/``8bit``) on ``device`` in ``dtype``.

    Args:
        device: the plan's main device.
        kind: ``4bit`` or ``8bit``.
        dtype: the plan's compute dtype (``bfloat16`` / ``float16`` / ``float32``).
        torchao: the installed torchao version (:func:`torchao_version`), ``None`` when missing.
    """
    bits = 4 if kind == "4bit" else 8
    bnb = "bitsandbytes nf4" if bits == 4 else "bitsandbytes LLM.int8"
    candidate, cannot = _torchao_candidate(device, bits, dtype)
    if candidate is None:
        return ServeFormat(
            library="bitsandbytes",
            label=bnb,
            config=None,
            reason=f"{bnb}: torchao int{bits} does not run here ({cannot})",
            rejected=((f"torchao int{bits}", str(cannot)),),
        )
    label, quant_type, kwargs, why = candidate
    missing = None
    if torchao is None:
        missing = f"torchao is not installed ({_TORCHAO_FIX})"
    elif not version_at_least(torchao, TORCHAO_MIN):
        missing = f"torchao {torchao} is installed, >={TORCHAO_MIN} is needed ({_TORCHAO_FIX})"
    if missing is not None:
        return ServeFormat(
            library="bitsandbytes",
            label=bnb,
            config=None,
            reason=f"{bnb}, the slower format: {label} would run here, but {missing}",
            rejected=((label, missing),),
            torchao_missing=True,
        )
    config = {"quant_method": "torchao", "quant_type": quant_type, "quant_type_kwargs": kwargs}
    return ServeFormat(
        library="torchao",
        label=label,
        config=config,
        reason=f"{label} through transformers' TorchAoConfig: {why}",
        rejected=((bnb, f"slower to run; {bnb} is the format to train against (QLoRA)"),),
    )


def _torchao_candidate(
    device: DeviceFacts, bits: int, dtype: str
) -> tuple[tuple[str, str, dict[str, Any], str] | None, str | None]:
    """(label, config class, kwargs, why) of the torchao format for this device, or why there is none."""
    backend = device.backend
    if bits == 8:
        if backend == "mps":
            return None, "not measured on MPS"
        return (
            "torchao int8",
            "Int8WeightOnlyConfig",
            {"set_inductor_config": False},
            'int8 weights, one scale per row (docs/planning.md "Quantization for inference")',
        ), None
    if backend == "cuda":
        capability = device.compute_capability
        if capability is not None and capability[0] < 8:
            return None, f"tinygemm's int4 kernel needs compute capability 8.0, {device.name} is {capability}"
        if dtype != "bfloat16":
            return None, f"tinygemm's int4 kernel takes bfloat16 only, the plan computes in {dtype}"
        return _int4("tile_packed_to_4d", "Int4WeightOnlyConfig", "tinygemm kernel (tile-packed) on CUDA")
    if backend == "xpu":
        if dtype not in {"bfloat16", "float16"}:
            return None, f"the XPU int4 kernel takes bfloat16 or float16, the plan computes in {dtype}"
        return _int4("plain_int32", "Int4WeightOnlyConfig", "oneDNN int4 kernel (plain_int32) on XPU")
    if backend == "cpu":
        if dtype != "bfloat16":
            return None, (
                f"on the CPU in {dtype} it measured slower than bitsandbytes nf4 (7.8 vs 1.9 ms for a "
                '2048x2048 product at batch 1: docs/planning.md "Quantization for inference")'
            )
        kernel = "the CPU int4 kernel (_weight_int4pack_mm_for_cpu)"
        return _int4(None, "PrototypeInt4WeightOnlyConfig", kernel)
    return None, "no torchao int4 kernel for MPS"


def _int4(
    packing: str | None, quant_type: str, kernel: str
) -> tuple[tuple[str, str, dict[str, Any], str], None]:
    kwargs: dict[str, Any] = {"group_size": INT4_GROUP_SIZE, "set_inductor_config": False}
    if packing is not None:
        kwargs["int4_packing_format"] = packing
    label = f"torchao int4 ({packing or 'cpu'})"
    why = f'{kernel}, groups of {INT4_GROUP_SIZE} (docs/planning.md "Quantization for inference")'
    return (label, quant_type, kwargs, why), None
