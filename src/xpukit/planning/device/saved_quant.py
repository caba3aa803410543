"""Quantized checkpoints on disk: the format a merge writes for a device family, and its check at load.

Pure. ``xpukit merge --quantize int4|int8 --for cuda|xpu|cpu`` writes torchao's weights in the
format that family runs (the one :func:`~xpukit.planning.device.serve_quant.serve_format` picks for
a load there), in safetensors, with transformers' ``quantization_config`` and xpukit's record of the
family beside it in config.json (:data:`SAVED_KEY`). A load reads the record: the weights are
loaded as they are (not quantized again), and a checkpoint written for another device family is
refused with the fix (docs/export.md "To another machine").

Which formats have a safetensors form is torchao's list (torchao 0.18,
``torchao/prototype/safetensors/safetensors_utils.py``: ``Int4TilePackedTo4dTensor``,
``Int4PlainInt32Tensor``, ``Int8Tensor``…); the CPU's int4 (``Int4OpaqueTensor``) is not on it, so
int4 for the CPU, and any family where torchao's format does not run, keeps the older record
(``xpukit_quantize``: full-precision weights quantized at each load), and says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.planning.device.serve_quant import serve_format
from xpukit.planning.model.weight_sizes import bytes_at_bits
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "DISK_MARGIN",
    "FAMILIES",
    "SAVED_KEY",
    "SavedFormat",
    "check_merge_disk",
    "check_saved_family",
    "check_writer_device",
    "default_family",
    "families_reading",
    "read_saved",
    "saved_dtype",
    "saved_format",
]

# The config.json key of xpukit's record of a quantized checkpoint (docs/export.md "To another machine").
SAVED_KEY = "xpukit_quantized"
FAMILIES = ("cuda", "xpu", "cpu")

# The torchao configs whose weights torchao 0.18 writes to safetensors, by packing, and the device
# families whose kernels read that layout (docs/export.md "To another machine").
_RUNS_ON: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("Int8WeightOnlyConfig", None): FAMILIES,  # Int8Tensor: int8 rows and their scales, any device
    ("Int4WeightOnlyConfig", "tile_packed_to_4d"): ("cuda",),  # Int4TilePackedTo4dTensor (tinygemm)
    ("Int4WeightOnlyConfig", "plain_int32"): ("xpu",),  # Int4PlainInt32Tensor (oneDNN)
}
# Room kept free beyond the estimate (config, tokenizer, the file system's own blocks).
DISK_MARGIN = 64 * 2**20
# Bits a quantized weight takes on disk with its scales: int4 with a bf16 scale and zero point per
# 128 weights; int8 with one scale per row (about nothing per weight).
_DISK_BITS = {"4bit": 4.25, "8bit": 8.0}
# Families whose torchao int4 packing runs on that family's device only (torch's packing operator).
_PACKS_ON_DEVICE = {"cuda", "xpu"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedFormat:
    """How a quantized merge is written, or how a checkpoint says it was.

    Attributes:
        kind: ``4bit`` or ``8bit``.
        family: the device family it is written for (``cuda``, ``xpu``, ``cpu``).
        label: the format (``torchao int4 (tile_packed_to_4d)``…).
        config: the torchao config by name (as :class:`ServeFormat`'s), or ``None`` when no on-disk
            format exists for this family: the weights are written in full precision with the older
            record and quantized at each load.
        runs_on: the device families that load it.
        reason: why this format.
        dtype: the dtype the weights were quantized from (their scales' and products' dtype).
        write_on: the device the weights are quantized on when written (``cuda``/``xpu`` for int4,
            whose packing runs on that device only; else ``cpu``).
    """

    kind: str
    family: str
    dtype: str
    label: str
    config: dict[str, Any] | None
    runs_on: tuple[str, ...]
    reason: str
    write_on: str = "cpu"

    @property
    def on_disk(self) -> bool:
        """The weights are written quantized (not quantized at each load)."""
        return self.config is not None

    def record(self) -> dict[str, Any]:
        """What config.json records under :data:`SAVED_KEY`."""
        return {
            "kind": self.kind,
            "for": self.family,
            "dtype": self.dtype,
            "format": self.label,
            "runs_on": list(self.runs_on),
            "config": self.config,
        }


def _family_device(family: str) -> DeviceFacts:
    """A device of ``family`` as the format rules see it (no capability: a CUDA GPU of 8.0 or later)."""
    return DeviceFacts(
        backend=family,  # type: ignore[arg-type]
        index=0,
        name=f"a {family} device" if family != "cpu" else "the CPU",
        family=family,
        total_memory=0,
        free_memory=None,
        native_bf16=True,
    )


def families_reading(config: Mapping[str, object] | None) -> tuple[str, ...] | None:
    """The device families that read a torchao config's weights from safetensors, or ``None`` when
    torchao cannot write them there (``config``: a serve format's, ``quant_method`` torchao)."""
    if config is None:
        return None
    kwargs = config.get("quant_type_kwargs")
    packing = kwargs.get("int4_packing_format") if isinstance(kwargs, Mapping) else None
    return _RUNS_ON.get((str(config["quant_type"]), None if packing is None else str(packing)))


def saved_format(kind: str, family: str, dtype: str, torchao: str | None) -> SavedFormat:
    """The format a merge writes for ``family`` (``4bit``/``8bit``, weights in ``dtype``).

    Raises:
        InvalidRequestError: ``family`` is not one of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise InvalidRequestError(
            f"--for {family!r} is not a device family a quantized checkpoint is written for. Valid: "
            f"{', '.join(FAMILIES)}. Default: this machine's (its accelerator's, else cpu)."
        )
    chosen = serve_format(_family_device(family), kind, dtype, torchao)
    config = chosen.config
    runs_on = families_reading(config)
    if config is None or runs_on is None:
        why = (
            f"{chosen.label} has no safetensors form in torchao (its CPU int4 tensor is not on torchao's "
            "list of saved tensors)"
            if config is not None
            else chosen.reason
        )
        return SavedFormat(
            kind=kind,
            family=family,
            dtype=dtype,
            label=f"{dtype}, quantized at each load ({chosen.label})",
            config=None,
            runs_on=FAMILIES,
            reason=f"written in full precision and quantized at each load: {why}",
        )
    bits = "int4" if kind == "4bit" else "int8"
    write_on = family if bits == "int4" and family in _PACKS_ON_DEVICE else "cpu"
    return SavedFormat(
        kind=kind,
        family=family,
        dtype=dtype,
        label=chosen.label,
        config=config,
        runs_on=runs_on,
        reason=f"{chosen.label}, the format an {bits} load on {family} takes ({chosen.reason}); "
        f"loads on {', '.join(runs_on)}",
        write_on=write_on,
    )


def read_saved(config: PreTrainedConfig) -> SavedFormat | None:
    """xpukit's record of a quantized checkpoint in ``config`` (a config or a dict), or ``None``."""
    value = config.get(SAVED_KEY) if isinstance(config, dict) else getattr(config, SAVED_KEY, None)
    if not isinstance(value, dict) or not isinstance(value.get("config"), dict):
        return None
    runs_on = tuple(str(f) for f in value.get("runs_on") or ())
    family = str(value.get("for"))
    return SavedFormat(
        kind=str(value.get("kind")),
        family=family,
        dtype=str(value.get("dtype") or ""),
        label=str(value.get("format")),
        config=dict(value["config"]),
        runs_on=runs_on,
        reason=f"written for {family} by xpukit merge --quantize",
    )


def saved_dtype(saved: SavedFormat, requested: str, name: str) -> Decision | None:
    """With no dtype asked, the dtype a quantized checkpoint's weights were written in (its products
    compute in it, as the load that quantized them did); ``None`` when one was asked or none recorded."""
    if requested != "auto" or saved.dtype not in {"bfloat16", "float16", "float32"}:
        return None
    return Decision(
        name="dtype",
        value=saved.dtype,
        reason=f"the dtype {name}'s quantized weights were written in (config.json {SAVED_KEY}): its "
        "products compute in it, as the load that quantized them did",
        source="auto",
    )


def check_saved_family(saved: SavedFormat, device: DeviceFacts, name: str) -> None:
    """Refuse a checkpoint written for another device family, before any weight is read.

    Raises:
        InvalidRequestError: ``device``'s family is not among those that run ``saved``'s format.
    """
    if device.backend in saved.runs_on:
        return
    bits = "int4" if saved.kind == "4bit" else "int8"
    raise InvalidRequestError(
        f"{name} holds {saved.label} weights written for {saved.family} (they load on "
        f"{', '.join(saved.runs_on)}); this load is on {device.torch_device} ({device.name}), whose kernels "
        f"cannot read that layout. Fix: load it on a {saved.family} device (device='{saved.runs_on[0]}'), "
        f"or write a checkpoint for this machine from the full-precision one: xpukit merge BASE ADAPTER OUT "
        f"--quantize {bits} --for {device.backend}."
    )


def default_family(machine: MachineFacts) -> str:
    """This machine's device family: its first CUDA or XPU device's, else ``cpu``."""
    for device in machine.devices:
        if device.backend in {"cuda", "xpu"}:
            return str(device.backend)
    return "cpu"


def check_writer_device(saved: SavedFormat, machine: MachineFacts) -> None:
    """Refuse, before any weight is read, a format whose packing needs a device this machine lacks.

    Raises:
        InvalidRequestError: int4 for CUDA or XPU asked on a machine without such a device.
    """
    if saved.write_on == "cpu" or any(d.backend == saved.write_on for d in machine.devices):
        return
    raise InvalidRequestError(
        f"--quantize int4 --for {saved.family}: torchao packs {saved.label} weights with torch's "
        f"{saved.write_on} operator only, and this machine has no {saved.write_on} device. Nothing was "
        f"written. Fix: run the merge on a machine with a {saved.write_on} device; or --quantize int8 "
        "(one format that every family loads, written anywhere); or --for cpu (full precision, "
        "quantized at each load)."
    )


def check_merge_disk(
    *,
    out: str,
    full_bytes: int,
    four_bit_bytes: int,
    quantizable: int,
    saved: SavedFormat | None,
    free: int | None,
) -> int:
    """The bytes a merge writes (the full-precision weights, and the quantized ones when they are
    written from those), checked against the free space where ``out`` goes; returns the need.

    Args:
        full_bytes: the weights in the merge's dtype; ``four_bit_bytes`` with the quantizable ones at
            4 bits; ``quantizable`` the elements a quantization takes (the model's facts' sizes).
        free: the free bytes where ``out`` goes, ``None`` when unknown (not checked).

    Raises:
        PlanError: too little free disk; nothing is written.
    """
    need = full_bytes
    if saved is not None and saved.on_disk:
        need += bytes_at_bits(four_bit_bytes, quantizable, _DISK_BITS[saved.kind])
    if free is not None and free < need + DISK_MARGIN:
        what = (
            "the merged weights and their quantized copy"
            if saved is not None and saved.on_disk
            else ("the merged weights")
        )
        raise PlanError(
            f"merge to {out!r}: {what} need about {need / 2**20:.1f} MiB (+ {DISK_MARGIN // 2**20} MiB kept "
            f"free) and the disk has {free / 2**20:.1f} MiB free. Nothing was written. Fix: free space, "
            "or write OUT on another disk."
        )
    return need
