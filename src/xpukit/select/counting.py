"""How many devices a selection is checked against, learnt without initialising a runtime.

From recorded facts, from NVML (CUDA) or Level Zero Sysman (XPU, torch >= 2.13) with torch's own
caches restored, and from sysfs for the integrated + discrete Intel GPU mix, whose PCI-order
numbering puts the iGPU at 0 (docs/devices.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from xpukit import _environ
from xpukit.errors import DeviceSelectionError
from xpukit.machine import probe
from xpukit.machine.facts import MachineFacts, classify_xpu
from xpukit.select.spec import (
    HIERARCHIES,
    HIERARCHY_VARIABLE,
    MASK_VARIABLE,
    MAX_INDEX,
    SELECTABLE_BACKENDS,
    Entry,
    SelectableBackend,
)

__all__ = [
    "IGPU_SLOT",
    "IntelMix",
    "count_from_facts",
    "count_with_integrated",
    "count_without_init",
    "detect_backend",
    "inherited_hierarchy",
    "integrated_warnings",
    "intel_mix",
    "kept_attribute",
    "no_device_message",
    "pci_device_id",
]

IGPU_SLOT = ":00:02.0"  # the PCI device/function where Intel integrated GPUs always sit (bus 0)


def inherited_hierarchy(facts: MachineFacts | None, notes: list[str]) -> str | None:
    """``ZE_FLAT_DEVICE_HIERARCHY`` from the facts' environment, else from this process's."""
    value = _environ.get(HIERARCHY_VARIABLE, environ=facts.env if facts is not None else None)
    if value is None or value in HIERARCHIES:
        return value
    # The driver compares the exact upper-case names; anything else leaves its default in place.
    notes.append(f"{HIERARCHY_VARIABLE}={value!r} is not a value the driver knows: treated as its default")
    return None


def count_from_facts(
    backend: SelectableBackend, facts: MachineFacts, hierarchy: str | None
) -> tuple[int | None, str]:
    devices = facts.devices_of(backend)
    if not devices:
        return None, f"the facts list no {backend} devices: indices were checked for syntax only"
    mask = MASK_VARIABLE[backend]
    if mask in facts.env:
        return None, (
            f"the facts were read under {mask}={facts.env[mask]}, so they count only the devices it let "
            "through: indices were checked for syntax only"
        )
    facts_composite = facts.env.get(HIERARCHY_VARIABLE) == "COMPOSITE"
    multi_stack = any(d.family == "max" for d in devices)
    if hierarchy and (hierarchy == "COMPOSITE") != facts_composite and multi_stack:
        return None, (
            f"the facts were read in another hierarchy than {hierarchy}, and a multi-stack GPU counts "
            "differently there: indices were checked for syntax only"
        )
    return len(devices), f"the facts ({facts.source}) show {len(devices)} {backend} device(s)"


def detect_backend(hierarchy: str | None, where: str) -> tuple[SelectableBackend, int | None, str]:
    facts = probe.detect(devices=False)  # the build only: initialises nothing
    unknown: list[tuple[SelectableBackend, str]] = []
    for backend in SELECTABLE_BACKENDS:
        if backend not in facts.compiled:
            continue
        count, how = count_without_init(backend, hierarchy)
        if count is None:
            unknown.append((backend, how))
        elif count > 0:
            return backend, count, f"{how} shows {count} {backend} device(s)"
    if unknown:
        backend, how = unknown[0]
        return backend, None, f"{how}: indices were checked for syntax only"
    raise DeviceSelectionError(f"{where}: {no_device_message(facts)}")


def count_without_init(backend: SelectableBackend, hierarchy: str | None) -> tuple[int | None, str]:
    """The machine's device count where it can be had without initialising a runtime, else None.

    Uses the counting paths torch itself uses before initialisation (private helpers, looked up
    with getattr so that a torch without them simply gives "unknown"): NVML for CUDA, Level Zero
    Sysman through ``pyzes`` for XPU (torch ≥ 2.13). Both ignore any exported mask.
    """
    import warnings

    import torch

    module = getattr(torch, backend)
    if module.is_initialized():
        # Already initialised: asking costs nothing more, but the answer is the masked view.
        if _environ.get(MASK_VARIABLE[backend]) is None:
            return int(module.device_count()), "the initialised runtime"
        return None, f"the runtime is initialised under an exported {MASK_VARIABLE[backend]}"
    if backend == "cuda":
        if getattr(torch.version, "hip", None):
            return None, "ROCm builds cannot count devices through NVML"
        counter, how = getattr(module, "_raw_device_count_nvml", None), "NVML"
        args: tuple[Any, ...] = ()
    else:
        inherited = _environ.get(HIERARCHY_VARIABLE) == "COMPOSITE"
        if hierarchy and (hierarchy == "COMPOSITE") != inherited:
            return None, f"Level Zero Sysman counts in the exported hierarchy, not {hierarchy}"
        counter, how = getattr(module, "_raw_device_count_zes", None), "Level Zero Sysman (pyzes)"
        args = (list(range(MAX_INDEX + 1)),)  # "every index visible": ignore an exported mask
    if counter is None:
        return None, f"this torch has no way to count {backend} devices without initialising them"
    try:
        with warnings.catch_warnings(), kept_attribute(module, "_cached_zes_device_infos"):
            warnings.simplefilter("ignore")  # "Can't initialize NVML" is an answer, not a warning
            count = int(counter(*args))
    except (OSError, AttributeError, RuntimeError, ImportError):
        count = -1
    if count < 0:
        return None, f"{how} could not count {backend} devices"
    return count, how


@contextlib.contextmanager
def kept_attribute(module: ModuleType, name: str) -> Iterator[None]:
    """Put ``module.<name>`` (a list) back as it was: the same object, with the same items.

    torch 2.13's ``_raw_device_count_zes`` refills ``torch.xpu._cached_zes_device_infos`` (in place,
    then as a new list when it drops integrated GPUs) with the devices of the mask it is given. Its
    telemetry calls (``temperature``, ``power_draw``…) map ``xpu:N`` through that list, so the
    unmasked list of a count taken here must not stay behind in a process running under a mask.
    """
    missing = object()
    saved = getattr(module, name, missing)
    items = list(saved) if isinstance(saved, list) else None
    try:
        yield
    finally:
        if saved is missing:
            if hasattr(module, name):
                delattr(module, name)
        else:
            if isinstance(saved, list) and items is not None:
                saved[:] = items
            setattr(module, name, saved)


@dataclass(frozen=True, slots=True)
class IntelMix:
    """This machine's Intel GPUs as sysfs lists them (PCI order), when iGPU and dGPUs are mixed."""

    gpus: tuple[tuple[str, str], ...]  # (PCI address, "8086:<id>"), sorted by address
    integrated: tuple[int, ...]  # their ordinals: positions in PCI order
    multi_stack: bool  # a Data Center GPU Max among them (one device per stack in FLAT mode)


def intel_mix() -> IntelMix | None:
    """An Intel integrated GPU next to discrete ones on this machine's PCI bus, else None.

    With ``ZE_ENABLE_PCI_ID_DEVICE_ORDER=1`` Level Zero numbers its devices in PCI order, so the
    integrated GPU (at bus 0, ``00:02.0``) comes before every discrete card; torch, and the Sysman
    count it uses, leave it out whenever a discrete GPU is present (docs/platform-notes.md §1.1–1.2).
    """
    gpus = tuple(sorted(probe.intel_display_devices()))
    # Positions are ordinals as long as every device before the iGPU is single-stack; nothing
    # but the iGPU sits on bus 0 before 00:02.0, so in practice the iGPU is 0.
    integrated = tuple(i for i, (address, _) in enumerate(gpus) if address.endswith(IGPU_SLOT))
    if not integrated or len(integrated) == len(gpus):
        return None
    multi_stack = any(classify_xpu("", pci_device_id(pci_id)) == "max" for _, pci_id in gpus)
    return IntelMix(gpus=gpus, integrated=integrated, multi_stack=multi_stack)


def pci_device_id(pci_id: str) -> int | None:
    try:
        return int(pci_id.rpartition(":")[2], 16)
    except ValueError:
        return None


def count_with_integrated(
    mix: IntelMix, torch_count: int | None, how: str, hierarchy: str | None
) -> tuple[int | None, str]:
    """The number of Level Zero ordinals on a mixed machine, and how it was found."""
    listing = ", ".join(
        f"{i}: {address} ({'integrated' if i in mix.integrated else 'discrete'})"
        for i, (address, _) in enumerate(mix.gpus)
    )
    n_integrated = len(mix.integrated)
    found = (
        f"Intel GPUs on this machine's PCI bus, in the PCI order that ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 "
        f"gives them: {listing} (assuming Level Zero lists the integrated one too). Torch leaves "
        "integrated GPUs out while a discrete one is present"
    )
    if torch_count is not None:
        total = torch_count + n_integrated
        return total, (
            f"{found}; {how} (discrete only), plus {n_integrated} integrated: indices were checked "
            f"against {total}"
        )
    if mix.multi_stack and hierarchy != "COMPOSITE":
        return None, (
            f"{found}; a Data Center GPU Max counts one device per stack in FLAT mode and torch could "
            "not count them without initialising: indices were checked for syntax only"
        )
    total = len(mix.gpus)
    return total, f"{found}; indices were checked against the {total} Intel GPUs that sysfs lists"


def integrated_warnings(mix: IntelMix, entries: list[Entry]) -> list[str]:
    """A warning for each selected ordinal that is an integrated GPU on this machine."""
    discrete = [i for i in range(len(mix.gpus)) if i not in mix.integrated]
    # With a multi-stack card, positions after it are no longer ordinals: name only the first.
    listing = "" if mix.multi_stack else f" Discrete cards: {','.join(map(str, discrete))}."
    cards = {e.card for e in entries if e.kind != "uuid"}
    with_discrete = any(card not in mix.integrated for card in cards)
    out = []
    for ordinal in sorted(cards & set(mix.integrated)):
        address, pci_id = mix.gpus[ordinal]
        effect = (
            "next to a discrete card, torch leaves it out (it drops integrated GPUs whenever a discrete "
            "one is visible), so the program will not see it"
            if with_discrete
            else "the program will run on the integrated GPU alone"
        )
        out.append(
            f"device {ordinal} is the integrated GPU at {address} ({pci_id}), not a discrete card: "
            f"Level Zero numbers Intel GPUs in PCI order under ZE_ENABLE_PCI_ID_DEVICE_ORDER=1, so the "
            f"first discrete card is {discrete[0]}; {effect}.{listing}"
        )
    return out


def no_device_message(facts: MachineFacts) -> str:
    build = (
        f"torch {facts.torch_version} (compiled backends: {', '.join(facts.compiled) or 'none'})"
        if facts.torch_version
        else "torch is not installed"
    )
    return (
        f"no XPU or CUDA device was found; {build}. To build the variables for another machine, name "
        "the backend: backend='xpu' or 'cuda' (`xpukit launch --backend xpu ...`). `xpukit doctor` "
        "shows why no device is visible here."
    )
