"""Where the host's time goes inside the layer graphs' captures (``bench_realrun --profile-captures N``).

A capture after the first is almost all the host recording the layers (docs/layer-graphs.md "What a
capture costs": ``record`` is 0.4–0.65 s of a 0.46–0.75 s capture on the Qwen3-8B shape, against a
replayed step of about 145 ms). This wraps the capture function the layer graphs call in Python's
``cProfile`` and reports the functions that hold the most of that time, cumulative and own, so a
profile shows what the recording spends it on. cProfile's own overhead inflates Python-heavy
functions (often by 1.5–2×): read the shares, not the seconds.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Any


class CaptureProfile:
    """``cProfile`` switched on for the duration of each capture, nothing else."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.captures = 0
        self._profile = cProfile.Profile()

    @classmethod
    def installed(cls, top: int) -> CaptureProfile:
        """A profile wrapped around every later capture (:meth:`install`)."""
        profile = cls(top)
        profile.install()
        return profile

    def install(self) -> None:
        """Wrap ``capture`` where the layer graphs look it up (a module global, read at each call)."""
        from xpukit.loading.training import layer_captures

        inner = getattr(layer_captures, "capture")  # noqa: B009 (imported there, not exported)

        def profiled(*args: Any, **kwargs: Any) -> Any:
            self.captures += 1
            self._profile.enable()
            try:
                return inner(*args, **kwargs)
            finally:
                self._profile.disable()

        setattr(layer_captures, "capture", profiled)  # noqa: B010

    def summary(self) -> dict[str, Any]:
        """The captures' total and the top functions by cumulative and by own time, in ms."""
        if not self.captures:
            return {"captures": 0}
        stats = pstats.Stats(self._profile).stats  # type: ignore[attr-defined]
        total = max(entry[3] for entry in stats.values())  # the outermost call's cumulative time

        def top(index: int) -> list[list[Any]]:
            rows = sorted(stats.items(), key=lambda item: item[1][index], reverse=True)[: self.top]
            return [[_where(key), entry[1], round(1000 * entry[index], 1)] for key, entry in rows]

        return {
            "captures": self.captures,
            "ms": round(1000 * total, 1),
            "cumulative": top(3),  # [function, calls, ms]
            "own": top(2),
        }


def _where(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if filename == "~":  # a builtin
        return name
    parts = Path(filename).parts
    short = (
        "/".join(parts[-3:])
        if "site-packages" not in parts
        else "/".join(parts[parts.index("site-packages") + 1 :])
    )
    return f"{short}:{line}({name})"
