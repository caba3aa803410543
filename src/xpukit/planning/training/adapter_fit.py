"""Does a trained LoRA adapter belong to this base? Its tensors against the base's modules, no weights read.

:func:`check_adapter` takes the adapter's ``adapter_model.safetensors`` header (names, shapes; read
with its other files before planning, :mod:`xpukit.sources.adapter_files`) and builds the base on
the meta device; every ``lora_A`` must match its module's input size, every
``lora_B`` its output size, and every other saved tensor (``modules_to_save``) the base's parameter
of that name. A tensor that fits nothing is refused, because peft would either fail on it (after the
base's weights are loaded, with torch's size-mismatch dump) or drop it; a ``base_model_name_or_path``
naming another model while every shape fits is only a warning (docs/merging.md "Merge (`merge=`)").
Every path that takes a trained adapter (``lora=DIR`` for inference, ``trainable=True``,
``merge=``) is checked this way by :func:`xpukit.planning.plan.plan_load` before any weight is read
(:func:`check_saved_adapter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.training.base_record import BaseRecord, parse_record

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig, PreTrainedModel

    from xpukit.planning.training.lora_request import LoraRequest

__all__ = ["AdapterCheck", "SavedAdapter", "check_adapter", "check_saved_adapter"]

_LORA_SUFFIXES = {  # peft's saved tensor name → which side of the base module's weight it must match
    "lora_A.weight": "in",
    "lora_B.weight": "out",
    "lora_embedding_A": "in",
    "lora_embedding_B": "out",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterCheck:
    """What comparing an adapter with the base found: one line, and the warnings (a mismatch
    ``force=True`` let through, a ``base_model_name_or_path`` naming another model)."""

    summary: str
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedAdapter:
    """A trained adapter checked against the base (:func:`check_saved_adapter`): the check's line
    (``None`` for no LoRA or new adapters), its base record, and the check's warnings."""

    check: str | None
    record: BaseRecord | None
    warnings: tuple[str, ...] = ()


def check_adapter(
    adapter: str,
    saved: dict[str, Any],
    tensors: dict[str, Any] | None,
    *,
    config: PreTrainedConfig,
    model_class: type[PreTrainedModel] | str | None,
    base: str,
    force: bool,
    merging: bool = True,
    trust_remote_code: bool = False,
) -> AdapterCheck:
    """Compare the adapter's tensors with the base's modules; what was found, in one line, and the
    warnings.

    The adapter's ``lora_A``/``lora_B`` shapes come from its safetensors header (``tensors``, read
    with the adapter's files, ``None`` without the file), the base's module shapes from the model built
    on the meta device; no weight is read.

    ``merging``: the adapter is to be merged (the messages say merge and ``xpukit merge --force``),
    else loaded (for inference or to train further).

    Raises:
        InvalidRequestError: a tensor names a module the base lacks or has another shape (unless
            ``force``; then it is a warning on the plan).
    """
    if tensors is None:
        return AdapterCheck(
            summary="adapter_model.safetensors not found: shapes not checked here (peft checks them at load)"
        )
    problems = _problems(tensors, config, model_class, trust_remote_code)
    checked = len(tensors) - len(problems)
    named = str(saved.get("base_model_name_or_path") or "")
    other_name = bool(named) and not _same_model(named, base)
    name_note = f"its base_model_name_or_path is {named!r}, not {base!r}" if other_name else ""
    if problems:
        distinct = list(dict.fromkeys(problems))  # lora_A and lora_B of a missing module say the same
        listed = "; ".join(distinct[:4]) + (f"; and {len(distinct) - 4} more" if len(distinct) > 4 else "")
        message = (
            f"lora={adapter!r} does not fit the base {base!r}: {len(problems)} of its {len(tensors)} "
            f"tensors do not match the base's modules ({listed})" + (f"; {name_note}" if name_note else "")
        )
        if not force:
            verb, how = ("merging", "merge") if merging else ("loading", "load")
            cli = " (xpukit merge --force)" if merging else ""
            raise InvalidRequestError(
                f"{message}. The adapter belongs to another base: {verb} it would fail or drop those "
                f"weights. Fix: pass the base it was trained on{f' ({named!r})' if named else ''}, or "
                f"force=True{cli} to {how} what peft can."
            )
        return AdapterCheck(
            summary=f"force=True: {len(problems)} tensors do not match the base (see warnings)",
            warnings=(f"force=True: {message}",),
        )
    summary = f"all {checked} tensors match the base's module shapes"
    if other_name:
        warning = (
            f"lora={adapter!r}: {name_note}; every tensor shape matches, so it is "
            f"{'merged' if merging else 'loaded'} (a local path and a Hub id of the same model differ "
            "legitimately)"
        )
        return AdapterCheck(summary=f"{summary}; {name_note} (a warning only)", warnings=(warning,))
    return AdapterCheck(summary=summary)


def check_saved_adapter(
    request: LoraRequest | None,
    *,
    config: PreTrainedConfig,
    model_class: type[PreTrainedModel] | str | None,
    base: str,
    force: bool,
    merging: bool,
    trust_remote_code: bool = False,
) -> SavedAdapter:
    """For ``lora=`` a trained adapter directory: :func:`check_adapter`'s line and warnings, and its
    base record.

    Nothing (``check`` and ``record`` ``None``) for no LoRA or new adapters. Uses the adapter's
    safetensors header and base record as read, never a weight.

    Raises:
        InvalidRequestError: the adapter does not fit the base (unless ``force``), or its base
            record is malformed.
    """
    if request is None or request.kind != "adapter" or request.files is None:
        return SavedAdapter(check=None, record=None)
    files = request.files
    check = check_adapter(
        files.path,
        request.config,
        files.tensors,
        config=config,
        model_class=model_class,
        base=base,
        force=force,
        merging=merging,
        trust_remote_code=trust_remote_code,
    )
    record = None if files.record is None else parse_record(files.record, files.record_path)
    return SavedAdapter(check=check.summary, record=record, warnings=check.warnings)


def _problems(
    tensors: dict[str, Any],
    config: PreTrainedConfig,
    model_class: type[PreTrainedModel] | str | None,
    trust_remote_code: bool,
) -> list[str]:
    """What does not fit, one line per tensor; the meta-device model is gone when this returns (an
    error raised afterwards keeps no model alive in its traceback)."""
    from xpukit.planning.model.classes import build_meta_model

    _, model = build_meta_model(config, model_class, trust_remote_code=trust_remote_code)
    modules = dict(model.named_modules())
    found = [_tensor_problem(key, info, modules) for key, info in sorted(tensors.items())]
    return [problem for problem in found if problem is not None]


def _tensor_problem(key: str, info: object, modules: dict[str, torch.nn.Module]) -> str | None:
    """Why one saved adapter tensor does not fit the base's modules, else ``None``."""
    shape = list(info.get("shape", [])) if isinstance(info, dict) else []
    name = key.removeprefix("base_model.model.")
    for suffix, side in _LORA_SUFFIXES.items():
        if name.endswith("." + suffix):
            module_name = name[: -len(suffix) - 1]
            module = modules.get(module_name)
            if module is None:
                return f"{module_name}: no such module in the base"
            sizes = _in_out(module)
            if sizes is None or len(shape) != 2:
                return None  # a module kind xpukit does not size: peft checks it at load
            want = sizes[0] if side == "in" else sizes[1]
            got = shape[1] if side == "in" else shape[0]
            if got != want:
                return f"{key} has shape {shape}, the base's {module_name} has {side}_features {want}"
            return None
    # modules_to_save and other full tensors: the base's parameter of that name must have the shape.
    # A name the base lacks is some other peft tensor (trainable tokens, DoRA magnitudes…): peft checks it.
    module_name, _, param = name.replace(".modules_to_save", "").rpartition(".")
    tensor = getattr(modules.get(module_name), param, None)
    if tensor is not None and hasattr(tensor, "shape") and list(tensor.shape) != shape:
        return f"{key} has shape {shape}, the base's {module_name}.{param} has {list(tensor.shape)}"
    return None


def _in_out(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) sizes of a linear-like or embedding module, from its meta-device attributes."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    if type(module).__name__ == "Conv1D":  # GPT-2: weight [in, out]
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    if hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim"):
        return int(module.num_embeddings), int(module.embedding_dim)
    return None


def _same_model(named: str, base: str) -> bool:
    """Whether two model references plausibly name the same model (path, Hub id, or cache snapshot)."""
    if named == base:
        return True
    try:
        if Path(named).exists() and Path(base).exists():
            return Path(named).resolve() == Path(base).resolve()
    except OSError:
        pass

    def last(text: str) -> str:
        parts = PurePosixPath(text.replace("\\", "/").rstrip("/")).parts
        for part in parts:  # a Hub cache snapshot: .../models--org--name/snapshots/<hash>
            if part.startswith("models--"):
                return part.split("--")[-1].lower()
        return parts[-1].lower() if parts else ""

    return last(named) == last(base)
