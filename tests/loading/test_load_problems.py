"""A failed ``from_pretrained`` with a known cause becomes xpukit's message (loading/load_problems.py)."""

from __future__ import annotations

from xpukit import plan_load
from xpukit.loading.load_problems import weights_problem
from xpukit.planning.model.reference_models import reference_config


def test_a_4bit_model_dispatched_off_the_device_is_said_with_the_fix() -> None:
    """The 8B shape in 4-bit under 6 GB (seen on the H200): accelerate's map spills a module to the
    CPU and bitsandbytes raises; the message names the budget, the weights and the fixes."""
    plan = plan_load(
        reference_config("qwen3-8b"), facts="h200", quantize="4bit", lora=True, max_memory={0: "6GB"}
    )
    exc = ValueError(
        "Some modules are dispatched on the CPU or the disk. Make sure you have enough GPU RAM to fit "
        "the quantized model."
    )
    message = weights_problem(plan, exc)
    assert message is not None
    assert "cuda:0" in message and "max_memory" in message and "GiB of weights" in message
    assert "Nothing was loaded" in message and "Fix: a larger max_memory=" in message
    assert weights_problem(plan, ValueError("something else")) is None
    assert weights_problem(plan, RuntimeError("Some modules are dispatched")) is None
