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
    warnings: list[str] = []
    chosen, followed = quant, False
    recorded = record.load_quantization(dtype)
    if quantize is None:
        followed = True
        if recorded is not None:
            chosen = QuantRequest(
                kind=record.quantization,
                bnb_asked=True,
                recorded=recorded,
                origin=f"as the adapter trained ({record.path}: its base was held {record.held()})",
            )
        elif record.quantization is not None and pre_quantized is None:
            warnings.append(
                f"{record.path} says the adapter trained with its base held {record.held()}; xpukit "
                "rebuilds only a bitsandbytes 4-bit or 8-bit base, so the adapter goes on the "
                f"full-precision weights: not exactly the trained model ({_SECTION})"
            )
    elif quant.kind == record.quantization and recorded is not None and quant.user_config is None:
        chosen = QuantRequest(kind=quant.kind, bnb_asked=True, recorded=recorded, origin="given, as recorded")
    elif not trainable and _kind(quant) != record.quantization:
        warnings.append(
            f"quantize={quantize!r} with lora={_adapter(record)!r}: the adapter trained with its base held "
            f"{record.held()}, and this load holds it {_held(quant)}: not the trained model ({_SECTION}). "
            "Fix: leave quantize= out to load it as it trained"
        )
    if dtype != "auto" and dtype != record.dtype:
        warnings.append(
            f"dtype={dtype!r} with lora={_adapter(record)!r}: the adapter trained computing in "
            f"{record.dtype}; in {dtype} the model is close to, not equal to, the trained one ({_SECTION}). "
            "Fix: leave "
            "dtype= out to compute as it trained"
        )
    return AdapterBase(
        quant=chosen, trained=(record.dtype, record.path), followed=followed, warnings=tuple(warnings)
    )


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
