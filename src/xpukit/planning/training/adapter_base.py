"""A trained adapter loaded on the base it trained on: the quantization and dtype its record names.

An adapter reproduces the model it was trained in only on that model's base weights: a QLoRA
adapter put on the full-precision base is another model (docs/training.md "Loading an adapter"
measures how far). So a load with ``lora=DIR`` (to run it, or ``trainable=True`` to train it
further) follows the adapter's base record (:mod:`xpukit.planning.training.base_record`): with
``quantize=`` left out, the base is held as the record says (bitsandbytes 4-bit or 8-bit with the
recorded settings, or full precision), and with ``dtype=`` left out it computes in the recorded dtype.
A different ``quantize=`` or ``dtype=`` is done as asked, with a warning that the model is not the
trained one. ``merge=`` follows the record its own way (:mod:`xpukit.planning.training.merge`).
Pure: a function of the record and the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpukit.planning.device.quantization import QuantRequest
from xpukit.planning.training.base_record import BaseRecord, held_as

__all__ = ["AdapterBase", "adapter_base"]

_SECTION = 'docs/training.md "Loading an adapter"'


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterBase:
    """How the base of a trained adapter is held for this load.

    Attributes:
        quant: the quantization request to plan with (the record's when ``quantize=`` was left out).
        trained: ``(dtype, record path)`` for the dtype decision, or ``None`` without a record.
        followed: the record decided the quantization (``quantize=`` was left out).
        warnings: what makes this load differ from the trained model.
    """

    quant: QuantRequest
    trained: tuple[str, str] | None
    followed: bool
    warnings: tuple[str, ...]


def adapter_base(
    record: BaseRecord | None,
    quant: QuantRequest,
    *,
    quantize: object,
    dtype: str,
    trainable: bool,
    pre_quantized: str | None,
) -> AdapterBase:
    """The base a trained adapter is loaded on (not for ``merge=``, which plans its own).

    Args:
        record: the adapter's base record, or ``None`` (an adapter saved by another tool).
        quant: ``quantize=`` as parsed.
        quantize: ``quantize=`` as given (``None``: left out), for messages.
        dtype: ``dtype=`` as normalised (``"auto"``: left out).
        trainable: ``trainable=True`` (a quantization mismatch is then the adapters stage's warning).
        pre_quantized: the checkpoint's own quantization method, when it is already quantized.
    """
    if record is None:
        return AdapterBase(quant=quant, trained=None, followed=False, warnings=())
    chosen, held_warning = _held_as_recorded(record, quant, quantize, trainable, pre_quantized, dtype)
    dtype_warning = None
    if dtype != "auto" and dtype != record.dtype:
        dtype_warning = (
            f"dtype={dtype!r} with lora={_adapter(record)!r}: the adapter trained computing in "
            f"{record.dtype}; in {dtype} the model is close to, not equal to, the trained one ({_SECTION}). "
            "Fix: leave "
            "dtype= out to compute as it trained"
        )
    return AdapterBase(
        quant=chosen,
        trained=(record.dtype, record.path),
        followed=quantize is None,
        warnings=tuple(w for w in (held_warning, dtype_warning) if w is not None),
    )


def _held_as_recorded(
    record: BaseRecord,
    quant: QuantRequest,
    quantize: object,
    trainable: bool,
    pre_quantized: str | None,
    dtype: str,
) -> tuple[QuantRequest, str | None]:
    """The quantization request to plan with (the record's where it applies), and the warning when
    the base is not held as the adapter trained."""
    recorded = record.load_quantization(dtype)
    if quantize is None:
        if recorded is not None:
            followed = QuantRequest(
                kind=record.quantization,
                bnb_asked=True,
                recorded=recorded,
                origin=f"as the adapter trained ({record.path}: its base was held {record.held()})",
            )
            return followed, None
        if record.quantization is not None and pre_quantized is None:
            return quant, (
                f"{record.path} says the adapter trained with its base held {record.held()}; xpukit "
                "rebuilds only a bitsandbytes 4-bit or 8-bit base, so the adapter goes on the "
                f"full-precision weights: not exactly the trained model ({_SECTION})"
            )
        return quant, None
    if quant.kind == record.quantization and recorded is not None and quant.user_config is None:
        as_given = QuantRequest(
            kind=quant.kind, bnb_asked=True, recorded=recorded, origin="given, as recorded"
        )
        return as_given, None
    if not trainable and _kind(quant) != record.quantization:
        return quant, (
            f"quantize={quantize!r} with lora={_adapter(record)!r}: the adapter trained with its base held "
            f"{record.held()}, and this load holds it {_held(quant)}: not the trained model ({_SECTION}). "
            "Fix: leave quantize= out to load it as it trained"
        )
    return quant, None


def _kind(quant: QuantRequest) -> str | None:
    if quant.kind == "other":
        return quant.method or "other"
    return quant.kind


def _held(quant: QuantRequest) -> str:
    kind = _kind(quant)
    return "as quantize='auto' decides" if kind == "auto" else held_as(kind)


def _adapter(record: BaseRecord) -> str:
    """The adapter directory, from its record file's path."""
    path = record.path.replace("\\", "/")
    return path.rsplit("/", 1)[0] if "/" in path else "."
