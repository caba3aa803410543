"""``xpukit merge``'s engine: a LoRA adapter merged into its base and written as a full checkpoint.

:func:`save_merged` loads ``load_for_xpu(base, lora=adapter, merge=...)`` in the dtype the adapter
was trained in, as the base record beside it says (the plan's dtype decision), so the merged model
is the trained one; an adapter without a record merges in the dtype the base checkpoint declares
(its config's ``dtype``, or ``torch_dtype`` in older files); ``dtype=`` overrides both
(docs/merging.md "Merging an adapter"). It writes the merged model with transformers'
``save_pretrained`` (safetensors, config, generation config) plus the tokenizer, from the adapter
directory when it has one (tokens added in training), else from the base. ``quantize="int4"`` /
``"int8"`` writes torchao's quantized weights in the format the device family ``for_family`` runs
(:mod:`xpukit.planning.device.saved_quant`, docs/export.md "To another machine"), which
``load_for_xpu(out)`` and ``from_pretrained`` load without quantizing again; where that family has
no on-disk format (int4 for the CPU) the weights stay in full precision and config.json records
that they load quantized (``xpukit_quantize``). The output's size is checked against the free disk
before any weight is read. Everything is
written to a temporary sibling of ``out`` and renamed into place at the end (:mod:`xpukit._partial`),
so a failure, SIGTERM or Ctrl-C leaves no half-written checkpoint, and one left by a killed merge
is removed by the next write into the same folder.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from xpukit._partial import into_place, writing
from xpukit.errors import InvalidRequestError
from xpukit.machine.precision import DTYPES, normalize_dtype
from xpukit.planning.device.quantization import RECORDED_QUANTIZE_KEY
from xpukit.planning.device.saved_quant import (
    SavedFormat,
    check_merge_disk,
    check_writer_device,
    default_family,
    saved_format,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from xpukit.planning.loadplan import LoadPlan
    from xpukit.planning.request import DeviceArg, MergeArg

__all__ = [
    "MergeResult",
    "QuantizedAs",
    "base_tokenizer",
    "check_out",
    "checkpoint_dtype",
    "merge_dtype",
    "quantize_kind",
    "quantized_as",
    "save_merged",
    "save_tokenizer",
    "saved_for",
    "tokenizer_source",
]

# How a quantized merge was written (``MergeResult.quantized``; "for" is a keyword: functional form).
QuantizedAs = TypedDict(
    "QuantizedAs", {"format": str, "for": str, "runs_on": list[str], "on_disk": bool, "reason": str}
)

# --quantize values -> the quantize= a load without adapters takes from the record.
MERGE_QUANTIZE = {"int4": "4bit", "int8": "8bit", "4bit": "4bit", "8bit": "8bit"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True, kw_only=True)
class MergeResult:
    """What :func:`save_merged` wrote.

    Attributes:
        out: the merged checkpoint's directory.
        files: the files in it.
        dtype: the dtype its weights are stored in; ``dtype_reason`` why.
        dtype_from: who chose it: ``"asked"`` (``dtype=``), ``"record"`` (the dtype the adapter was
            trained in, as its base record says) or ``"checkpoint"`` (no record: the base's own dtype).
        tokenizer_from: the directory the tokenizer was copied from, or ``None`` when neither had one.
        plan: the plan the merge carried out (``model.xpukit_plan``).
        quantize: the quantization asked (``4bit``/``8bit``), or ``None``.
        quantized: how it was written: the format, the family it is for, the families that load it,
            whether the weights are quantized on disk (else recorded, quantized at each load), why;
            ``None`` without ``quantize``.
        seconds: the time it all took (the load, the merge and the writing).
    """

    out: Path
    files: tuple[str, ...]
    dtype: str
    dtype_reason: str
    tokenizer_from: str | None
    plan: LoadPlan = field(repr=False)
    quantize: str | None = None
    seconds: float = 0.0
    dtype_from: str = "asked"
    quantized: QuantizedAs | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """A JSON-able dict (``xpukit merge --json``)."""
        return {
            "out": str(self.out),
            "files": list(self.files),
            "dtype": self.dtype,
            "dtype_reason": self.dtype_reason,
            "dtype_from": self.dtype_from,
            "tokenizer_from": self.tokenizer_from,
            "quantize": self.quantize,
            "quantized": self.quantized,
            "notes": list(self.notes),
            "seconds": round(self.seconds, 2),
            "plan": self.plan.to_dict(),
        }


def checkpoint_dtype(base: str | os.PathLike[str]) -> tuple[str, str]:
    """The dtype a base checkpoint declares, and where that was read (float32 when it declares none)."""
    from xpukit.planning.model.reference_models import BUILTIN_SHAPES
    from xpukit.sources.model_config import read_config

    config, _, name, _ = read_config(base, {}, shapes=BUILTIN_SHAPES)
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = normalize_dtype(declared) if declared is not None else None
    if dtype is None:
        return (
            "float32",
            f"{name}'s config declares no float dtype ({declared!r}): float32, from_pretrained's default",
        )
    return dtype, f"the base checkpoint's own dtype ({name}'s config.json says {dtype})"


def save_merged(
    base: str | os.PathLike[str],
    adapter: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    device: DeviceArg = None,
    merge: MergeArg = True,
    force: bool = False,
    quantize: str | None = None,
    for_family: str | None = None,
) -> MergeResult:
    """Merge ``adapter`` into ``base`` and write the merged checkpoint to ``out``.

    Args:
        base: the base model's directory or Hub id (offline: from the local cache).
        adapter: the adapter directory (``PeftModel.save_pretrained``).
        out: a new or empty directory.
        dtype: ``bfloat16``, ``float16`` or ``float32``; default: the dtype the adapter was trained in,
            as its base record says (``xpukit_base.json``), so the merged model is the trained one;
            without a record, the base checkpoint's own.
        device: where to merge (default: the plan's device when the model fits, else the CPU).
        merge: ``True`` / ``"dequantized"`` / ``"original"`` (docs/merging.md "Merging an adapter").
        force: merge an adapter whose tensors do not all fit the base (a warning on the plan).
        quantize: ``"int4"`` / ``"int8"`` (or ``"4bit"`` / ``"8bit"``): write torchao's quantized
            weights for ``for_family`` (docs/export.md "To another machine"); default: full precision.
        for_family: ``cuda``, ``xpu`` or ``cpu``: the device family the quantized checkpoint is for;
            default: this machine's (its accelerator's, else ``cpu``).

    Raises:
        InvalidRequestError: ``out`` is not new or empty, or is the base or adapter directory; a bad
            dtype, quantize or family; int4 for a family whose device this machine lacks; and every
            error of :func:`xpukit.load_for_xpu` with ``merge=``.
        PlanError: too little free disk for the output.
    """
    start = time.perf_counter()
    target = Path(out)
    check_out(target, base, adapter)
    kind = quantize_kind(quantize, for_family)
    chosen, why, dtype_from = merge_dtype(dtype, base, adapter)
    from xpukit.loading.load import load_for_xpu
    from xpukit.loading.quantized_checkpoint import free_bytes
    from xpukit.planning.plan import plan_load

    # Decided before any weight is read: the format, the device that writes it, the disk it needs.
    planned = plan_load(base, lora=os.fspath(adapter), merge=merge, force=force, dtype=chosen, device=device)
    saved = saved_for(kind, for_family, planned)
    facts = planned.model_facts
    check_merge_disk(
        out=str(target),
        full_bytes=facts.weight_bytes[planned.dtype],
        four_bit_bytes=facts.weight_bytes[f"4bit/{planned.dtype}"],
        quantizable=facts.quantizable_numel,
        saved=saved,
        free=free_bytes(target),
    )
    model = load_for_xpu(base, lora=os.fspath(adapter), merge=merge, force=force, dtype=chosen, device=device)
    plan = model.xpukit_plan
    if dtype_from == "record":  # the plan's dtype decision took the recorded dtype, and says why
        chosen, why = plan.dtype, plan.decision("dtype").reason
    tokenizer_from = tokenizer_source(Path(adapter), base)
    notes: list[str] = []
    with writing(target) as partial:  # removed on an error, SIGTERM or Ctrl-C; swept if killed
        try:
            notes += _write_weights(model, partial, kind, saved)
        finally:
            del model  # an error must not keep the merged weights alive in its traceback
        if tokenizer_from is not None:
            save_tokenizer(tokenizer_from, partial)
        into_place(partial, target)  # an empty target: check_out refused anything else
    files = tuple(sorted(p.name for p in target.iterdir()))
    return MergeResult(
        out=target,
        files=files,
        dtype=chosen,
        dtype_reason=why,
        tokenizer_from=tokenizer_from,
        plan=plan,
        quantize=kind,
        dtype_from=dtype_from,
        quantized=None if saved is None else quantized_as(saved),
        notes=tuple(notes),
        seconds=time.perf_counter() - start,
    )


def check_out(target: Path, base: str | os.PathLike[str], adapter: str | os.PathLike[str] | None) -> None:
    """OUT is a new or empty directory, neither the base's nor the adapter's."""
    for name, where in (("the base", base), ("the adapter", adapter)):
        if where is None or not (Path(where).exists() and target.exists()):
            continue
        if target.resolve() == Path(where).resolve():
            raise InvalidRequestError(f"OUT={str(target)!r} is {name}'s directory. Fix: write to a new one.")
    if target.exists() and not target.is_dir():
        raise InvalidRequestError(
            f"OUT={str(target)!r} is a file, not a directory: the merged model is a directory of files. "
            "Fix: pass a new directory (or remove that file first)."
        )
    if target.exists() and any(target.iterdir()):
        raise InvalidRequestError(
            f"OUT={str(target)!r} already exists and is not an empty directory. Fix: pass a new directory, "
            "or remove that one first."
        )


def quantize_kind(quantize: str | None, for_family: str | None) -> str | None:
    if quantize is None:
        if for_family is not None:
            raise InvalidRequestError(
                f"--for {for_family!r} without --quantize: the family is that of a quantized checkpoint. "
                "Fix: add --quantize int4 or int8, or leave --for out (full precision loads anywhere)."
            )
        return None
    kind = MERGE_QUANTIZE.get(str(quantize).strip().lower())
    if kind is None:
        raise InvalidRequestError(
            f"--quantize {quantize!r} is not a quantization a merged checkpoint is written in. Valid: "
            "int4, int8 (or 4bit, 8bit). Default: none (the checkpoint is written in full precision)."
        )
    return kind


def saved_for(kind: str | None, for_family: str | None, plan: LoadPlan) -> SavedFormat | None:
    """The quantized format for the family asked (default: this machine's), its writer checked here."""
    if kind is None:
        return None
    from xpukit.planning.device.serve_quant import torchao_version

    family = for_family if for_family is not None else default_family(plan.machine)
    saved = saved_format(kind, str(family).strip().lower(), plan.dtype, torchao_version())
    check_writer_device(saved, plan.machine)
    return saved


def _write_weights(
    model: PreTrainedModel, partial: Path, kind: str | None, saved: SavedFormat | None
) -> list[str]:
    """The merged weights into ``partial``: as they are, quantized by torchao, or with the record."""
    if saved is None or not saved.on_disk:
        if kind is not None:
            setattr(model.config, RECORDED_QUANTIZE_KEY, kind)  # read back by plan_load
        model.save_pretrained(partial)
        return [saved.reason] if saved is not None else []
    from xpukit.loading.quantized_checkpoint import write_quantized

    full = partial / ".full-precision"
    model.save_pretrained(full)
    model_class = type(model)
    model.to("meta")  # the merged weights are on disk: free their memory before quantizing
    notes = write_quantized(model_class, full, partial, saved)
    shutil.rmtree(full)
    return notes


def merge_dtype(
    dtype: str | None, base: str | os.PathLike[str], adapter: str | os.PathLike[str]
) -> tuple[str, str, str]:
    """The dtype to merge in (``"auto"``: the plan's, which is the recorded one), why, and from where:
    ``"asked"`` (``dtype=``), ``"record"`` (the dtype the adapter trained in, as its base record says)
    or ``"checkpoint"`` (no record: the base checkpoint's own dtype)."""
    from xpukit.loading.adapter_record import read_base_record
    from xpukit.planning.training.base_record import RECORD_FILE

    if dtype is not None:
        asked = normalize_dtype(dtype)
        if asked not in DTYPES:
            raise InvalidRequestError(
                f"--dtype {dtype!r} is not a dtype a merged checkpoint is written in. Valid: "
                f"{', '.join(DTYPES)}. Default: the dtype the adapter was trained in, as its {RECORD_FILE} "
                "records, else the base checkpoint's own dtype."
            )
        return str(asked), "asked (--dtype)", "asked"
    if read_base_record(os.fspath(adapter)) is not None:
        return "auto", "", "record"
    own, why = checkpoint_dtype(base)
    return (
        own,
        f"{why}; no {RECORD_FILE} records the dtype the adapter trained in",
        "checkpoint",
    )


def save_tokenizer(source: str, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"The tokenizer in {source!r} cannot be read ({type(exc).__name__}: {exc}); nothing was written. "
            "Fix: repair or remove its tokenizer files, then merge again."
        ) from None
    tokenizer.save_pretrained(out)


def quantized_as(saved: SavedFormat) -> QuantizedAs:
    """How a quantized checkpoint was written (``MergeResult.quantized``)."""
    return {
        "format": saved.label,
        "for": saved.family,
        "runs_on": list(saved.runs_on),
        "on_disk": saved.on_disk,
        "reason": saved.reason,
    }


def tokenizer_source(adapter: Path, base: str | os.PathLike[str]) -> str | None:
    """The adapter directory when it holds a tokenizer (tokens added in training), else the base's."""
    if any((adapter / name).is_file() for name in _TOKENIZER_FILES):
        return str(adapter)
    return base_tokenizer(base)


def base_tokenizer(base: str | os.PathLike[str]) -> str | None:
    """``base`` when it has a tokenizer (a folder holding one, or a Hub id whose tokenizer loads)."""
    local = Path(str(base))
    if local.is_dir():
        return str(local) if any((local / name).is_file() for name in _TOKENIZER_FILES) else None
    try:  # a Hub id: the tokenizer from the local cache (or the Hub, bounded by the plan's guard)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(base))
    except (OSError, ValueError):
        return None
    return str(base)
