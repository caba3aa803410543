"""``merge=``: a trained LoRA adapter merged into full-precision base weights, planned before loading.

:func:`parse_merge` checks the request against the other arguments (a trained adapter path, no
``quantize=``, one device); :func:`plan_merge` decides where the merge runs and into which weights,
as the plan's ``merge`` decision, after
:func:`xpukit.planning.training.adapter_fit.check_adapter` has compared the adapter with the base.

The rules (docs/merging.md "Merge (`merge=`)", the measurements in docs/merging.md "Merging an
adapter"):

- ``merge=True`` merges into the base as 4-bit training saw it (``"dequantized"``: the
  base quantised with xpukit's ``quantize="4bit"`` config, nf4 + double quantisation, and
  dequantised with bitsandbytes' own ``dequantize_4bit``), which reproduces a QLoRA-trained model;
  ``merge="original"`` merges into the checkpoint's own weights, right for an adapter trained on the
  full-precision base. peft's files do not say which base an adapter trained on; the record xpukit
  writes beside the adapters it trains does (:mod:`xpukit.planning.training.base_record`), and
  ``merge=True`` follows it. An adapter without one gets ``"dequantized"`` and a warning naming
  ``merge="original"``; a ``merge=`` given against the record is done as asked, with a warning.
- Never into 4-bit weights: peft's ``merge_and_unload`` on a 4-bit model re-quantises every merged
  weight. ``quantize=`` with ``merge=`` is refused with the fix.
- Where: on the plan's device when the full-precision weights and headroom fit it alone, else on the
  CPU (the merged model stays there); when neither holds them, :class:`PlanError` with the numbers.
- An adapter whose tensors do not fit the base (modules it lacks, other shapes) is refused unless
  ``force=True``; a ``base_model_name_or_path`` that names another model while every shape fits is a
  warning only (a local path and a Hub id of the same model differ legitimately).

Acting on the plan is :mod:`xpukit.loading.merge`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.planning.budgets import format_bytes, usable_memory
from xpukit.planning.device.quantization import bnb_kwargs
from xpukit.planning.training.base_record import RECORD_FILE
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.machine.facts import DeviceFacts, MachineFacts
    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.training.base_record import BaseRecord
    from xpukit.planning.training.lora_request import LoraRequest
    from xpukit.planning.vocabulary import MemoryEstimate

__all__ = [
    "DEFAULT_MERGE_BASE",
    "MERGE_BASES",
    "MergePlan",
    "MergeRequest",
    "PlanFields",
    "parse_merge",
    "plan_merge",
]

# "dequantized": measured on the CPU (bench/bench_merge.py, docs/merging.md "Merging an adapter"),
# merging a QLoRA adapter into the dequantised 4-bit base reproduces the trained 4-bit + adapter model
# to float32 rounding, while the original weights move every logit by the base's quantisation error.
MERGE_BASES = ("dequantized", "original")
DEFAULT_MERGE_BASE = "dequantized"
_WHY_BASE = {
    "dequantized": "the base as 4-bit training saw it: quantised with the recorded 4-bit settings, else "
    "xpukit's quantize='4bit' (nf4, double quantisation), and dequantised by bitsandbytes, so the "
    "merged model computes what the trained 4-bit + adapter model computed",
    "original": "the checkpoint's own full-precision weights: right for an adapter trained on the "
    "full-precision base (plain LoRA)",
}
_WHY_NOT_4BIT = (
    "merging into 4-bit weights re-quantises every merged weight (peft's merge_and_unload on a 4-bit "
    'model), which loses part of the adapter (docs/merging.md "Merging an adapter")'
)


class PlanFields(Protocol):
    """What :meth:`MergePlan.plan_changes` reads of a ``LoadPlan`` (the plan sits above this module)."""

    @property
    def decisions(self) -> tuple[Decision, ...]: ...
    @property
    def attn_implementation(self) -> str: ...
    @property
    def attention_kernel(self) -> str | None: ...
    @property
    def model_facts(self) -> ModelFacts: ...
    @property
    def use_kernels(self) -> bool: ...
    @property
    def warnings(self) -> tuple[str, ...]: ...
    @property
    def decode(self) -> object | None: ...
    @property
    def machine(self) -> MachineFacts: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeRequest:
    """What ``merge=`` asked for: the weights to merge into (``force=`` goes to the adapter check)."""

    base: str  # "dequantized" | "original"
    given: bool  # the user named the base (merge="original"), rather than merge=True


@dataclass(frozen=True, kw_only=True, slots=True)
class MergePlan:
    """Where and how the adapter is merged (:func:`plan_merge`).

    Attributes:
        base: ``"dequantized"`` or ``"original"`` (:data:`MERGE_BASES`).
        device: the torch device the merge runs on and the merged model stays on.
        dtype: the dtype the base is loaded in, merged in, and the merged model has.
        adapter: the adapter directory.
        quantization_config: for ``"dequantized"``, the ``BitsAndBytesConfig`` keywords the base is
            quantised with before it is dequantised (the dtype as a name); ``None`` otherwise.
        moved_to_cpu: the plan's device was too small (or cannot run bitsandbytes), so the merge runs
            on the CPU.
        adapter_check: what comparing the adapter with the base found.
        decision: the plan's ``merge`` decision.
        placement_reason: why the merge runs on ``device``.
        base_from: who chose ``base``: ``"asked"`` (``merge="original"`` …), ``"record"`` (the
            adapter's base record) or ``"default"`` (``merge=True`` and no record).
        warning: what to know about that choice (no record; a choice against the record), shown at
            the top of the plan; also among the plan's warnings.
    """

    base: str
    device: str
    dtype: str
    adapter: str
    quantization_config: dict[str, Any] | None
    moved_to_cpu: bool
    adapter_check: str
    decision: Decision
    placement_reason: str
    base_from: str = "asked"
    warning: str | None = None

    def describe(self) -> str:
        """One line: what is merged into what, where."""
        into = "the dequantised 4-bit base" if self.base == "dequantized" else "the original weights"
        why = {"record": f" (as its {RECORD_FILE} says)", "default": " (the default: no record)"}
        return (
            f"{self.adapter} merged into {into}{why.get(self.base_from, '')} on {self.device} in {self.dtype}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "base": self.base,
            "device": self.device,
            "dtype": self.dtype,
            "adapter": self.adapter,
            "quantization_config": self.quantization_config,
            "moved_to_cpu": self.moved_to_cpu,
            "adapter_check": self.adapter_check,
            "base_from": self.base_from,
            "warning": self.warning,
            "describe": self.describe(),
        }

    def plan_changes(self, plan: PlanFields) -> dict[str, Any]:
        """The fields of a ``LoadPlan`` that change when it carries this merge out.

        Moved to the CPU: the whole model loads there (``device_map="cpu"``, no ``max_memory``), with
        SDPA attention and no Hub kernels (they have no CPU build), and ``fast_decode`` is dropped.
        """
        decisions = [d for d in plan.decisions if d.name != "merge"]
        changes: dict[str, Any] = {}
        if self.moved_to_cpu:
            why = f"merge: {self.placement_reason}"
            replaced = {
                "device_map": Decision(name="device_map", value="cpu", reason=why),
                "max_memory": Decision(name="max_memory", value=None, reason="not needed: one device"),
            }
            attn = plan.attn_implementation
            if plan.attention_kernel is not None or attn not in {"sdpa", "eager"}:
                attn = "sdpa" if plan.model_facts.supports_sdpa else "eager"
                replaced["attn_implementation"] = Decision(
                    name="attn_implementation",
                    value=attn,
                    reason=f"{why}; kernels for the GPU have no CPU build",
                )
            if plan.use_kernels:
                replaced["use_kernels"] = Decision(name="use_kernels", value=False, reason=why)
            warnings = list(plan.warnings)
            if plan.decode is not None:
                warnings.append(f"fast_decode=True dropped: {why}, where it changes nothing")
                decisions = [d for d in decisions if d.name != "fast_decode"]
            decisions = [replaced.get(d.name, d) for d in decisions]
            changes = {
                "device": plan.machine.cpu,
                "device_map": "cpu",
                "max_memory": None,
                "attn_implementation": attn,
                "attention_kernel": None,
                "use_kernels": False,
                "kernel_config": None,
                "decode": None,
                "warnings": tuple(warnings),
            }
        return {**changes, "decisions": (*decisions, self.decision), "merge": self}


def parse_merge(
    merge: object,
    *,
    lora: object,
    quantize: object,
    quant_kind: str | None,
    force: object,
    strategy: str | None,
    device_map: object,
    max_memory: object,
    trainable: object = False,
) -> MergeRequest | None:
    """Check ``merge=`` (and ``force=``) against the other arguments, before anything is read.

    Raises:
        InvalidRequestError: an unknown ``merge=`` value, no trained adapter path, ``quantize=``, a
            distributed strategy, a device_map / max_memory that splits the model, ``trainable=True``,
            or ``force=True`` without an adapter path.
    """
    if not isinstance(force, bool):
        raise InvalidRequestError(f"force={force!r}: must be True or False.")
    if merge is None or merge is False:
        if force and not isinstance(lora, str | os.PathLike):
            raise InvalidRequestError(
                f"force=True skips the check that a trained LoRA adapter fits the base, but lora={lora!r} "
                "names no adapter directory. Fix: load_for_xpu(base, lora='adapter_dir', force=True) "
                "(with merge=True to merge it), or drop force."
            )
        return None
    if merge is True:
        base, given = DEFAULT_MERGE_BASE, False
    elif isinstance(merge, str) and merge.strip().lower() in MERGE_BASES:
        base, given = merge.strip().lower(), True
    else:
        raise InvalidRequestError(
            f"merge={merge!r} is not understood. Valid: True (into the dequantised 4-bit base, for an "
            "adapter trained with quantize='4bit'), 'dequantized' (the same), 'original' (into the "
            "checkpoint's own weights, for an adapter trained on the full-precision base), or False."
        )
    what = f"merge={merge!r}"
    if lora is None or lora is False:
        raise InvalidRequestError(
            f"{what} merges a trained LoRA adapter, but no lora= was given. Fix: "
            "load_for_xpu(base, lora='path/to/adapter', merge=True), the directory PeftModel.save_pretrained "
            "wrote."
        )
    if not isinstance(lora, str | os.PathLike):
        raise InvalidRequestError(
            f"{what} with lora={lora!r}: new adapters have nothing trained to merge. Fix: train them, save "
            "them with model.save_pretrained('adapter_dir'), then load_for_xpu(base, lora='adapter_dir', "
            "merge=True)."
        )
    if quant_kind is not None:
        raise InvalidRequestError(
            f"{what} with quantize={quantize!r}: xpukit never merges into quantized weights; "
            f"{_WHY_NOT_4BIT}. Fix: drop quantize= (the adapter is merged into full-precision weights); to "
            "serve the merged model in 4-bit, save it (xpukit merge BASE ADAPTER OUT) and load OUT with "
            "quantize='4bit'."
        )
    if trainable is True:
        raise InvalidRequestError(
            f"{what} with trainable=True: a merged model has no adapter left to train. Fix: drop merge= to "
            "train the adapter further, save it, then merge what you saved (xpukit merge BASE ADAPTER OUT)."
        )
    if strategy is not None:
        raise InvalidRequestError(
            f"{what} with strategy={strategy!r}: a merge loads one model to serve or save, not a distributed "
            "training job. Fix: merge once (xpukit merge BASE ADAPTER OUT), then train OUT with strategy=."
        )
    if isinstance(device_map, dict) or max_memory is not None:
        split = "device_map=" if isinstance(device_map, dict) else "max_memory="
        raise InvalidRequestError(
            f"{what} with {split}: the merge needs the whole model on one device and is placed by fit "
            "(the device when it fits, else the CPU). Fix: drop it, and pass device= to choose the device."
        )
    return MergeRequest(base=base, given=given)


def plan_merge(
    request: MergeRequest,
    *,
    lora_request: LoraRequest,
    memory: MemoryEstimate,
    main: DeviceFacts,
    machine: MachineFacts,
    facts: ModelFacts,
    dtype: str,
    adapter_check: str,
    record: BaseRecord | None,
) -> MergePlan:
    """The ``merge`` decision: into which weights, on which device, in which dtype (module docstring).

    ``adapter_check`` is what :func:`xpukit.planning.training.adapter_fit.check_adapter` found;
    ``record`` the adapter's base record, if it has one. What to know about the choice of weights
    is the plan's :attr:`MergePlan.warning` (the caller adds it to the plan's warnings).

    Raises:
        InvalidRequestError: the base is already quantized.
        PlanError: the full-precision model fits neither the device nor the CPU (the numbers).
    """
    adapter = str(lora_request.adapter_path)
    if facts.pre_quantized is not None:
        raise InvalidRequestError(
            f"merge=True: the base {facts.name!r} is already quantized ({facts.pre_quantized}): it has no "
            "full-precision weights to merge into. Fix: pass the full-precision checkpoint the adapter was "
            "trained from."
        )
    base, base_from, asked, warning = _merge_base(request, record, adapter)
    need = memory.weights + memory.headroom
    sizes = f"{format_bytes(memory.weights)} of {dtype} weights + {format_bytes(memory.headroom)} headroom"
    moved = False
    if main.backend == "cpu" or (memory.placement == "single" and not _bnb_cannot(base, main)):
        device = main.torch_device
        where = f"{sizes} fit {device} alone"
    else:
        cpu = usable_memory(machine.cpu)
        why_not = (
            "bitsandbytes has no MPS backend to dequantise with"
            if _bnb_cannot(base, main)
            else f"{sizes} do not fit {main.torch_device} alone ({memory.verdict})"
        )
        if need > cpu.usable:
            raise PlanError(
                f"merge=True: the merge needs the whole full-precision model in one memory ({sizes}); "
                f"{why_not}, and the CPU has {format_bytes(cpu.usable)} usable ({cpu.rule}). A merge "
                "never runs in 4-bit or offloaded to disk. Fix: merge on a machine with more memory "
                "(xpukit merge BASE ADAPTER OUT there)."
            )
        device, moved = "cpu", True
        where = (
            f"{why_not}: merged on the CPU ({format_bytes(cpu.usable)} usable), where the merged model stays"
        )
    qconfig = None
    if base == "dequantized":  # the recorded 4-bit settings, else xpukit's quantize="4bit" ones
        four = record is not None and record.quantization == "4bit"
        qconfig = record.merge_quantization(dtype) if four and record else bnb_kwargs("4bit", dtype)
    other = next(b for b in MERGE_BASES if b != base)
    reason = (
        f"{asked}: {adapter} merged with peft's merge_and_unload into {_WHY_BASE[base]}; a plain "
        f"{facts.architecture} is returned. Where: {where}. dtype {dtype}: the plan's dtype decision. "
        f"Adapter check: {adapter_check}"
    )
    decision = Decision(
        name="merge",
        value=f"{base}, {device}",
        reason=reason,
        rejected=(("4bit", _WHY_NOT_4BIT), (other, _WHY_BASE[other])),
        source="user",
    )
    return MergePlan(
        base=base,
        device=device,
        dtype=dtype,
        adapter=adapter,
        quantization_config=qconfig,
        moved_to_cpu=moved,
        adapter_check=adapter_check,
        decision=decision,
        placement_reason=where,
        base_from=base_from,
        warning=warning,
    )


def _merge_base(
    request: MergeRequest, record: BaseRecord | None, adapter: str
) -> tuple[str, str, str, str | None]:
    """The weights to merge into, who chose them, the reason's opening, and a warning (or ``None``)."""
    if request.given:
        asked, warning = f"merge={request.base!r}", None
        if record is not None and record.merge_base()[0] != request.base:
            warning = (
                f"merge={request.base!r} as asked, but {record.path} says the adapter trained with its "
                f"base held {record.held()}: merge={record.merge_base()[0]!r} (or merge=True) reproduces "
                "that model"
            )
        return request.base, "asked", asked, warning
    if record is not None:
        base, note = record.merge_base()
        return (
            base,
            "record",
            f"merge=True, and {record.path} says the adapter trained with its base held {record.held()}",
            note,
        )
    warning = (
        f"{adapter} has no {RECORD_FILE} (xpukit writes one when it saves an adapter it trained), so "
        f"merge=True takes its default, {DEFAULT_MERGE_BASE!r}: right for an adapter trained on the 4-bit "
        "base (QLoRA). An adapter trained on the full-precision base needs merge='original' "
        "(xpukit merge --into original)"
    )
    return DEFAULT_MERGE_BASE, "default", f"merge=True, whose default is {DEFAULT_MERGE_BASE!r}", warning


def _bnb_cannot(base: str, main: DeviceFacts) -> bool:
    return base == "dequantized" and main.backend == "mps"
