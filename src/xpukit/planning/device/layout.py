"""Quantization and placement decided together: does the model fit, and if not, what then.

The order of preference (docs/planning.md): the model as asked on one device → split over the
visible devices → with ``quantize="auto"``, 4-bit on one device or split → CPU offload with a
warning → :class:`~xpukit.errors.PlanError` with the numbers. A bitsandbytes model is never
offloaded unless the user's own ``BitsAndBytesConfig`` sets ``llm_int8_enable_fp32_cpu_offload``:
bitsandbytes keeps offloaded modules unquantized in fp32 on the CPU (4–8× the memory of their
4-bit form, and slow), which is rarely what anyone wants from a 4-bit load.

:func:`plan_layout` runs as steps, each a function of what the steps before it decided: the formats a
load to run can take and the dtype checked against bitsandbytes → the sizes at each bit width
(:class:`~xpukit.planning.device.layout_rungs.Sizing`) → what ``quantize=`` asked → the placement
rung (:mod:`xpukit.planning.device.layout_rungs`) → the quantization config → the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from xpukit.errors import MissingExtraError
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.planning.budgets import DeviceMap, format_bytes
from xpukit.planning.device.given_layout import check_budget_keys
from xpukit.planning.device.layout_rungs import Placed, QuantChoice, Sizing, place
from xpukit.planning.device.quantization import QuantRequest, bnb_kwargs, check_bnb
from xpukit.planning.device.saved_quant import SavedFormat, families_reading
from xpukit.planning.device.serve_quant import ServeFormat, serve_format, torchao_version
from xpukit.planning.model.facts import ModelFacts, quantized_bits
from xpukit.planning.vocabulary import Decision, MemoryEstimate

__all__ = ["Layout", "plan_layout"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The dtype, quantization and placement decided together, and the warnings deciding them gave
    (in the order of :func:`plan_layout`'s steps)."""

    dtype: Decision
    quantization: str | None
    quantization_config: dict[str, Any] | None
    device_map: DeviceMap
    max_memory: dict[int | str, int] | None
    memory: MemoryEstimate
    decisions: list[Decision] = field(default_factory=list)
    warnings: tuple[str, ...] = ()


def plan_layout(
    *,
    facts: ModelFacts,
    machine: MachineFacts,
    main: DeviceFacts,
    candidates: tuple[DeviceFacts, ...],
    dtype_decision: Decision,
    quant: QuantRequest,
    device_map: DeviceMap | None,
    max_memory: dict[int | str, int] | None,
    offload: bool,
    headroom: int | None,
    enforce_extras: bool,
    serve: bool = False,
    saved: SavedFormat | None = None,
) -> Layout:
    """Decide quantization, device_map and max_memory (see the module docstring).

    ``serve``: the model is loaded to run (no adapters, no training): ``4bit`` / ``8bit`` take the
    device's fastest weight-only format (:func:`~xpukit.planning.device.serve_quant.serve_format`).
    ``saved``: the record of a quantized checkpoint ``xpukit merge`` wrote: loaded to run, its torchao
    weights are the plan's format, loaded as they are.
    """
    if max_memory is not None:
        check_budget_keys(max_memory, machine)
    formats = _Formats.of(facts, main, quant, serve, saved)
    dtype_decision, dtype_warnings = formats.checked_dtype(dtype_decision, enforce_extras)
    sizing = _sizing(facts, main, quant, formats, str(dtype_decision.value), headroom)
    placed = place(
        sizing,
        _asked(facts, quant, sizing.dtype),
        machine=machine,
        candidates=candidates,
        device_map=device_map,
        max_memory=max_memory,
        quant=quant,
        allow_offload=offload,
    )
    config = _quantization(sizing, placed.quant, quant, formats)
    memory = _memory(sizing, placed, config.weights_key)
    return Layout(
        dtype=dtype_decision,
        quantization=config.quantization,
        quantization_config=config.config,
        device_map=placed.placement.device_map,
        max_memory=placed.placement.max_memory,
        memory=memory,
        decisions=[
            config.decision(),
            *_placement_decisions(placed, memory, device_map, max_memory, headroom),
        ],
        warnings=(*dtype_warnings, *placed.warnings, *config.warnings),
    )


@dataclass(frozen=True, kw_only=True)
class _Formats:
    """The weight-only formats a load to run can take (:func:`serve_format`).

    None for a load with adapters, a bitsandbytes request or an already quantized checkpoint.
    """

    main: DeviceFacts
    quant: QuantRequest
    serve: bool
    pre_quantized: bool
    torchao: str | None  # the installed torchao version, read only for a load to run
    saved: SavedFormat | None = None  # a quantized checkpoint xpukit wrote, loaded to run

    @classmethod
    def of(
        cls, facts: ModelFacts, main: DeviceFacts, quant: QuantRequest, serve: bool, saved: SavedFormat | None
    ) -> _Formats:
        torchao = torchao_version() if serve and not quant.bnb_asked else None
        return cls(
            main=main,
            quant=quant,
            serve=serve,
            pre_quantized=facts.pre_quantized is not None,
            torchao=torchao,
            saved=saved if serve and facts.pre_quantized == "torchao" else None,
        )

    def format(self, q: str | None, compute: str) -> ServeFormat | None:
        """The format for quantization ``q`` in ``compute``, or ``None`` when it is not a load to run."""
        if not self.serve or self.quant.bnb_asked or q not in {"4bit", "8bit"} or self.pre_quantized:
            return None
        return serve_format(self.main, q, compute, self.torchao)

    def checked_dtype(
        self, dtype_decision: Decision, enforce_extras: bool
    ) -> tuple[Decision, tuple[str, ...]]:
        """The dtype decision, checked against bitsandbytes unless the asked format is torchao's, and
        the warnings the check gave."""
        asked = self.format(self.quant.kind, str(dtype_decision.value))
        if asked is not None and asked.library == "torchao":
            return dtype_decision, ()
        try:
            return check_bnb(self.quant.kind, self.quant, self.main, dtype_decision, enforce_extras)
        except MissingExtraError as exc:
            if asked is None or not asked.torchao_missing:
                raise
            error = exc  # neither library: both installs can serve this load
        raise MissingExtraError(
            f"quantize={self.quant.kind!r} (a load to run)",
            error.package,
            error.extra,
            found=error.found,
            requirement=error.requirement,
            alternative=f'pip install "xpukit[serve]" for {asked.rejected[0][0]}, the faster format here',
        )


def _sizing(
    facts: ModelFacts,
    main: DeviceFacts,
    quant: QuantRequest,
    formats: _Formats,
    dtype: str,
    headroom: int | None,
) -> Sizing:
    """The sizes at each bit width, before anything is placed.

    A non-bitsandbytes config (quanto, torchao, GPTQ…) goes to from_pretrained unchanged; it is
    sized by the bit width it states, else unquantized (an upper bound), which the plan says.
    """
    four = formats.format("4bit", dtype)
    return Sizing(
        facts=facts,
        main=main,
        dtype=dtype,
        other_bits=quantized_bits(quant.user_config) if quant.kind == "other" else None,
        given_headroom=headroom,
        four_torchao=four is not None and four.library == "torchao",
        can_suggest_4bit=quant.kind != "other" and facts.pre_quantized is None and main.backend != "mps",
    )


def _asked(facts: ModelFacts, quant: QuantRequest, dtype: str) -> QuantChoice:
    """What ``quantize=`` asked, before placing: nothing left to do for an already quantized checkpoint."""
    kind = quant.kind
    fixed = kind if kind in {"4bit", "8bit"} else None
    reason = (
        f"quantize={kind!r} given: "
        + ("bitsandbytes nf4 + double quant" if kind == "4bit" else "bitsandbytes LLM.int8")
        + f", compute dtype {dtype}"
        if fixed
        else "full precision: no quantize= given"
    )
    if facts.pre_quantized is not None:
        bits = f", {facts.pre_quantized_bits}-bit" if facts.pre_quantized_bits else ""
        reason = f"the checkpoint is already quantized ({facts.pre_quantized}{bits}): loaded as it is" + (
            "; quantize='auto' has nothing to do" if kind == "auto" else ""
        )
        kind = None
    return QuantChoice(kind=kind, fixed=fixed, reason=reason)


@dataclass(frozen=True, kw_only=True)
class _Quantization:
    """What goes to from_pretrained for the quantization, and how the plan says it."""

    quantization: str | None
    config: dict[str, Any] | None
    weights_key: str
    reason: str
    rejected: tuple[tuple[object, str], ...]
    source: Literal["auto", "user", "fallback"]
    label: str | None = None  # what the decision shows when it is not ``quantization``
    warnings: tuple[str, ...] = ()

    def decision(self) -> Decision:
        return Decision(
            name="quantization",
            value=self.label if self.label is not None else self.quantization,
            reason=self.reason,
            rejected=self.rejected,
            source=self.source,
        )


def _quantization(s: Sizing, choice: QuantChoice, quant: QuantRequest, formats: _Formats) -> _Quantization:
    """The quantization config for the width the placement settled: torchao's format (a load to run),
    bitsandbytes, the user's own config, or none."""
    fixed = choice.fixed
    plain = _Quantization(
        quantization=fixed,
        config=None,
        weights_key=f"{fixed}/{s.dtype}" if fixed else s.dtype,
        reason=choice.reason,
        rejected=choice.rejected,
        source="user" if choice.kind in {"4bit", "8bit", "other"} else "auto",
    )
    if formats.saved is not None:  # xpukit's quantized checkpoint: its weights as they are
        saved = formats.saved
        return replace(
            plain,
            quantization="torchao",
            config=saved.config,
            label=saved.label,
            reason=f"{choice.reason}: {saved.label} {saved.reason}, not quantized again",
        )
    fmt = formats.format(fixed, s.dtype)
    if fmt is not None and fmt.library == "torchao":
        return replace(
            plain,
            quantization="torchao",
            config=fmt.config,
            label=fmt.label,
            reason=_with_format(choice.reason, quant, fmt) + _written_once(fmt, fixed, formats.main),
            rejected=(*choice.rejected, *fmt.rejected),
        )
    if fixed:
        return _bitsandbytes(plain, fixed, s.dtype, quant, fmt)
    if choice.kind == "other":
        return _other_config(plain, s, quant)
    return plain


def _bitsandbytes(
    plain: _Quantization, fixed: str, dtype: str, quant: QuantRequest, fmt: ServeFormat | None
) -> _Quantization:
    """bitsandbytes at ``fixed``: the user's BitsAndBytesConfig as is, else xpukit's keywords."""
    if quant.user_config is not None:
        return replace(
            plain,
            config=quant.user_config.to_dict(),
            reason="quantize= given: your BitsAndBytesConfig, used as is",
        )
    q = replace(plain, config=bnb_kwargs(fixed, dtype))
    if quant.recorded is not None:
        config = dict(quant.recorded)
        if fixed == "4bit":
            config["bnb_4bit_compute_dtype"] = dtype
        return replace(q, config=config, reason=f"quantize={fixed!r} {quant.origin}, compute dtype {dtype}")
    if quant.bnb_asked:
        return replace(
            q, reason=f"quantize='nf4' given: bitsandbytes nf4 + double quant, compute dtype {dtype}"
        )
    if fmt is None:
        return q
    return replace(
        q,
        reason=_with_format(q.reason, quant, fmt),
        rejected=(*q.rejected, *fmt.rejected),
        # torchao would run here, but is missing or too old
        source="fallback" if fmt.torchao_missing else q.source,
    )


def _other_config(plain: _Quantization, s: Sizing, quant: QuantRequest) -> _Quantization:
    """A non-bitsandbytes config: passed to from_pretrained unchanged, sized by the bits it states."""
    method = quant.method or type(quant.user_config).__name__
    name = type(quant.user_config).__name__
    q = replace(plain, quantization=method, config=_config_dict(quant.user_config))
    if s.other_bits is not None:
        return replace(
            q,
            weights_key=f"{method} {s.other_bits}-bit/{s.dtype}",
            reason=(
                f"quantize= given: your {name}, passed to from_pretrained unchanged; sized with the "
                f"linear weights at {s.other_bits} bits (scales not counted)"
            ),
        )
    return replace(
        q,
        weights_key=f"{s.dtype} (unquantized upper bound)",
        reason=f"quantize= given: your {name}, passed to from_pretrained unchanged",
        warnings=(
            f"{name} states no bit width xpukit can read: the memory plan counts the weights "
            f"unquantized ({format_bytes(s.weights(None))}), an upper bound",
        ),
    )


def _memory(s: Sizing, placed: Placed, weights_key: str) -> MemoryEstimate:
    """The memory estimate of the layout: the weights at the settled width, the headroom, the budgets."""
    fixed, placement = placed.quant.fixed, placed.placement
    head = s.head(fixed)
    return MemoryEstimate(
        weights=s.weights(fixed),
        weights_key=weights_key,
        headroom=head.bytes,
        headroom_rule=head.rule,
        budgets=placement.budgets,
        placement=placement.kind,
        verdict=placement.reason,
        sizing=s.facts.sizing,
    )


def _placement_decisions(
    placed: Placed,
    memory: MemoryEstimate,
    device_map: DeviceMap | None,
    max_memory: dict[int | str, int] | None,
    headroom: int | None,
) -> list[Decision]:
    """The device_map, max_memory and headroom decisions, with where each came from."""
    placement = placed.placement
    if placement.max_memory and max_memory is None:
        budget_reason = "weights budget per device = usable memory minus its share of the headroom"
    else:
        budget_reason = "max_memory= given" if max_memory is not None else "not needed: one device"
    return [
        Decision(
            name="device_map",
            value=placement.device_map,
            reason=placement.reason,
            source="user" if device_map not in (None, "auto") else "auto",
        ),
        Decision(
            name="max_memory",
            value={str(k): format_bytes(v) for k, v in placement.max_memory.items()}
            if placement.max_memory
            else None,
            reason=budget_reason,
            source="user" if max_memory is not None else "auto",
        ),
        Decision(
            name="headroom",
            value=format_bytes(memory.headroom),
            reason=memory.headroom_rule,
            source="user" if headroom is not None else "auto",
        ),
    ]


def _with_format(reason: str, quant: QuantRequest, fmt: ServeFormat) -> str:
    """The quantization reason with the format chosen for a load without adapters."""
    if quant.kind in {"4bit", "8bit"}:
        return f"quantize={quant.kind!r} {quant.origin}, a load to run (no adapters): {fmt.reason}"
    return f"{reason}; {fmt.reason}"


def _written_once(fmt: ServeFormat, kind: str | None, main: DeviceFacts) -> str:
    """Where torchao can write ``fmt``'s weights for this device's family: the command that quantizes
    them once instead of at every load (docs/export.md "To another machine")."""
    families = families_reading(fmt.config)
    if kind not in {"4bit", "8bit"} or families is None or main.backend not in families:
        return ""
    bits = "int4" if kind == "4bit" else "int8"
    return (
        f"; quantized as the weights load, in every process: `xpukit export SOURCE OUT --quantize {bits} "
        f"--for {main.backend}` writes them once, and load_for_xpu(OUT) loads them as they are"
    )


def _config_dict(config: object) -> dict[str, Any]:
    to_dict = getattr(config, "to_dict", None)
    try:
        return dict(to_dict()) if callable(to_dict) else {"config": repr(config)}
    except Exception:  # a foreign to_dict that fails must not break planning
        return {"config": repr(config)}
