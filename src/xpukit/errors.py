"""The errors xpukit raises.

Every error derives from :class:`XpukitError`; each subclass also derives from the built-in that an
existing ``except`` clause would expect, so ``except ValueError`` keeps catching bad input::

    XpukitError (Exception)
    ├── InvalidRequestError (ValueError)        bad argument or combination of arguments
    │   └── DeviceSelectionError                 a device spec that cannot select what was asked
    ├── MissingExtraError (ImportError)          an optional dependency is missing or too old
    ├── DeviceUnavailableError (RuntimeError)    the device (or torch build) cannot do what was asked
    │   └── RuntimeAlreadyInitializedError       device env changed after the runtime read it
    └── PlanError (RuntimeError)                 no workable plan (e.g. the model fits nowhere)

Messages follow one shape: what was asked, what was found, the valid choices, and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "DeviceSelectionError",
    "DeviceUnavailableError",
    "InvalidRequestError",
    "MissingExtraError",
    "PlanError",
    "RuntimeAlreadyInitializedError",
    "XpukitError",
    "name_hints",
]


class XpukitError(Exception):
    """Base class of every error raised by xpukit."""


class InvalidRequestError(XpukitError, ValueError):
    """An argument, or a combination of arguments, that xpukit cannot honour."""


class DeviceSelectionError(InvalidRequestError):
    """A device selection spec that is malformed or selects something other than what was asked."""


class MissingExtraError(XpukitError, ImportError):
    """An optional dependency is missing (or installed at a version xpukit cannot use).

    Args:
        feature: what the user asked for, e.g. ``quantize="4bit"``.
        package: the distribution that is missing, e.g. ``bitsandbytes``.
        extra: the xpukit extra that installs it, e.g. ``quant``.
        found: the installed version when one is installed but unusable.
        requirement: the version range needed, e.g. ``>=0.48``.
        alternative: another install that also serves the feature, named after the fix.
    """

    def __init__(
        self,
        feature: str,
        package: str,
        extra: str,
        *,
        found: str | None = None,
        requirement: str = "",
        detail: str = "",
        alternative: str = "",
    ) -> None:
        self.feature = feature
        self.package = package
        self.extra = extra
        self.found = found
        self.requirement = requirement
        state = (
            f"'{package}' {found} is installed, but {package}{requirement} is needed"
            if found
            else f"'{package}' is not installed"
        )
        fix = f'pip install "xpukit[{extra}]"'
        if found and requirement:
            fix += f' (or pip install "{package}{requirement}")'
        if alternative:
            fix += f", or {alternative}"
        message = f"{feature} needs {package}{requirement}: {state}. Fix: {fix}"
        if detail:
            message += f"\n{detail}"
        super().__init__(message)


class DeviceUnavailableError(XpukitError, RuntimeError):
    """The device, or this torch build, cannot do what was asked."""


class RuntimeAlreadyInitializedError(DeviceUnavailableError):
    """Device-selection variables were changed after the device runtime had already read them."""


class PlanError(XpukitError, RuntimeError):
    """No plan satisfies the request on these devices; the message carries the numbers."""


def name_hints(names: Iterable[object], valid: Iterable[str]) -> str:
    """``'lr' (did you mean 'lora_alpha'?), 'x'``: the given names, each with its closest valid one.

    For messages that refuse unknown keys: what was asked, and what was probably meant.
    """
    import difflib  # only on the error path

    choices = sorted(valid)
    hints = []
    for name in names:
        close = difflib.get_close_matches(str(name), choices, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(hints)
