"""Carrying out ``expandable_segments``: torch's allocator call after the load; a refusal recorded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from xpukit.loading.training import expandable_segments as act
from xpukit.planning.vocabulary import Decision


@dataclass
class _Plan:
    decisions: tuple[Decision, ...]


def _decision(value: bool, source: Any = "auto") -> Decision:
    return Decision(name="expandable_segments", value=value, reason="r", source=source)


def test_the_plans_choice_is_set_through_torch_and_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(act, "_set_allocator_settings", calls.append)
    before = dict(os.environ)
    events = act.apply_expandable_segments(_Plan((_decision(True),)))  # type: ignore[arg-type]
    assert calls == ["expandable_segments:True"]
    assert [(e.kind, e.what) for e in events] == [("applied", "expandable_segments")]
    assert dict(os.environ) == before  # torch's call, not the environment


@pytest.mark.parametrize("decisions", [(), (_decision(False),), (_decision(True, "user"),)])
def test_nothing_is_set_where_the_plan_keeps_the_allocator(
    decisions: tuple[Decision, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(act, "_set_allocator_settings", calls.append)
    assert act.apply_expandable_segments(_Plan(decisions)) == []  # type: ignore[arg-type]
    assert calls == []


def test_a_refusal_is_a_fallback_with_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(setting: str) -> None:
        raise RuntimeError("not supported on this build")

    monkeypatch.setattr(act, "_set_allocator_settings", refuse)
    (event,) = act.apply_expandable_segments(_Plan((_decision(True),)))  # type: ignore[arg-type]
    assert event.kind == "fallback" and event.actual is False
    assert "not supported on this build" in event.cause


def test_torchs_call_exists_in_the_installed_torch() -> None:
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    assert setter is not None or hasattr(torch.cuda.memory, "_set_allocator_settings")
