"""The rungs of :func:`~xpukit.planning.device.layout.plan_layout`: where the weights go, and 4-bit
when ``quantize="auto"`` needs it.

Each rung starts from a :class:`Sizing` (the compute dtype, the weights and headroom at each bit
width: all known before anything is placed) and the :class:`QuantChoice` as it stands (what
``quantize=`` asked, the bit width fixed so far, why), and returns a :class:`Placed`: the placement
with the quantization it settled. Which rung runs depends on what the user gave (:func:`place`):

* a device_map (:func:`on_given_map`): used as is, a warning when it may run out of memory;
* max_memory (:func:`within_given_budgets`): the weights split within those budgets;
* neither (:func:`by_fit`): one device, else a split over the visible devices, else CPU offload
  with a warning or :class:`~xpukit.errors.PlanError` with the numbers (:func:`_no_fit`).

With ``quantize="auto"`` each rung first tries the model as it is, then 4-bit (docs/planning.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xpukit.errors import PlanError
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.planning.budgets import (
    DeviceMap,
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
from xpukit.planning.device.given_layout import STRATEGIES, bnb_map_problem, given_budgets, given_map
from xpukit.planning.device.quantization import QuantRequest, auto_4bit_problem
from xpukit.planning.model.facts import ModelFacts

__all__ = ["Placed", "QuantChoice", "Sizing", "by_fit", "on_given_map", "place", "within_given_budgets"]


@dataclass(frozen=True, kw_only=True)
class Sizing:
    """What the layout knows before placing anything: the compute dtype and the bytes at each width.

    Attributes:
        other_bits: the bit width a non-bitsandbytes config states (quanto, torchao, GPTQ…); the
            weights are sized with it, else unquantized (an upper bound).
        given_headroom: ``headroom=`` as given, ``None`` for the rule's own.
        four_torchao: 4-bit here would be torchao's format (a load to run), not bitsandbytes.
        can_suggest_4bit: an error or warning may suggest ``quantize='4bit'``.
    """

    facts: ModelFacts
    main: DeviceFacts
    dtype: str
    other_bits: int | None
    given_headroom: int | None
    four_torchao: bool
    can_suggest_4bit: bool

    def weights(self, q: str | None) -> int:
        """The weights' bytes with quantization ``q`` (``None``, ``4bit``, ``8bit``)."""
        if q is None and self.other_bits is not None:
            return self.facts.weights_at_bits(self.dtype, self.other_bits)
        return self.facts.weights(self.dtype, q)

    def head(self, q: str | None) -> Headroom:
        """The headroom kept beside the weights with quantization ``q``."""
        return headroom_for(
            self.weights(q),
            kv_bytes_per_token=self.facts.kv_bytes_per_token,
            max_positions=self.facts.max_positions,
            dtype=self.dtype,
            given=self.given_headroom,
        )

    def four_bit_problem(self) -> str | None:
        """Why ``quantize="auto"`` cannot take 4-bit here, or ``None``."""
        return None if self.four_torchao else auto_4bit_problem(self.main, self.dtype)


@dataclass(frozen=True, kw_only=True)
class QuantChoice:
    """The quantization as it stands.

    Attributes:
        kind: the ``quantize=`` kind left to act on (``None`` for an already quantized checkpoint).
        fixed: the bitsandbytes-style width the weights are sized at (``4bit``, ``8bit`` or ``None``).
        reason: why, as the plan's ``quantization`` decision says it.
        rejected: the alternatives not taken, each with why not.
    """

    kind: str | None
    fixed: str | None
    reason: str
    rejected: tuple[tuple[object, str], ...] = ()

    def because(self, reason: str) -> QuantChoice:
        """The same choice, with ``reason``."""
        return replace(self, reason=reason)

    def four_bit(self, reason: str) -> QuantChoice:
        """``quantize="auto"`` takes 4-bit, for ``reason``."""
        return replace(self, fixed="4bit", reason=reason)

    def not_four_bit(self, why: str, would: str = "") -> QuantChoice:
        """``quantize="auto"`` cannot take 4-bit, for ``why``."""
        return replace(self, reason=f"quantize='auto': {would}{why}", rejected=(("4bit", why),))


@dataclass(frozen=True, kw_only=True)
class Placed:
    """Where the weights go, with the quantization the placement settled, and what the user should
    know about it (CPU offload, a given device_map the weights may not fit)."""

    placement: Placement
    quant: QuantChoice
    warnings: tuple[str, ...] = ()


def place(
    s: Sizing,
    choice: QuantChoice,
    *,
    machine: MachineFacts,
    candidates: tuple[DeviceFacts, ...],
    device_map: DeviceMap | None,
    max_memory: dict[int | str, int] | None,
    quant: QuantRequest,
    allow_offload: bool,
) -> Placed:
    """The rung for what the user gave: a device_map, max_memory, or neither."""
    if device_map is not None and device_map != "auto" and device_map not in STRATEGIES:
        return on_given_map(s, choice, device_map, machine)
    if max_memory is not None:
        return within_given_budgets(s, choice, device_map, max_memory)
    return by_fit(s, choice, candidates, machine, device_map, quant, allow_offload)


def on_given_map(s: Sizing, choice: QuantChoice, device_map: DeviceMap, machine: MachineFacts) -> Placed:
    """A device_map the user gave: used as is, with a warning when the weights may not fit it."""
    placement, fits = given_map(device_map, machine, s.weights(choice.fixed), s.head(choice.fixed))
    if choice.kind == "auto":
        placement, fits, choice = _auto_on_given_map(s, choice, placement, fits, device_map, machine)
    if fits:
        return Placed(placement=placement, quant=choice)
    hint = ""
    if (
        choice.fixed is None
        and s.can_suggest_4bit
        and given_map(device_map, machine, s.weights("4bit"), s.head("4bit"))[1]
    ):
        hint = f"; quantize='4bit' ({format_bytes(s.weights('4bit'))} of weights) would fit"
    warning = f"device_map={device_map!r}: {placement.reason}: the load may run out of memory{hint}"
    return Placed(placement=placement, quant=choice, warnings=(warning,))


def _auto_on_given_map(
    s: Sizing,
    choice: QuantChoice,
    placement: Placement,
    fits: bool,
    device_map: DeviceMap,
    machine: MachineFacts,
) -> tuple[Placement, bool, QuantChoice]:
    """``quantize="auto"`` with a given device_map: 4-bit when the model does not fit it and 4-bit does."""
    if fits:
        return (
            placement,
            fits,
            choice.because("quantize='auto': not needed, the model fits the given device_map"),
        )
    p4, fits4 = given_map(device_map, machine, s.weights("4bit"), s.head("4bit"))
    problem = s.four_bit_problem() or (None if s.four_torchao else bnb_map_problem(device_map))
    if fits4 and problem is None:
        reason = (
            f"quantize='auto': {format_bytes(s.weights(None))} in {s.dtype} does not fit the given "
            f"device_map, 4-bit {format_bytes(s.weights('4bit'))} does"
        )
        return p4, True, choice.four_bit(reason)
    why = problem or f"even 4-bit ({format_bytes(s.weights('4bit'))}) does not fit"
    return placement, fits, choice.not_four_bit(why)


def within_given_budgets(
    s: Sizing, choice: QuantChoice, device_map: DeviceMap | None, max_memory: dict[int | str, int]
) -> Placed:
    """max_memory the user gave: the weights split within those budgets (4-bit first if auto needs it)."""
    if choice.kind == "auto":
        choice = _auto_within_budgets(s, choice, max_memory)
    placement = given_budgets(
        s.facts, device_map, max_memory, s.weights(choice.fixed), s.head(choice.fixed), s.can_suggest_4bit
    )
    return Placed(placement=placement, quant=choice)


def _auto_within_budgets(s: Sizing, choice: QuantChoice, max_memory: dict[int | str, int]) -> QuantChoice:
    """``quantize="auto"`` with max_memory: 4-bit when the weights exceed the budgets and 4-bit does not."""
    total = sum(v for k, v in max_memory.items() if k != "disk")
    if s.weights(None) <= total or "disk" in max_memory:
        return choice.because("quantize='auto': not needed, the weights fit the given max_memory")
    problem = s.four_bit_problem()
    if problem is None and s.weights("4bit") <= total:
        return choice.four_bit(
            f"quantize='auto': {format_bytes(s.weights(None))} in {s.dtype} exceed the given "
            f"max_memory ({format_bytes(total)}), 4-bit {format_bytes(s.weights('4bit'))} does not"
        )
    why = problem or f"even 4-bit ({format_bytes(s.weights('4bit'))}) exceeds it"
    return choice.not_four_bit(why)


def by_fit(
    s: Sizing,
    choice: QuantChoice,
    candidates: tuple[DeviceFacts, ...],
    machine: MachineFacts,
    device_map: DeviceMap | None,
    quant: QuantRequest,
    allow_offload: bool,
) -> Placed:
    """Neither given: one device, a split over the candidates, 4-bit (auto), CPU offload, or PlanError."""
    fitted = fit(s.weights(choice.fixed), s.head(choice.fixed), candidates)
    if choice.kind == "auto":
        fitted, choice = _auto_by_fit(s, choice, fitted, candidates)
    warnings: tuple[str, ...] = ()
    if fitted is not None:
        placement = fitted
    else:
        placement, offloaded = _no_fit(s, candidates, machine, choice.fixed, quant, allow_offload)
        warnings = (offloaded,)
    if device_map in STRATEGIES and placement.kind != "single":
        placement = Placement(
            kind=placement.kind,
            device_map=device_map,
            max_memory=placement.max_memory,
            budgets=placement.budgets,
            reason=placement.reason + f"; accelerate strategy {device_map!r} as asked",
        )
    return Placed(placement=placement, quant=choice, warnings=warnings)


def _auto_by_fit(
    s: Sizing, choice: QuantChoice, fitted: Placement | None, candidates: tuple[DeviceFacts, ...]
) -> tuple[Placement | None, QuantChoice]:
    """``quantize="auto"`` by fit: 4-bit when the model does not fit the candidates and 4-bit does."""
    if fitted is not None:
        return fitted, choice.because("quantize='auto': not needed, the model fits as it is")
    problem = s.four_bit_problem()
    fit4 = fit(s.weights("4bit"), s.head("4bit"), candidates)
    if fit4 is not None and problem is None:
        reason = (
            f"quantize='auto': {format_bytes(s.weights(None))} in {s.dtype} does not fit, 4-bit "
            f"{format_bytes(s.weights('4bit'))} does"
        )
        return fit4, choice.four_bit(reason)
    why = problem or f"even 4-bit ({format_bytes(s.weights('4bit'))}) does not fit"
    would = "would pick 4-bit, which fits, but " if fit4 is not None else ""
    return fitted, choice.not_four_bit(why, would)


def _no_fit(
    s: Sizing,
    candidates: tuple[DeviceFacts, ...],
    machine: MachineFacts,
    fixed: str | None,
    quant: QuantRequest,
    allow_offload: bool,
) -> tuple[Placement, str]:
    """Nothing fits the candidates: CPU offload, with its warning, where allowed; else PlanError with
    the numbers and the options."""
    w, h = s.weights(fixed), s.head(fixed)
    four_fits = (
        s.can_suggest_4bit
        and fixed is None
        and fit(s.weights("4bit"), s.head("4bit"), candidates) is not None
    )
    fixes: list[str] = []
    if s.main.backend != "cpu":
        placement = _offload_or_fixes(s, candidates, machine, fixed, quant, allow_offload, fixes)
        if placement is not None:
            return placement, f"CPU offload: {placement.reason}{_four_bit_hint(s, four_fits)}"
    if four_fits:
        fixes.insert(0, f"quantize='4bit' ({format_bytes(s.weights('4bit'))} of weights) fits")
    budgets = tuple(usable_memory(d) for d in candidates)
    where = ", ".join(b.device for b in budgets)
    raise PlanError(
        f"{s.facts.name} ({s.facts.architecture}) does not fit {where}"
        + (f" with quantize={fixed!r}" if fixed else "")
        + ":\n"
        + explain_no_fit(w, h, budgets)
        + (
            "\nOptions: " + "; ".join(fixes)
            if fixes
            else "\nUse a machine with more memory or a smaller model."
        )
    )


def _four_bit_hint(s: Sizing, four_fits: bool) -> str:
    if not four_fits:
        return ""
    return f". quantize='4bit' ({format_bytes(s.weights('4bit'))} of weights) would fit without offload"


def _offload_or_fixes(
    s: Sizing,
    candidates: tuple[DeviceFacts, ...],
    machine: MachineFacts,
    fixed: str | None,
    quant: QuantRequest,
    allow_offload: bool,
    fixes: list[str],
) -> Placement | None:
    """On an accelerator: the CPU offload placement when it is allowed and fits; else ``None``, with
    why not (or that ``offload=True`` would fit) added to ``fixes``."""
    w, h = s.weights(fixed), s.head(fixed)
    if s.facts.pre_quantized is not None:
        fixes.append(
            f"the checkpoint is already quantized ({s.facts.pre_quantized}); xpukit does not offload "
            "quantized weights to the CPU (bitsandbytes keeps offloaded modules in fp32, other "
            "methods need their own CPU kernels). Pass your own device_map to try anyway"
        )
    elif fixed is not None and not quant.user_offload:
        fixes.append(
            "bitsandbytes keeps CPU-offloaded modules unquantized in fp32 (large and slow); "
            "xpukit does not "
            "offload a quantized model unless your own BitsAndBytesConfig sets "
            "llm_int8_enable_fp32_cpu_offload=True"
        )
    elif allow_offload or quant.user_offload:
        placement = offload(w, h, candidates, machine.cpu)
        if placement is not None:
            return placement
        fixes.append(
            "even with CPU offload it does not fit in CPU memory"
            + (f" ({s.main.torch_device} shares it)" if shares_host_memory(s.main) else "")
        )
    elif offload(w, h, candidates, machine.cpu) is not None:
        fixes.append("offload=True (CPU offload, slow) would fit")
    return None
