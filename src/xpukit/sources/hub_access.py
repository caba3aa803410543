"""The Hub as planning sees it: a facts object whose answers are gathered lazily, when first asked.

Planning decides from :class:`HubFacts` and never reads the Hub, the kernel cache or the installed
``kernels`` release itself (:mod:`xpukit.planning.device.attention`,
:mod:`xpukit.planning.device.layer_kernels`). :class:`HubAccess` answers from :mod:`xpukit.hub`:
the kernel cache is a look at the disk, and the Hub's reachability (one bounded check, cached per
process, none at all while ``HF_HUB_OFFLINE`` is set) is asked only when a Hub kernel is on the
table and not cached. Tests hand-make the facts (any object with these methods).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Protocol

from xpukit.hub import (
    RECHECK_HINT,
    HubStatus,
    KernelsSupport,
    hub_offline,
    hub_status,
    kernel_cached,
    kernels_support,
)

__all__ = ["RECHECK_HINT", "HubAccess", "HubFacts"]  # RECHECK_HINT: how to ask the Hub again


class HubFacts(Protocol):
    """What planning may ask about the Hub and the kernels library (each answer a fact)."""

    def kernels(self) -> KernelsSupport:
        """Whether transformers will use the installed ``kernels`` package, and why (not)."""
        ...

    def cached(self, repo: str, *, version: int | None, revision: str | None) -> bool:
        """Whether a Hub kernel (any version when neither is given) is in the local kernel cache."""
        ...

    def status(self) -> HubStatus:
        """Whether the Hub can be used now, and why (or why not)."""
        ...

    def import_offline(self, module: str) -> contextlib.AbstractContextManager[None]:
        """A context for importing ``module`` the first time: huggingface_hub kept offline while the
        Hub is off or unreachable (an import that reaches the Hub cannot wait on it)."""
        ...


class HubAccess:
    """:class:`HubFacts` from this process: each answer asked when first needed, then kept for the plan."""

    def __init__(self) -> None:
        self._kernels: KernelsSupport | None = None
        self._status: HubStatus | None = None

    def kernels(self) -> KernelsSupport:
        if self._kernels is None:
            self._kernels = kernels_support()
        return self._kernels

    def cached(self, repo: str, *, version: int | None, revision: str | None) -> bool:
        return kernel_cached(repo, version=version, revision=revision)

    def status(self) -> HubStatus:
        if self._status is None:
            self._status = hub_status()
        return self._status

    @contextlib.contextmanager
    def import_offline(self, module: str) -> Iterator[None]:
        from xpukit.hub import offline_guard

        # bitsandbytes' import (through peft's) reaches the Hub with no timeout on avx512_bf16 CPUs.
        guard = module not in sys.modules and (hub_offline() or not self.status().usable)
        with offline_guard(guard):
            yield
