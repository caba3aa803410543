"""Quantization and placement decided together: does the model fit, and if not, what then.

The order of preference (docs/planning.md): the model as asked on one device → split over the
visible devices → with ``quantize="auto"``, 4-bit on one device or split → CPU offload with a
warning → :class:`~xpukit.errors.PlanError` with the numbers. A bitsandbytes model is never
offloaded unless the user's own ``BitsAndBytesConfig`` sets ``llm_int8_enable_fp32_cpu_offload``:
bitsandbytes keeps offloaded modules unquantized in fp32 on the CPU (4–8× the memory of their
4-bit form, and slow), which is rarely what anyone wants from a 4-bit load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.facts import DeviceFacts, MachineFacts
from xpukit.loadplan import Decision, MemoryEstimate
from xpukit.model_facts import ModelFacts
from xpukit.placement import (
    DeviceBudget,
    Headroom,
    Placement,
    explain_no_fit,
    fit,
    format_bytes,
    headroom_for,
    offload,
    usable_memory,
)
from xpukit.quantization import QuantRequest, bnb_kwargs, bnb_problem, require_bnb

__all__ = ["Layout", "plan_layout"]

_STRATEGIES = ("balanced", "balanced_low_0", "sequential")
_MAP_DEVICE = re.compile(r"^(xpu|cuda|mps|cpu|disk)(:\d+)?$")


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
) -> Layout:
    """Decide quantization, device_map and max_memory (see the module docstring)."""
    kind = quant.kind
    dtype_decision = _check_bnb(kind, quant, main, dtype_decision, enforce_extras, warnings)
    dtype = str(dtype_decision.value)

    def weights(q: str | None) -> int:
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
        ("bitsandbytes nf4 + double quant" if kind == "4bit" else "bitsandbytes LLM.int8")
        + f", compute dtype {dtype}"
        if fixed
        else "none asked"
    )
    quant_rejected: tuple[tuple[Any, str], ...] = ()
    placement: Placement | None
    if device_map not in (None, "auto") and device_map not in _STRATEGIES:
        placement = _given_map(device_map, machine, weights(fixed), head(fixed))
    elif max_memory is not None:
        placement = _given_budgets(facts, device_map, max_memory, weights(fixed), head(fixed))
    else:
        placement = fit(weights(fixed), head(fixed), candidates)
        if kind == "auto":
            if placement is not None:
                quant_reason = "quantize='auto': not needed, the model fits as it is"
            else:
                problem = _auto_4bit_problem(main, dtype)
                p4 = fit(weights("4bit"), head("4bit"), candidates)
                if p4 is not None and problem is None:
                    placement, fixed = p4, "4bit"
                    quant_reason = (
                        f"quantize='auto': {format_bytes(weights(None))} in {dtype} does not fit, 4-bit "
                        f"{format_bytes(weights('4bit'))} does"
                    )
                else:
                    why = problem or f"even 4-bit ({format_bytes(weights('4bit'))}) does not fit"
                    would = "would pick 4-bit, which fits, but " if p4 is not None else ""
                    quant_reason = f"quantize='auto': {would}{why}"
                    quant_rejected = (("4bit", why),)
        if placement is None:
            placement = _no_fit(
                facts, main, candidates, machine, weights, head, fixed, quant, offload, warnings
            )
        if device_map in _STRATEGIES and placement.kind != "single":
            placement = Placement(
                kind=placement.kind,
                device_map=device_map,
                max_memory=placement.max_memory,
                budgets=placement.budgets,
                reason=placement.reason + f"; accelerate strategy {device_map!r} as asked",
            )
    qconfig: dict[str, Any] | None = None
    if fixed:
        qconfig = quant.user_config.to_dict() if quant.user_config is not None else bnb_kwargs(fixed, dtype)
        if quant.user_config is not None:
            quant_reason = "asked: the given BitsAndBytesConfig, used as is"
    memory = MemoryEstimate(
        weights=weights(fixed),
        weights_key=f"{fixed}/{dtype}" if fixed else dtype,
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
            value=fixed,
            reason=quant_reason,
            rejected=quant_rejected,
            source="user" if kind in {"4bit", "8bit"} else "auto",
        ),
        Decision(
            name="device_map",
            value=placement.device_map,
            reason=placement.reason,
            source="user" if placement.kind == "given" or device_map in _STRATEGIES else "auto",
        ),
        Decision(
            name="max_memory",
            value={str(k): format_bytes(v) for k, v in placement.max_memory.items()}
            if placement.max_memory
            else None,
            reason="weights budget per device = usable memory minus its share of the headroom"
            if placement.max_memory and max_memory is None
            else ("given" if max_memory is not None else "not needed: one device"),
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
        quantization=fixed,
        quantization_config=qconfig,
        device_map=placement.device_map,
        max_memory=placement.max_memory,
        memory=memory,
        decisions=decisions,
    )


def _check_bnb(
    kind: str | None,
    quant: QuantRequest,
    main: DeviceFacts,
    dtype_decision: Decision,
    enforce: bool,
    warnings: list[str],
) -> Decision:
    """bitsandbytes usable for an explicit request; on Arc A with bnb < 0.50 switch to fp16 compute."""
    if kind not in {"4bit", "8bit"}:
        return dtype_decision
    dtype = str(dtype_decision.value)
    problem, fix = bnb_problem(main, kind, dtype)
    if fix and quant.user_config is None:
        if dtype_decision.source == "user":
            raise InvalidRequestError(
                f"dtype='bfloat16' with quantize='4bit' on {main.name}: {problem}. Fix: pip install "
                "'bitsandbytes>=0.50', or dtype='float16'."
            )
        return Decision(
            name="dtype",
            value=fix,
            reason=f"{problem}, so 4-bit computes in fp16 (pip install 'bitsandbytes>=0.50' for bf16)",
            rejected=(("bfloat16", str(problem)), *dtype_decision.rejected),
        )
    if problem and not fix:
        if enforce:
            require_bnb(kind)  # raises MissingExtraError with the fix
        warnings.append(f"{problem} (planned anyway for the assumed machine)")
    return dtype_decision


def _auto_4bit_problem(main: DeviceFacts, dtype: str) -> str | None:
    try:
        problem, fix = bnb_problem(main, "4bit", dtype)
    except InvalidRequestError as exc:  # MPS: no bitsandbytes backend
        return str(exc).split(". Fix")[0]
    if fix:
        return f"{problem} (would compute in fp16)"
    return problem


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
) -> Placement:
    w, h = weights(fixed), head(fixed)
    budgets = tuple(usable_memory(d) for d in candidates)
    fixes: list[str] = []
    if main.backend != "cpu":
        if fixed is not None and not quant.user_offload:
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
                if fixed is None and main.backend != "mps" and fit(weights("4bit"), head("4bit"), candidates):
                    four = format_bytes(weights("4bit"))
                    hint = f". quantize='4bit' ({four} of weights) would fit without offload"
                warnings.append(f"CPU offload: {placement.reason}{hint}")
                return placement
            fixes.append("even with CPU offload it does not fit in CPU memory")
        else:
            placement = offload(w, h, candidates, machine.cpu)
            if placement is not None:
                fixes.append("offload=True (CPU offload, slow) would fit")
    if fixed is None and main.backend != "mps" and fit(weights("4bit"), head("4bit"), candidates) is not None:
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


def _given_map(device_map: Any, machine: MachineFacts, weights: int, head: Headroom) -> Placement:
    """A device_map the user gave (a device or a dict): validated against the facts, used as is."""
    if isinstance(device_map, dict):
        for key, value in device_map.items():
            _check_map_device(value, machine, f"device_map[{key!r}]")
        return Placement(
            kind="given", device_map=dict(device_map), max_memory=None, budgets=(), reason="as given"
        )
    text = str(device_map).strip().lower()
    device = _check_map_device(text, machine, "device_map")
    budget = usable_memory(device)
    fits = weights + head.bytes <= budget.usable
    reason = (
        f"as given; weights + headroom {format_bytes(weights + head.bytes)} "
        + ("fit" if fits else "DO NOT fit")
        + f" {device.torch_device} ({format_bytes(budget.usable)} usable)"
    )
    return Placement(kind="given", device_map=text, max_memory=None, budgets=(budget,), reason=reason)


def _check_map_device(value: Any, machine: MachineFacts, what: str) -> DeviceFacts:
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"{machine.accelerator}:{value}"
    text = str(value).strip().lower()
    if not _MAP_DEVICE.match(text):
        raise InvalidRequestError(
            f"{what}={value!r} is not a device ('xpu:0', 'cuda:1', 'cpu', 'disk', or an index)."
        )
    backend, _, index = text.partition(":")
    if backend in {"cpu", "disk"}:
        return machine.cpu
    for d in machine.devices_of(backend):
        if d.index == int(index or 0):
            return d
    seen = ", ".join(d.torch_device for d in machine.devices) or "none"
    raise InvalidRequestError(f"{what}={value!r}: no such device here (visible accelerators: {seen}).")


def _given_budgets(
    facts: ModelFacts, device_map: Any, max_memory: dict[int | str, int], weights: int, head: Headroom
) -> Placement:
    total = sum(v for k, v in max_memory.items() if k != "disk")
    budgets = tuple(
        DeviceBudget(
            device=str(k), name=str(k), total=v, usable=v, rule="max_memory argument", weights_budget=v
        )
        for k, v in max_memory.items()
    )
    if weights > total and "disk" not in max_memory:
        raise PlanError(
            f"{facts.name}: {format_bytes(weights)} of weights exceed the max_memory given "
            f"({format_bytes(total)} in all: "
            + ", ".join(f"{k}={format_bytes(v)}" for k, v in max_memory.items())
            + "). Fix: raise max_memory, add 'cpu', or quantize='4bit'."
        )
    return Placement(
        kind="given",
        device_map=device_map if device_map in _STRATEGIES else "auto",
        max_memory=dict(max_memory),
        budgets=budgets,
        reason=f"max_memory as given ({format_bytes(total)} for {format_bytes(weights)} of weights; headroom "
        f"{format_bytes(head.bytes)} is yours to leave)",
    )
