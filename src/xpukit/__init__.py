"""xpukit: load, fine-tune and launch Hugging Face Transformers correctly on Intel GPUs (xpu).

The same calls do the right thing on CUDA, MPS and CPU. Importing xpukit imports neither torch nor
transformers, and the public names below are resolved on first use (PEP 562), so ``import xpukit``
costs a few milliseconds and the CLI starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from xpukit._compat import quiet_torchao_import
from xpukit.errors import (
    DeviceSelectionError,
    DeviceUnavailableError,
    InvalidRequestError,
    MissingExtraError,
    PlanError,
    RuntimeAlreadyInitializedError,
    XpukitError,
)

if TYPE_CHECKING:
    __version__: str  # read from the installed package's metadata on first use (__getattr__)

    from xpukit.loading.gguf_export import export_gguf
    from xpukit.loading.load import load_for_xpu
    from xpukit.machine.facts import DeviceFacts, MachineFacts
    from xpukit.machine.probe import detect
    from xpukit.planning.loadplan import LoadPlan
    from xpukit.planning.plan import plan_load
    from xpukit.planning.vocabulary import Decision, LoadEvent
    from xpukit.select.devices import DeviceSelection, select_devices
    from xpukit.training.arguments import training_args

quiet_torchao_import()  # docs/planning.md "Quantization for inference" (torchao's import noise)

# Public name -> the module that defines it, imported on first attribute access.
_LAZY = {
    "Decision": "xpukit.planning.loadplan",
    "DeviceFacts": "xpukit.machine.facts",
    "DeviceSelection": "xpukit.select.devices",
    "LoadEvent": "xpukit.planning.loadplan",
    "LoadPlan": "xpukit.planning.loadplan",
    "MachineFacts": "xpukit.machine.facts",
    "detect": "xpukit.machine.probe",
    "export_gguf": "xpukit.loading.gguf_export",
    "load_for_xpu": "xpukit.loading.load",
    "plan_load": "xpukit.planning.plan",
    "select_devices": "xpukit.select.devices",
    "training_args": "xpukit.training.arguments",
}


def _version() -> str:
    # importlib.metadata costs more to import than the rest of xpukit: read it only when asked.
    from importlib import metadata

    try:
        return metadata.version("xpukit")
    except metadata.PackageNotFoundError:  # running from a source tree without installing
        return "0.0.0+unknown"


def __getattr__(name: str) -> object:
    if name == "__version__":
        value: object = _version()
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xpukit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})


__all__ = [
    "Decision",
    "DeviceFacts",
    "DeviceSelection",
    "DeviceSelectionError",
    "DeviceUnavailableError",
    "InvalidRequestError",
    "LoadEvent",
    "LoadPlan",
    "MachineFacts",
    "MissingExtraError",
    "PlanError",
    "RuntimeAlreadyInitializedError",
    "XpukitError",
    "__version__",
    "detect",
    "export_gguf",
    "load_for_xpu",
    "plan_load",
    "select_devices",
    "training_args",
]
