"""``xpukit export SOURCE OUT --quantize``: a model's weights quantized once and written to disk.

A ``quantize="4bit"`` (or ``"8bit"``) load of a full-precision checkpoint quantizes every layer as it
loads, in every process (its load times and sizes against the saved checkpoint: docs/export.md "To
another machine").
:func:`save_quantized` does it once: SOURCE (a model folder or Hub id, no adapter) is loaded by
transformers' ``TorchAoConfig`` in the format a quantized load on the device family ``for_family`` takes
(:func:`xpukit.planning.device.saved_quant.saved_format`) and written with ``save_pretrained``
(:func:`xpukit.loading.quantized_checkpoint.write_quantized`), tokenizer included;
``load_for_xpu(out)`` and ``from_pretrained(out)`` then load it without quantizing. With an adapter,
``xpukit merge --quantize`` is the same write after the merge.

Everything that can be refused is refused before any weight is read: no quantization asked, a bad
quantization, dtype or family, a family with no on-disk format (int4 for the CPU), a family whose
device this machine lacks, an OUT that exists, too little disk. The files are written into a hidden
partial folder and renamed into place at the end (:mod:`xpukit._partial`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from xpukit._partial import into_place, writing
from xpukit.errors import InvalidRequestError
from xpukit.loading.quantized_checkpoint import free_bytes, write_quantized
from xpukit.loading.save_merged import (
    MergeResult,
    base_tokenizer,
    check_out,
    checkpoint_dtype,
    quantize_kind,
    quantized_as,
    save_tokenizer,
    saved_for,
)
from xpukit.machine.precision import DTYPES, normalize_dtype
from xpukit.planning.device.saved_quant import check_merge_disk
from xpukit.planning.plan import plan_load

__all__ = ["save_quantized"]


def save_quantized(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    quantize: str,
    for_family: str | None = None,
    dtype: str | None = None,
) -> MergeResult:
    """Quantize ``source``'s weights with torchao for ``for_family`` and write the checkpoint to ``out``.

    Args:
        source: the model's folder or Hub id (offline: from the local cache).
        out: a new or empty folder.
        quantize: ``"int4"`` / ``"int8"`` (or ``"4bit"`` / ``"8bit"``).
        for_family: ``cuda``, ``xpu`` or ``cpu``; default: this machine's (its accelerator's, else
            ``cpu``). int4 for CUDA or XPU is packed by that device's operator: written on such a machine.
        dtype: ``bfloat16`` or ``float16`` (the dtype the weights are quantized from and computed in);
            default: the checkpoint's own.

    Returns:
        What was written (:class:`xpukit.loading.save_merged.MergeResult`, ``quantized`` set).

    Raises:
        InvalidRequestError: a bad quantize, family or dtype; a family with no on-disk format here;
            ``out`` not new or empty, or ``source``'s own folder.
        PlanError: too little free disk for the output.
    """
    start = time.perf_counter()
    target = Path(out)
    check_out(target, source, None)
    kind = quantize_kind(quantize, for_family)
    if kind is None:
        raise InvalidRequestError(
            "export --quantize: no quantization asked. Valid: int4, int8 (or 4bit, 8bit). Fix: pass one."
        )
    chosen, why = _dtype(dtype, source)
    # Decided before any weight is read: the format, the device that writes it, the disk it needs.
    plan = plan_load(source, dtype=chosen)
    saved = saved_for(kind, for_family, plan)
    assert saved is not None  # a quantization was asked
    if not saved.on_disk or saved.config is None:
        dtype_is_why = plan.dtype == "float32" and saved.family != "cpu"  # CPU int4: no format at all
        in_bf16 = "--dtype bfloat16 (the checkpoint is float32), " if dtype_is_why else ""
        raise InvalidRequestError(
            f"export --quantize {quantize} for {saved.family}: {saved.reason}. Without an on-disk format "
            f"the weights would be written as they are. Fix: {in_bf16}--quantize int8 (written for every "
            f"family), or load SOURCE with load_for_xpu(..., quantize={kind!r}), which quantizes it as it "
            "loads."
        )
    facts = plan.model_facts
    four_bit = facts.weight_bytes[f"4bit/{plan.dtype}"]
    check_merge_disk(
        out=str(target),
        full_bytes=0,  # nothing in full precision is written: SOURCE is read as it is
        four_bit_bytes=four_bit,
        quantizable=facts.quantizable_numel,
        saved=saved,
        free=free_bytes(target),
    )
    import transformers

    tokenizer_from = base_tokenizer(source)
    model_class = getattr(transformers, plan.model_class)
    with writing(target) as partial:  # removed on an error, SIGTERM or Ctrl-C; swept if killed
        notes = write_quantized(model_class, Path(os.fspath(source)), partial, saved)
        if tokenizer_from is not None:
            save_tokenizer(tokenizer_from, partial)
        into_place(partial, target)  # an empty target: check_out refused anything else
    return MergeResult(
        out=target,
        files=tuple(sorted(p.name for p in target.iterdir())),
        dtype=plan.dtype,
        dtype_reason=why,
        tokenizer_from=tokenizer_from,
        plan=plan,
        quantize=kind,
        dtype_from="asked" if dtype is not None else "checkpoint",
        quantized=quantized_as(saved),
        notes=tuple(notes),
        seconds=time.perf_counter() - start,
    )


def _dtype(asked: str | None, source: str | os.PathLike[str]) -> tuple[str, str]:
    """The dtype the weights are quantized from: the one asked, else the checkpoint's own; why."""
    if asked is None:
        return checkpoint_dtype(source)
    chosen = normalize_dtype(asked)
    if chosen is None or chosen == "float32":
        raise InvalidRequestError(
            f"--dtype {asked!r} is not a dtype a quantized checkpoint is written from. Valid: "
            f"{', '.join(d for d in DTYPES if d != 'float32')}. Default: the checkpoint's own dtype."
        )
    return chosen, "asked (--dtype)"
