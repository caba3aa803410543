"""Where the weights go: memory budgets per device, headroom, and the device_map that fits.

Rules (docs/planning.md gives the reasons and sources):

* Usable memory of a device is the free memory its runtime reports. When it cannot report it
  (Lunar Lake / Panther Lake iGPUs raise in ``mem_get_info``, MPS has no query), it is
  ``total × 0.9`` for a discrete device and ``total × 0.6`` for an integrated one, which shares its
  memory with the CPU and the OS.
* Headroom for activations and the KV cache is ``KV cache of a 4096-token context (batch 1) + 10 %
  of the weights + 256 MiB`` unless given.
* Weights + headroom fit one device → that device. They fit the visible devices together →
  ``device_map="auto"`` with an explicit ``max_memory`` (accelerate silently drops an XPU whose
  free memory cannot be queried, docs/platform-notes.md §4.4). Otherwise CPU offload with a warning, or a
  :class:`~xpukit.errors.PlanError` showing the numbers when offload is not allowed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, TypeAlias

from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import DeviceFacts

__all__ = [
    "HEADROOM_CONTEXT_TOKENS",
    "HEADROOM_FIXED",
    "HEADROOM_WEIGHT_FRACTION",
    "USABLE_FRACTION_DISCRETE",
    "USABLE_FRACTION_INTEGRATED",
    "DeviceBudget",
    "DeviceMap",
    "Headroom",
    "Placement",
    "fit",
    "format_bytes",
    "headroom_for",
    "offload",
    "parse_size",
    "shares_host_memory",
    "usable_memory",
]

MiB = 2**20
GiB = 2**30
MAX_SIZE = 2**50  # 1 PiB: anything larger is a mistake (and inf would overflow int())

USABLE_FRACTION_DISCRETE = 0.90
USABLE_FRACTION_INTEGRATED = 0.60
HEADROOM_CONTEXT_TOKENS = 4096
HEADROOM_WEIGHT_FRACTION = 0.10
HEADROOM_FIXED = 256 * MiB


def format_bytes(n: float) -> str:
    """``16777216`` → ``'16.00 MiB'`` (binary units, as accelerate and torch report)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.I)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: object, what: str = "size") -> int:
    """``'10GiB'``, ``'500MB'``, ``12_000_000_000`` → bytes.

    Raises:
        InvalidRequestError: not a size.
    """
    if isinstance(value, bool):
        raise InvalidRequestError(f"{what}={value!r} is not a size; use bytes or a string like '10GiB'.")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0 or value > MAX_SIZE:
            raise InvalidRequestError(
                f"{what}={value!r} is not a size; use a finite number of bytes (at most 1 PiB) or a "
                "string like '10GiB'."
            )
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise InvalidRequestError(
            f"{what}={value!r} is not a size; use bytes or a string like '10GiB' or '500MB'."
        )
    number, unit = match.groups()
    size = float(number) * _UNITS[(unit or "b").lower()]
    if size > MAX_SIZE:
        raise InvalidRequestError(
            f"{what}={value!r} is more than 1 PiB; use a real memory size such as '10GiB'."
        )
    return int(size)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceBudget:
    """One device's memory as the plan sees it."""

    device: str  # torch device string, "cpu" for the host
    name: str
    total: int
    usable: int
    rule: str  # how `usable` was obtained
    weights_budget: int | None = None  # what max_memory gives this device, when set

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "device": self.device,
            "name": self.name,
            "total": self.total,
            "usable": self.usable,
            "rule": self.rule,
            "weights_budget": self.weights_budget,
        }


def usable_memory(device: DeviceFacts) -> DeviceBudget:
    """The memory of ``device`` the plan may fill, and the rule that gave it."""
    if device.free_memory is not None:
        what = "available system memory" if device.backend == "cpu" else "free memory reported by the runtime"
        if device.source != "detected":  # a recorded profile: nothing was asked of a runtime
            what = f"recorded profile: its {format_bytes(device.total_memory)}, all assumed free"
        return DeviceBudget(
            device=device.torch_device,
            name=device.name,
            total=device.total_memory,
            usable=device.free_memory,
            rule=what,
        )
    if device.integrated or device.backend in {"mps", "cpu"}:
        fraction, why = USABLE_FRACTION_INTEGRATED, "shared with the CPU and the OS"
    else:
        fraction, why = USABLE_FRACTION_DISCRETE, "room for the runtime and other processes"
    return DeviceBudget(
        device=device.torch_device,
        name=device.name,
        total=device.total_memory,
        usable=int(device.total_memory * fraction),
        rule=f"free memory cannot be queried here: total {format_bytes(device.total_memory)} × "
        f"{fraction} ({why})",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Headroom:
    """Memory kept free beside the weights, with the rule that set it."""

    bytes: int
    rule: str


def headroom_for(
    weights: int,
    *,
    kv_bytes_per_token: int | None,
    max_positions: int | None,
    dtype: str,
    given: object = None,
) -> Headroom:
    """Headroom for activations and the KV cache (see the module docstring for the rule)."""
    if given is not None:
        size = parse_size(given, "headroom")
        return Headroom(bytes=size, rule=f"headroom= given: {format_bytes(size)}")
    tokens = min(HEADROOM_CONTEXT_TOKENS, max_positions or HEADROOM_CONTEXT_TOKENS)
    kv = (kv_bytes_per_token or 0) * tokens * (2 if dtype == "float32" else 1)
    proportional = int(weights * HEADROOM_WEIGHT_FRACTION)
    total = kv + proportional + HEADROOM_FIXED
    kv_text = (
        f"KV cache for {tokens} tokens {format_bytes(kv)}"
        if kv_bytes_per_token
        else "KV cache unknown (config lacks the attention shape)"
    )
    return Headroom(
        bytes=total,
        rule=f"{kv_text} + {HEADROOM_WEIGHT_FRACTION:.0%} of weights {format_bytes(proportional)} "
        f"+ {format_bytes(HEADROOM_FIXED)} runtime",
    )


# A device_map as from_pretrained takes it: "auto", an accelerate strategy, a device ("xpu:0"), or a
# dict of module name → device (an index, a device's name or a torch.device, as the user gave it).
DeviceMap: TypeAlias = str | dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """A placement that works: the device_map, max_memory and the budgets behind them."""

    kind: str  # "single" | "split" | "offload" | "given"
    device_map: DeviceMap
    max_memory: dict[int | str, int] | None
    budgets: tuple[DeviceBudget, ...]
    reason: str


def _key(device: DeviceFacts) -> int | str:
    # accelerate's max_memory keys: integers for GPU/XPU indices, "mps", "cpu", "disk".
    return device.index if device.backend in {"xpu", "cuda"} else device.backend


def fit(weights: int, headroom: Headroom, devices: tuple[DeviceFacts, ...]) -> Placement | None:
    """Place on one device, or split over ``devices``, without offload; ``None`` when it cannot fit."""
    need = weights + headroom.bytes
    budgets = tuple(usable_memory(d) for d in devices)
    main = budgets[0]
    if need <= main.usable:
        return Placement(
            kind="single",
            device_map="mps" if devices[0].backend == "mps" else main.device,
            max_memory=None,
            budgets=(main,),
            reason=f"weights + headroom {format_bytes(need)} fit {main.device} "
            f"({format_bytes(main.usable)} usable)",
        )
    total = sum(b.usable for b in budgets)
    if len(devices) > 1 and need <= total:
        budgets = _share_headroom(budgets, headroom.bytes)
        return Placement(
            kind="split",
            device_map="auto",
            max_memory={_key(d): b.weights_budget or 0 for d, b in zip(devices, budgets, strict=True)},
            budgets=budgets,
            reason=f"{format_bytes(need)} does not fit one {main.device} "
            f"({format_bytes(main.usable)}) but fits "
            f"the {len(devices)} devices together ({format_bytes(total)}): device_map='auto' with explicit "
            "max_memory, which accelerate needs to see every XPU",
        )
    return None


def shares_host_memory(device: DeviceFacts) -> bool:
    """An integrated GPU or Apple silicon: the accelerator's memory is the host's memory."""
    return device.integrated or device.backend == "mps"


def offload(
    weights: int, headroom: Headroom, devices: tuple[DeviceFacts, ...], cpu: DeviceFacts
) -> Placement | None:
    """Fill the accelerators and put the rest in CPU memory; ``None`` when even that cannot hold it.

    On an integrated GPU or MPS the two are one pool: the host may hold only what its usable memory
    has left after the accelerators' share, so the same bytes are never counted twice.
    """
    accel = _share_headroom(tuple(usable_memory(d) for d in devices), headroom.bytes)
    host = usable_memory(cpu)
    host_usable, host_rule = host.usable, host.rule
    if shares_host_memory(devices[0]):
        taken = sum(b.usable for b in accel)
        host_usable = max(host.usable - taken, 0)
        host_rule = (
            f"{host.rule}, minus the {format_bytes(taken)} {devices[0].torch_device} uses from the same "
            "memory (shared)"
        )
    on_accel = sum(b.weights_budget or 0 for b in accel)
    if weights > on_accel + host_usable:
        return None
    host = DeviceBudget(
        device="cpu",
        name=host.name,
        total=host.total,
        usable=host_usable,
        rule=host_rule,
        weights_budget=host_usable,
    )
    max_memory: dict[int | str, int] = {
        _key(d): b.weights_budget or 0 for d, b in zip(devices, accel, strict=True)
    }
    max_memory["cpu"] = host.usable
    return Placement(
        kind="offload",
        device_map="auto",
        max_memory=max_memory,
        budgets=(*accel, host),
        reason=f"{format_bytes(weights)} of weights + {format_bytes(headroom.bytes)} headroom do not fit "
        f"{', '.join(b.device for b in accel)} ({format_bytes(sum(b.usable for b in accel))}); "
        f"{format_bytes(max(weights - on_accel, 0))} of weights go to CPU memory (slow: every forward pass "
        "copies them to the device)",
    )


def _share_headroom(budgets: tuple[DeviceBudget, ...], headroom: int) -> tuple[DeviceBudget, ...]:
    # Headroom is reserved on each device in proportion to its size; the rest is its weights budget.
    total = sum(b.usable for b in budgets) or 1
    return tuple(
        DeviceBudget(
            device=b.device,
            name=b.name,
            total=b.total,
            usable=b.usable,
            rule=b.rule,
            weights_budget=max(b.usable - int(headroom * b.usable / total), 0),
        )
        for b in budgets
    )


def explain_no_fit(weights: int, headroom: Headroom, budgets: tuple[DeviceBudget, ...]) -> str:
    """The numbers of a placement that failed, one device per line."""
    lines = [
        f"weights {format_bytes(weights)} + headroom {format_bytes(headroom.bytes)} ({headroom.rule}) "
        f"= {format_bytes(weights + headroom.bytes)} needed; usable:"
    ]
    lines += [f"  {b.device}: {format_bytes(b.usable)} ({b.rule})" for b in budgets]
    return "\n".join(lines)
