"""Placements the user gave: a device or dict ``device_map``, or ``max_memory`` budgets.

Each is validated against the machine's facts and used as given; the plan only says whether the
weights and headroom fit what was named.
"""

from __future__ import annotations

import re

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.planning.budgets import (
    DeviceBudget,
    DeviceMap,
    Headroom,
    Placement,
    format_bytes,
    usable_memory,
)
from xpukit.planning.model.facts import ModelFacts

__all__ = [
    "MAP_DEVICE",
    "STRATEGIES",
    "bnb_map_problem",
    "check_budget_keys",
    "check_map_device",
    "given_budgets",
    "given_map",
]


STRATEGIES = ("balanced", "balanced_low_0", "sequential")


MAP_DEVICE = re.compile(r"^(xpu|cuda|mps|cpu|disk)(:\d+)?$")


def given_map(
    device_map: DeviceMap, machine: MachineFacts, weights: int, head: Headroom
) -> tuple[Placement, bool]:
    """A device_map the user gave (a device or a dict): validated against the facts, used as is.

    Returns the placement and whether weights + headroom fit the devices it names.
    """
    need = weights + head.bytes
    if isinstance(device_map, dict):
        devices: dict[str, DeviceFacts] = {}
        for key, value in device_map.items():
            device = check_map_device(value, machine, f"device_map[{key!r}]")
            devices[device.torch_device] = device
        budgets = tuple(usable_memory(d) for d in devices.values())
        capacity = sum(b.usable for b in budgets)
        fits = need <= capacity
        reason = (
            f"device_map= given (a dict); weights + headroom {format_bytes(need)} "
            + ("fit" if fits else "DO NOT fit")
            + f" {', '.join(devices)} ({format_bytes(capacity)} usable)"
        )
        return Placement(
            kind="given", device_map=dict(device_map), max_memory=None, budgets=budgets, reason=reason
        ), fits
    text = str(device_map).strip().lower()
    device = check_map_device(text, machine, "device_map")
    budget = usable_memory(device)
    fits = need <= budget.usable
    reason = (
        f"device_map={text!r} given; weights + headroom {format_bytes(need)} "
        + ("fit" if fits else "DO NOT fit")
        + f" {device.torch_device} ({format_bytes(budget.usable)} usable)"
    )
    return Placement(kind="given", device_map=text, max_memory=None, budgets=(budget,), reason=reason), fits


def bnb_map_problem(device_map: DeviceMap | None) -> str | None:
    # transformers refuses a bitsandbytes model with modules mapped to the CPU or disk unless
    # llm_int8_enable_fp32_cpu_offload is set, and then keeps those modules in fp32.
    values = {str(v).strip().lower() for v in device_map.values()} if isinstance(device_map, dict) else set()
    if len(values) > 1 and values & {"cpu", "disk"}:
        return "the given device_map puts modules on the CPU/disk, which bitsandbytes keeps in fp32"
    return None


def check_map_device(value: object, machine: MachineFacts, what: str) -> DeviceFacts:
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"{machine.accelerator}:{value}"
    text = str(value).strip().lower()
    if not MAP_DEVICE.match(text):
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


def check_budget_keys(max_memory: dict[int | str, int], machine: MachineFacts) -> None:
    """Every ``max_memory`` key must name a device of the machine (accelerate ignores the others).

    Raises:
        InvalidRequestError: a key such as ``1`` on a one-GPU machine, or ``0`` where there is no
            XPU/CUDA device.
    """
    accelerated = machine.accelerator in {"xpu", "cuda"}
    indices = {d.index for d in machine.devices_of(machine.accelerator)} if accelerated else set()
    has_mps = bool(machine.devices_of("mps"))
    for key in max_memory:
        if key in {"cpu", "disk"} or (key == "mps" and has_mps) or (isinstance(key, int) and key in indices):
            continue
        seen = ", ".join(d.torch_device for d in machine.devices) or "none"
        valid = sorted(map(str, indices)) + (["'mps'"] if has_mps else []) + ["'cpu'", "'disk'"]
        raise InvalidRequestError(
            f"max_memory key {key!r} names no device of this machine ({machine.source}; accelerators: "
            f"{seen}). Valid keys here: {', '.join(valid)}. Fix: drop it, or plan for the machine that has "
            "it (facts=)."
        )


def given_budgets(
    facts: ModelFacts,
    device_map: DeviceMap | None,
    max_memory: dict[int | str, int],
    weights: int,
    head: Headroom,
    can_suggest_4bit: bool,
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
            + "). Fix: raise max_memory or add 'cpu'"
            + (", or quantize='4bit'." if can_suggest_4bit else ".")
        )
    return Placement(
        kind="given",
        device_map=device_map if device_map in STRATEGIES else "auto",
        max_memory=dict(max_memory),
        budgets=budgets,
        reason=f"max_memory as given ({format_bytes(total)} for {format_bytes(weights)} of weights; headroom "
        f"{format_bytes(head.bytes)} is yours to leave)",
    )
