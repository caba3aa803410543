"""Facts about the host outside torch, for ``xpukit doctor``: Intel GPUs on the PCI bus, the Level Zero
loader, ``/dev/dri`` render nodes and the ``render`` group, installed package versions, Hub reachability.

Everything here reads the machine (sysfs, device nodes, groups, package metadata, a bounded Hub
check) and touches no GPU runtime; the checks themselves (:mod:`xpukit.doctor.checks`) are pure.
"""

from __future__ import annotations

import ctypes.util
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from xpukit import _platform
from xpukit._compat import installed_version
from xpukit.machine.probe import intel_display_devices

__all__ = ["PACKAGES", "HostFacts", "gather_host", "in_render_group"]

# Distributions whose versions the report lists (None when not installed).
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "huggingface-hub",
    "peft",
    "bitsandbytes",
    "kernels",
    "liger-kernel",
    "deepspeed",
    "torchao",
    "matplotlib",
    "triton",
    "pytorch-triton-xpu",
    "pyzes",
    "intel-extension-for-pytorch",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostFacts:
    """Facts about the host outside torch.

    Attributes:
        intel_gpus: PCI ids (``8086:xxxx``) of Intel display controllers found in sysfs.
        intel_igpu_present: one of them sits at PCI 00:02.0, where Intel integrated GPUs live.
        level_zero_loader: whether ``libze_loader`` can be found (the Intel GPU driver stack).
        dri_exists: whether ``/dev/dri`` exists.
        render_nodes_accessible: whether the current user can open every ``/dev/dri/renderD*``.
        in_render_group: whether the user is root or in the ``render`` group.
        packages: installed versions of :data:`PACKAGES`.
        kernels_accepted: whether transformers accepts the installed ``kernels`` (None: absent).
        kernels_reason: the version check in words.
        hub_offline: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set.
        hub_reachable: the bounded reachability check's answer (None when offline: not checked).
        hub_reason: that check in words.
    """

    intel_gpus: tuple[str, ...] = ()
    intel_igpu_present: bool = False
    level_zero_loader: bool = False
    dri_exists: bool = False
    render_nodes_accessible: bool = True
    in_render_group: bool = True
    packages: dict[str, str | None] = field(default_factory=dict)
    kernels_accepted: bool | None = None  # None: kernels not installed
    kernels_reason: str = ""
    hub_offline: bool = False
    hub_reachable: bool | None = None  # None: not checked (offline)
    hub_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        data = asdict(self)
        data["intel_gpus"] = list(self.intel_gpus)
        return data


def gather_host() -> HostFacts:
    """Read the host facts (sysfs, /dev/dri, groups, package metadata); touches no GPU runtime.

    The PCI bus, render nodes and the ``render`` group are Linux facts: elsewhere (Windows, macOS)
    they read as absent, so no check about them fires (docs/windows.md "What doctor checks").
    """
    dri = _platform.dri_dir()
    nodes = sorted(dri.glob("renderD*")) if dri is not None else []
    from xpukit.hub import hub_status, kernels_support

    gpus = intel_display_devices()
    kernels = kernels_support()
    hub = hub_status()  # bounded (XPUKIT_HUB_TIMEOUT, default 2 s); no network when offline
    return HostFacts(
        intel_gpus=tuple(pci_id for _, pci_id in gpus),
        intel_igpu_present=any(address.endswith(":00:02.0") for address, _ in gpus),
        level_zero_loader=ctypes.util.find_library("ze_loader") is not None,
        dri_exists=dri is not None,
        render_nodes_accessible=all(os.access(n, os.R_OK | os.W_OK) for n in nodes),
        in_render_group=in_render_group(),
        packages={name: installed_version(name) for name in PACKAGES},
        kernels_accepted=kernels.accepted if kernels.installed else None,
        kernels_reason=kernels.reason,
        hub_offline=hub.offline,
        hub_reachable=None if hub.offline else hub.reachable,
        hub_reason=hub.reason,
    )


def in_render_group() -> bool:
    """Whether the user is root or in the ``render`` group (True where there is no such group)."""
    return _platform.in_render_group()
