"""Switch CUDA's caching allocator to expandable segments once a training load has succeeded.

The plan decides whether to do this (``planning/training/expandable_segments.py``). The rule and the
measurements are in docs/layer-graphs.md "Expandable segments in the allocator".

This runs after the weights and adapters are in place. Two things follow from that:

* a refused or failed load leaves the process's allocator as it was;
* what is allocated from then on, the adapters' optimizer state, the steps' activations and the
  layer graphs' private pool, comes from expandable segments. The weights keep their ordinary
  segments. Both kinds live side by side in one allocator.

torch reads ``PYTORCH_ALLOC_CONF`` only once, at the device's first allocation. After that its
settings are changed through a call, which is what this module makes. The environment is left
untouched. torch 2.11 deprecated ``torch.cuda.memory._set_allocator_settings`` in favour of
``torch._C._accelerator_setAllocatorSettings``; the newer call is tried first. The setting holds for
the rest of the process, as with unsloth, which sets it when imported.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from xpukit.planning.training.expandable_segments import EXPANDABLE_SETTING
from xpukit.planning.vocabulary import LoadEvent

if TYPE_CHECKING:
    from xpukit.planning.loadplan import LoadPlan

__all__ = ["EXPANDABLE_SETTING", "apply_expandable_segments"]

logger = logging.getLogger("xpukit")


def _set_allocator_settings(setting: str) -> None:
    """torch's call that changes the allocator's settings in a running process."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.11
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def apply_expandable_segments(plan: LoadPlan) -> list[LoadEvent]:
    """Carry out the plan's ``expandable_segments`` decision: an ``applied`` or ``fallback`` event.

    No event where the plan has no such decision, or where it keeps the allocator as it is.
    """
    decision = next((d for d in plan.decisions if d.name == "expandable_segments"), None)
    if decision is None or decision.value is not True or decision.source == "user":
        return []
    try:
        _set_allocator_settings(EXPANDABLE_SETTING)
    except Exception as exc:  # a torch build whose allocator refuses the setting
        cause = f"torch refused {EXPANDABLE_SETTING!r}: {type(exc).__name__}: {exc}"
        logger.warning("xpukit: the allocator keeps its ordinary segments (%s)", cause)
        return [
            LoadEvent(
                kind="fallback",
                what="expandable_segments",
                planned=True,
                actual=False,
                cause=cause,
            )
        ]
    note = "CUDA's allocator on expandable segments from here on (the weights keep their segments)"
    return [LoadEvent(kind="applied", what="expandable_segments", planned=True, actual=note)]
