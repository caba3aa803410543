"""xpukit: load, fine-tune and launch Hugging Face Transformers correctly on Intel GPUs (xpu).

The same calls do the right thing on CUDA, MPS and CPU. Importing xpukit imports neither torch nor
transformers: the public functions import what they need when they are called.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from xpukit.errors import (
    DeviceSelectionError,
    DeviceUnavailableError,
    InvalidRequestError,
    MissingExtraError,
    PlanError,
    RuntimeAlreadyInitializedError,
    XpukitError,
)
from xpukit.devices import DeviceSelection, select_devices
from xpukit.facts import DeviceFacts, MachineFacts
from xpukit.probe import detect
from xpukit.train import training_args

try:
    __version__ = _metadata.version("xpukit")
except _metadata.PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

__all__ = [
    "DeviceFacts",
    "DeviceSelection",
    "DeviceSelectionError",
    "DeviceUnavailableError",
    "InvalidRequestError",
    "MachineFacts",
    "MissingExtraError",
    "PlanError",
    "RuntimeAlreadyInitializedError",
    "XpukitError",
    "__version__",
    "detect",
    "select_devices",
    "training_args",
]
