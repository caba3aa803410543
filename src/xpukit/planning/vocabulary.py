"""The plan's vocabulary: a :class:`Decision` per choice, a :class:`LoadEvent` per thing that ran, and
the :class:`MemoryEstimate` of a load.

The bottom of the planning wing: every decider returns these, and :class:`~xpukit.planning.loadplan.LoadPlan`
gathers them; this module imports nothing of the wing but the sizes in ``planning/budgets.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from xpukit.planning.budgets import DeviceBudget

__all__ = ["Decision", "Json", "LoadEvent", "MemoryEstimate", "jsonable"]

# JSON data, as json.dumps writes it.
Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """One choice of the plan.

    Attributes:
        name: what was decided (``device``, ``dtype``, ``attn_implementation``…).
        value: the value chosen (JSON-able).
        reason: why.
        rejected: alternatives that were not taken, each with why not.
        source: ``auto`` (xpukit chose), ``user`` (an argument), or ``fallback`` (what was asked could
            not be had; the reason says why).
    """

    name: str
    value: Any  # JSON-able; each decision's own type, which the loader reads back (packing: an int)
    reason: str
    rejected: tuple[tuple[object, str], ...] = ()
    source: Literal["auto", "user", "fallback"] = "auto"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "name": self.name,
            "value": jsonable(self.value),
            "reason": self.reason,
            "rejected": [{"value": jsonable(v), "why": why} for v, why in self.rejected],
            "source": self.source,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadEvent:
    """Something that happened while carrying out a plan.

    Attributes:
        kind: ``fallback`` (a planned choice could not be had), ``applied`` (a step that ran), or
            ``note``.
        what: the choice or step (``attn_implementation``, ``use_kernels``, ``lora``…).
        planned: what the plan said.
        actual: what was done instead (or what ran).
        cause: why.
    """

    kind: Literal["fallback", "applied", "note"]
    what: str
    planned: object = None
    actual: object = None
    cause: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "kind": self.kind,
            "what": self.what,
            "planned": jsonable(self.planned),
            "actual": jsonable(self.actual),
            "cause": self.cause,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Weights at the chosen dtype (or quantization) and headroom, against each device's memory."""

    weights: int
    weights_key: str  # e.g. "bfloat16" or "4bit/bfloat16"
    headroom: int
    headroom_rule: str
    budgets: tuple[DeviceBudget, ...]
    placement: str  # "single" | "split" | "offload" | "given"
    verdict: str
    sizing: str

    @property
    def needed(self) -> int:
        """Weights plus headroom."""
        return self.weights + self.headroom

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "weights": self.weights,
            "weights_key": self.weights_key,
            "headroom": self.headroom,
            "headroom_rule": self.headroom_rule,
            "needed": self.needed,
            "budgets": [b.to_dict() for b in self.budgets],
            "placement": self.placement,
            "verdict": self.verdict,
            "sizing": self.sizing,
        }


def jsonable(value: object) -> Json:
    """``value`` as JSON-able data (dicts, lists, scalars; anything else by its ``to_dict`` or ``str``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return jsonable(to_dict())
        except Exception:  # a foreign to_dict that fails must not break reporting
            return repr(value)
    return str(value)
