"""Quantization and placement decided together: does the model fit, and if not, what then.

The order of preference (docs/planning.md): the model as asked on one device → split over the
visible devices → with ``quantize="auto"``, 4-bit on one device or split → CPU offload with a
warning → :class:`~xpukit.errors.PlanError` with the numbers. A bitsandbytes model is never
offloaded unless the user's own ``BitsAndBytesConfig`` sets ``llm_int8_enable_fp32_cpu_offload``:
bitsandbytes keeps offloaded modules unquantized in fp32 on the CPU (4–8× the memory of their
4-bit form, and slow), which is rarely what anyone wants from a 4-bit load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from xpukit.errors import PlanError
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.planning.budgets import (
    Headroom,
    Placement,
    explain_no_fit,
    fit,
    format_bytes,
    headroom_for,
    offload,
    shares_host_memory,
    usable_memory,
)
from xpukit.planning.device.given_layout import (
    STRATEGIES,
    bnb_map_problem,
    check_budget_keys,
    given_budgets,
    given_map,
)
from xpukit.planning.device.quantization import QuantRequest, auto_4bit_problem, bnb_kwargs, check_bnb
from xpukit.planning.device.serve_quant import ServeFormat, serve_format, torchao_version
from xpukit.planning.model.facts import ModelFacts, quantized_bits
from xpukit.planning.vocabulary import Decision, MemoryEstimate

__all__ = ["Layout", "plan_layout"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The dtype, quantization and placement decided together."""

    dtype: Decision
    quantization: str | None
    quantization_config: dict[str, Any] | None
    device_map: str | dict[str, Any]
    max_memory: dict[int | str, int] | None
    memory: MemoryEstimate
    decisions: list[Decision] = field(default_factory=list)


def plan_layout(
    *,
    facts: ModelFacts,
    machine: MachineFacts,
    main: DeviceFacts,
    candidates: tuple[DeviceFacts, ...],
    dtype_decision: Decision,
    quant: QuantRequest,
    device_map: Any,
    max_memory: dict[int | str, int] | None,
    offload: bool,
    headroom: int | None,
    enforce_extras: bool,
    warnings: list[str],
    serve: bool = False,
) -> Layout:
    """Decide quantization, device_map and max_memory (see the module docstring).

    ``serve``: the model is loaded to run (no adapters, no training): ``4bit`` / ``8bit`` take the
    device's fastest weight-only format (:func:`~xpukit.planning.device.serve_quant.serve_format`).
    """
    kind = quant.kind
    if max_memory is not None:
        check_budget_keys(max_memory, machine)
    found_torchao = torchao_version() if serve and not quant.bnb_asked else None

    def serve_fmt(q: str | None, compute: str) -> ServeFormat | None:
        if not serve or quant.bnb_asked or q not in {"4bit", "8bit"} or facts.pre_quantized is not None:
            return None
        return serve_format(main, q, compute, found_torchao)

    asked_fmt = serve_fmt(kind, str(dtype_decision.value))
    if asked_fmt is None or asked_fmt.library != "torchao":
        dtype_decision = check_bnb(kind, quant, main, dtype_decision, enforce_extras, warnings)
    dtype = str(dtype_decision.value)
    four_fmt = serve_fmt("4bit", dtype)
    four_torchao = four_fmt is not None and four_fmt.library == "torchao"

    def four_bit_problem() -> str | None:  # why quantize="auto" cannot take 4-bit here
        return None if four_torchao else auto_4bit_problem(main, dtype)

    # A non-bitsandbytes config (quanto, torchao, GPTQ…) goes to from_pretrained unchanged; it is
    # sized by the bit width it states, else unquantized (an upper bound), which the plan says.
    other_bits = quantized_bits(quant.user_config) if kind == "other" else None
    can_suggest_4bit = kind != "other" and facts.pre_quantized is None and main.backend != "mps"

    def weights(q: str | None) -> int:
        if q is None and other_bits is not None:
            return facts.weights_at_bits(dtype, other_bits)
        return facts.weights(dtype, q)

    def head(q: str | None) -> Headroom:
        return headroom_for(
            weights(q),
            kv_bytes_per_token=facts.kv_bytes_per_token,
            max_positions=facts.max_positions,
            dtype=dtype,
            given=headroom,
        )

    fixed = kind if kind in {"4bit", "8bit"} else None
    quant_reason = (
        f"quantize={kind!r} given: "
        + ("bitsandbytes nf4 + double quant" if kind == "4bit" else "bitsandbytes LLM.int8")
        + f", compute dtype {dtype}"
        if fixed
        else "full precision: no quantize= given"
    )
    if facts.pre_quantized is not None:
        bits = f", {facts.pre_quantized_bits}-bit" if facts.pre_quantized_bits else ""
        quant_reason = (
            f"the checkpoint is already quantized ({facts.pre_quantized}{bits}): loaded as it is"
            + ("; quantize='auto' has nothing to do" if kind == "auto" else "")
        )
        kind = None
    quant_rejected: tuple[tuple[Any, str], ...] = ()
    placement: Placement
    if device_map not in (None, "auto") and device_map not in STRATEGIES:
        placement, fits = given_map(device_map, machine, weights(fixed), head(fixed))
        if kind == "auto":
            if fits:
                quant_reason = "quantize='auto': not needed, the model fits the given device_map"
            else:
                p4, fits4 = given_map(device_map, machine, weights("4bit"), head("4bit"))
                problem = four_bit_problem() or (None if four_torchao else bnb_map_problem(device_map))
                if fits4 and problem is None:
                    placement, fits, fixed = p4, True, "4bit"
                    quant_reason = (
                        f"quantize='auto': {format_bytes(weights(None))} in {dtype} does not fit the given "
                        f"device_map, 4-bit {format_bytes(weights('4bit'))} does"
                    )
                else:
                    why = problem or f"even 4-bit ({format_bytes(weights('4bit'))}) does not fit"
                    quant_reason = f"quantize='auto': {why}"
                    quant_rejected = (("4bit", why),)
        if not fits:
            hint = ""
            if (
                fixed is None
                and can_suggest_4bit
                and given_map(device_map, machine, weights("4bit"), head("4bit"))[1]
            ):
                hint = f"; quantize='4bit' ({format_bytes(weights('4bit'))} of weights) would fit"
            warnings.append(
                f"device_map={device_map!r}: {placement.reason}: the load may run out of memory{hint}"
            )
    elif max_memory is not None:
        total = sum(v for k, v in max_memory.items() if k != "disk")
        if kind == "auto":
            if weights(None) <= total or "disk" in max_memory:
                quant_reason = "quantize='auto': not needed, the weights fit the given max_memory"
            else:
                problem = four_bit_problem()
                if problem is None and weights("4bit") <= total:
                    fixed = "4bit"
                    quant_reason = (
                        f"quantize='auto': {format_bytes(weights(None))} in {dtype} exceed the given "
                        f"max_memory ({format_bytes(total)}), 4-bit {format_bytes(weights('4bit'))} does not"
                    )
                else:
                    why = problem or f"even 4-bit ({format_bytes(weights('4bit'))}) exceeds it"
                    quant_reason = f"quantize='auto': {why}"
                    quant_rejected = (("4bit", why),)
        placement = given_budgets(
            facts, device_map, max_memory, weights(fixed), head(fixed), can_suggest_4bit
        )
    else:
        fitted = fit(weights(fixed), head(fixed), candidates)
        if kind == "auto":
            if fitted is not None:
                quant_reason = "quantize='auto': not needed, the model fits as it is"
            else:
                problem = four_bit_problem()
                fit4 = fit(weights("4bit"), head("4bit"), candidates)
                if fit4 is not None and problem is None:
                    fitted, fixed = fit4, "4bit"
                    quant_reason = (
                        f"quantize='auto': {format_bytes(weights(None))} in {dtype} does not fit, 4-bit "
                        f"{format_bytes(weights('4bit'))} does"
                    )
                else:
                    why = problem or f"even 4-bit ({format_bytes(weights('4bit'))}) does not fit"
                    would = "would pick 4-bit, which fits, but " if fit4 is not None else ""
                    quant_reason = f"quantize='auto': {would}{why}"
                    quant_rejected = (("4bit", why),)
        if fitted is not None:
            placement = fitted
        else:
            placement = _no_fit(
                facts,
                main,
                candidates,
                machine,
                weights,
                head,
                fixed,
                quant,
                offload,
                warnings,
                can_suggest_4bit,
            )
        if device_map in STRATEGIES and placement.kind != "single":
            placement = Placement(
                kind=placement.kind,
                device_map=device_map,
                max_memory=placement.max_memory,
                budgets=placement.budgets,
                reason=placement.reason + f"; accelerate strategy {device_map!r} as asked",
            )
    qconfig: dict[str, Any] | None = None
    quantization = fixed
    weights_key = f"{fixed}/{dtype}" if fixed else dtype
    quant_value: Any = None
    quant_source: Literal["auto", "user", "fallback"] = (
        "user" if kind in {"4bit", "8bit", "other"} else "auto"
    )
    chosen_fmt = serve_fmt(fixed, dtype)
    if chosen_fmt is not None and chosen_fmt.library == "torchao":
        quantization, qconfig, quant_value = "torchao", chosen_fmt.config, chosen_fmt.label
        quant_reason = _with_format(quant_reason, quant, chosen_fmt)
        quant_rejected = (*quant_rejected, *chosen_fmt.rejected)
    elif fixed:
        qconfig = quant.user_config.to_dict() if quant.user_config is not None else bnb_kwargs(fixed, dtype)
        if quant.user_config is not None:
            quant_reason = "quantize= given: your BitsAndBytesConfig, used as is"
        elif quant.bnb_asked:
            quant_reason = f"quantize='nf4' given: bitsandbytes nf4 + double quant, compute dtype {dtype}"
        elif chosen_fmt is not None:
            quant_reason = _with_format(quant_reason, quant, chosen_fmt)
            quant_rejected = (*quant_rejected, *chosen_fmt.rejected)
            if chosen_fmt.torchao_missing:  # torchao would run here, but is missing or too old
                quant_source = "fallback"
    elif kind == "other":
        method = quant.method or type(quant.user_config).__name__
        quantization, qconfig = method, _config_dict(quant.user_config)
        name = type(quant.user_config).__name__
        if other_bits is not None:
            weights_key = f"{method} {other_bits}-bit/{dtype}"
            quant_reason = (
                f"quantize= given: your {name}, passed to from_pretrained unchanged; sized with the "
                f"linear weights at {other_bits} bits (scales not counted)"
            )
        else:
            weights_key = f"{dtype} (unquantized upper bound)"
            quant_reason = f"quantize= given: your {name}, passed to from_pretrained unchanged"
            warnings.append(
                f"{name} states no bit width xpukit can read: the memory plan counts the weights "
                f"unquantized ({format_bytes(weights(None))}), an upper bound"
            )
    memory = MemoryEstimate(
        weights=weights(fixed),
        weights_key=weights_key,
        headroom=head(fixed).bytes,
        headroom_rule=head(fixed).rule,
        budgets=placement.budgets,
        placement=placement.kind,
        verdict=placement.reason,
        sizing=facts.sizing,
    )
    decisions = [
        Decision(
            name="quantization",
            value=quant_value if quant_value is not None else quantization,
            reason=quant_reason,
            rejected=quant_rejected,
            source=quant_source,
        ),
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
            reason="weights budget per device = usable memory minus its share of the headroom"
            if placement.max_memory and max_memory is None
            else ("max_memory= given" if max_memory is not None else "not needed: one device"),
            source="user" if max_memory is not None else "auto",
        ),
        Decision(
            name="headroom",
            value=format_bytes(memory.headroom),
            reason=memory.headroom_rule,
            source="user" if headroom is not None else "auto",
        ),
    ]
    return Layout(
        dtype=dtype_decision,
        quantization=quantization,
        quantization_config=qconfig,
        device_map=placement.device_map,
        max_memory=placement.max_memory,
        memory=memory,
        decisions=decisions,
    )


def _with_format(reason: str, quant: QuantRequest, fmt: ServeFormat) -> str:
    """The quantization reason with the format chosen for a load without adapters."""
    if quant.kind in {"4bit", "8bit"}:
        return f"quantize={quant.kind!r} {quant.origin}, a load to run (no adapters): {fmt.reason}"
    return f"{reason}; {fmt.reason}"


def _no_fit(
    facts: ModelFacts,
    main: DeviceFacts,
    candidates: tuple[DeviceFacts, ...],
    machine: MachineFacts,
    weights: Any,
    head: Any,
    fixed: str | None,
    quant: QuantRequest,
    allow_offload: bool,
    warnings: list[str],
    can_suggest_4bit: bool,
) -> Placement:
    w, h = weights(fixed), head(fixed)
    budgets = tuple(usable_memory(d) for d in candidates)
    fixes: list[str] = []
    four_fits = (
        can_suggest_4bit and fixed is None and fit(weights("4bit"), head("4bit"), candidates) is not None
    )
    if main.backend != "cpu":
        if facts.pre_quantized is not None:
            fixes.append(
                f"the checkpoint is already quantized ({facts.pre_quantized}); xpukit does not offload "
                "quantized weights to the CPU (bitsandbytes keeps offloaded modules in fp32, other "
                "methods need their own CPU kernels). Pass your own device_map to try anyway"
            )
        elif fixed is not None and not quant.user_offload:
            why = (
                "bitsandbytes keeps CPU-offloaded modules unquantized in fp32 (large and slow); "
                "xpukit does not "
                "offload a quantized model unless your own BitsAndBytesConfig sets "
                "llm_int8_enable_fp32_cpu_offload=True"
            )
            fixes.append(why)
        elif allow_offload or quant.user_offload:
            placement = offload(w, h, candidates, machine.cpu)
            if placement is not None:
                hint = ""
                if four_fits:
                    four = format_bytes(weights("4bit"))
                    hint = f". quantize='4bit' ({four} of weights) would fit without offload"
                warnings.append(f"CPU offload: {placement.reason}{hint}")
                return placement
            fixes.append(
                "even with CPU offload it does not fit in CPU memory"
                + (f" ({main.torch_device} shares it)" if shares_host_memory(main) else "")
            )
        else:
            placement = offload(w, h, candidates, machine.cpu)
            if placement is not None:
                fixes.append("offload=True (CPU offload, slow) would fit")
    if four_fits:
        fixes.insert(0, f"quantize='4bit' ({format_bytes(weights('4bit'))} of weights) fits")
    where = ", ".join(b.device for b in budgets)
    raise PlanError(
        f"{facts.name} ({facts.architecture}) does not fit {where}"
        + (f" with quantize={fixed!r}" if fixed else "")
        + ":\n"
        + explain_no_fit(w, h, budgets)
        + (
            "\nOptions: " + "; ".join(fixes)
            if fixes
            else "\nUse a machine with more memory or a smaller model."
        )
    )


def _config_dict(config: Any) -> dict[str, Any]:
    to_dict = getattr(config, "to_dict", None)
    try:
        return dict(to_dict()) if callable(to_dict) else {"config": repr(config)}
    except Exception:  # a foreign to_dict that fails must not break planning
        return {"config": repr(config)}
