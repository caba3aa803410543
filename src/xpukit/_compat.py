"""Optional dependencies: which are installed, at which version, and the error when one is missing.

Nothing here imports the packages it asks about (``import bitsandbytes`` alone costs seconds and may
reach the Hub); versions come from the installed distributions' metadata.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec

from packaging.version import InvalidVersion, Version

from xpukit.errors import MissingExtraError

__all__ = [
    "EXTRAS",
    "Extra",
    "installed_version",
    "is_installed",
    "quiet_torchao_import",
    "require",
    "version_at_least",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Extra:
    """One optional package and the xpukit extra that installs it."""

    package: str  # distribution name on PyPI
    module: str  # import name
    extra: str  # the xpukit extra, as in ``pip install "xpukit[extra]"``
    minimum: str | None = None  # oldest usable version, if any


# One table of the optional packages; `doctor`, `require` and the docs read it.
EXTRAS: dict[str, Extra] = {
    "bitsandbytes": Extra(package="bitsandbytes", module="bitsandbytes", extra="quant", minimum="0.48"),
    "peft": Extra(package="peft", module="peft", extra="lora"),
    "kernels": Extra(package="kernels", module="kernels", extra="kernels", minimum="0.11"),
    "liger-kernel": Extra(package="liger-kernel", module="liger_kernel", extra="liger"),
    "matplotlib": Extra(package="matplotlib", module="matplotlib", extra="plot"),
    "deepspeed": Extra(package="deepspeed", module="deepspeed", extra="deepspeed"),
    "torchao": Extra(package="torchao", module="torchao", extra="serve", minimum="0.18"),
}


class _TorchaoImportNoise(logging.Filter):
    """Drops the records torchao 0.18 logs on import in a torch build without CUDA 9.0a.

    transformers imports torchao whenever it is installed (``transformers/quantizers/auto.py``), and
    torchao then logs ``Failed to load …/_C_mxfp8…so`` / ``_C_cutlass_90a…so`` (CUDA-only kernels
    xpukit never uses) and torch logs one ``register_constant`` deprecation per torchao enum: noise
    on every CPU or XPU run (docs/planning.md "Quantization for inference"). Anything else passes,
    and everything with ``XPUKIT_VERBOSE=1`` / ``xpukit --verbose`` (xpukit/_quiet.py).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from xpukit._quiet import is_verbose

        if is_verbose():
            return True
        message = str(record.msg)
        if record.name == "torchao":
            cuda_only = "_C_mxfp8" in message or "_C_cutlass" in message
            return not (message.startswith("Failed to load") and cuda_only)
        return "register_constant() on Enum subclasses" not in message


def quiet_torchao_import() -> None:
    """Install :class:`_TorchaoImportNoise` on the two loggers (once; imports nothing)."""
    for name in ("torchao", "torch.utils._pytree"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoImportNoise) for f in log.filters):
            log.addFilter(_TorchaoImportNoise())


_FOUND: dict[str, str] = {}


def installed_version(package: str) -> str | None:
    """The installed version of a distribution, or ``None`` when it is not installed.

    Versions found are cached per process (a metadata lookup scans sys.path and costs milliseconds;
    every plan asks for several). "Not installed" is never cached, so ``%pip install`` in a running
    notebook — the fix a MissingExtraError names — is seen on the next call.
    """
    found = _FOUND.get(package)
    if found is not None:
        return found
    try:
        found = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    _FOUND[package] = found
    return found


def is_installed(module: str) -> bool:
    """Whether a module can be imported, without importing it."""
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version_at_least(version: str | None, minimum: str) -> bool:
    """``version >= minimum``; an unparseable or missing version is treated as too old."""
    if version is None:
        return False
    try:
        return Version(version) >= Version(minimum)
    except InvalidVersion:
        return False


def require(package: str, feature: str, *, minimum: str | None = None) -> str:
    """Return the installed version of an optional package, or raise :class:`MissingExtraError`.

    Args:
        package: a key of :data:`EXTRAS`.
        feature: what the user asked for, quoted in the error (e.g. ``quantize="4bit"``).
        minimum: a stricter minimum than the table's, when this feature needs one.

    Raises:
        MissingExtraError: the package is missing or older than ``minimum``.
    """
    extra = EXTRAS[package]
    needed = minimum or extra.minimum
    found = installed_version(extra.package)
    if found is None or not is_installed(extra.module):
        raise MissingExtraError(
            feature, extra.package, extra.extra, requirement=f">={needed}" if needed else ""
        )
    if needed and not version_at_least(found, needed):
        raise MissingExtraError(feature, extra.package, extra.extra, found=found, requirement=f">={needed}")
    return found
