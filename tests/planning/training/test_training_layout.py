"""New LoRA adapters: 4-bit by fit when full precision would crawl, and no silent weight offload
(planning/for_training.py; docs/planning.md "Training layout")."""

from __future__ import annotations

import os
from typing import Any

import pytest

from xpukit import plan_load
from xpukit.errors import PlanError
from xpukit.planning.model.reference_models import reference_config

QWEN3_8B = reference_config("qwen3-8b")
STEP = {"batch_size": 4, "seq_len": 512}


def test_full_precision_that_would_offload_becomes_4bit_and_says_why() -> None:
    """The reported case: bf16 offloaded 5.59 GiB, offloaded checkpointing, micro-batch 1."""
    plan = plan_load(QWEN3_8B, facts="arc-b580", lora=True, **STEP)
    q = plan.decision("quantization")
    assert (plan.quantization, q.source) == ("4bit", "auto")
    assert "no quantize= given" in q.reason and "quantize=False keeps full precision" in q.reason
    assert q.rejected and q.rejected[0][0] is None
    assert plan.device_map == "xpu:0" and plan.memory.placement == "single"
    assert plan.training is not None and plan.training.fits
    assert plan.training.micro_batch == 4 and plan.training.gradient_checkpointing is True


def test_quantize_false_keeps_full_precision_and_refuses_the_offload() -> None:
    before = dict(os.environ)
    with pytest.raises(PlanError) as info:
        plan_load(QWEN3_8B, facts="arc-b580", lora=True, quantize=False, **STEP)
    message = str(info.value)
    assert "would offload weights to CPU memory" in message and "5.59 GiB" in message
    assert 'quantize="4bit"' in message and "offload=True" in message
    assert dict(os.environ) == before


def test_offload_true_allows_it() -> None:
    plan = plan_load(QWEN3_8B, facts="arc-b580", lora=True, quantize=False, offload=True, **STEP)
    assert plan.quantization is None and plan.memory.placement == "offload"


def test_quantize_auto_keeps_its_own_rule() -> None:
    plan = plan_load(QWEN3_8B, facts="arc-b580", lora=True, quantize="auto", **STEP)
    q = plan.decision("quantization")
    assert plan.quantization == "4bit" and q.reason.startswith("quantize='auto'")


def test_inference_still_offloads_with_a_warning() -> None:
    plan = plan_load(QWEN3_8B, facts="arc-b580")
    assert plan.memory.placement == "offload" and plan.quantization is None
    assert any("CPU memory" in w or "offload" in w for w in plan.warnings)


def test_what_fits_in_full_precision_stays_full_precision() -> None:
    plan = plan_load(reference_config("qwen3-0.6b"), facts="arc-b580", lora=True, **STEP)
    assert plan.quantization is None and plan.decision("quantization").source == "auto"
    assert plan.training is not None and plan.training.fits


def test_a_step_that_does_not_fit_beside_the_weights_also_takes_4bit(liger: Any) -> None:
    """Weights on the device, but no room for the step even at its leanest: 4-bit, said so. Arranged
    without liger-kernel: its fused loss (with the input embedding in host memory) makes this step fit
    beside the bf16 weights (below)."""
    liger(False)
    plan = plan_load(QWEN3_8B, facts="h200", lora=True, max_memory={0: "15.6GiB", "cpu": "64GiB"}, **STEP)
    assert plan.quantization == "4bit"
    assert "no quantize= given" in plan.decision("quantization").reason
    assert plan.training is not None and plan.training.fits
    liger(True)
    leaner = plan_load(QWEN3_8B, facts="h200", lora=True, max_memory={0: "15.6GiB", "cpu": "64GiB"}, **STEP)
    assert leaner.quantization is None and leaner.training is not None and leaner.training.loss == "liger"


def test_given_4bit_stays_the_users() -> None:
    plan = plan_load(QWEN3_8B, facts="arc-b580", lora=True, quantize="4bit", **STEP)
    assert plan.decision("quantization").source == "user"
