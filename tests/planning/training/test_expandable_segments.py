"""The ``expandable_segments`` decision: on for the layer graphs on CUDA; the user's setting kept."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from xpukit import plan_load
from xpukit.machine.profiles import machine_profile
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.training.expandable_segments import decide_expandable_segments

QWEN3 = reference_config("qwen3-0.6b")


def _plan(facts: Any = "h200", lora: Any = True) -> Any:
    return plan_load(QWEN3, facts=facts, lora=lora, quantize="4bit")


def _segments(plan: Any) -> Any:
    return next((d for d in plan.decisions if d.name == "expandable_segments"), None)


def test_on_for_the_layer_graphs_on_cuda_with_the_measurement_in_the_reason() -> None:
    plan = _plan(facts=dataclasses.replace(machine_profile("h200"), torch_version="2.11.0+cu130"))
    assert plan.decision("layer_graphs").value is True
    decision = _segments(plan)
    assert decision.value is True and decision.source == "auto"
    assert "16.97 -> 16.21 GB" in decision.reason and "PYTORCH_ALLOC_CONF" in decision.reason


def test_no_decision_without_the_layer_graphs() -> None:
    assert _segments(_plan(lora={"graphs": False})) is None
    assert _segments(plan_load(QWEN3, facts="h200")) is None  # no training at all
    assert decide_expandable_segments(graphs=False, backend="cuda", torch_version="2.11.0", env={}) is None


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments: True,max_split_size_mb:128"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, False),
    ],
)
def test_the_users_allocator_setting_is_kept(env: dict[str, str], value: bool) -> None:
    decision = _segments(_plan(facts=machine_profile("h200").with_env(env)))
    assert decision.source == "user" and decision.value is value
    assert next(iter(env)) in decision.reason


def test_off_on_intel_gpus_and_older_torch_with_the_reason() -> None:
    on_xpu = _segments(_plan(facts="arc-b580"))
    if on_xpu is not None:  # the graphs run on this torch's XPU build
        assert on_xpu.value is False and "not measured" in on_xpu.reason
    old = decide_expandable_segments(graphs=True, backend="cuda", torch_version="2.10.1", env={})
    assert old is not None and old.value is False and "2.11" in old.reason
    unknown = decide_expandable_segments(graphs=True, backend="cuda", torch_version=None, env={})
    assert unknown is not None and unknown.value is False
