"""fast_decode="auto", the default: quantized inference on a GPU takes the fast path, nothing else changes.

Pure decisions on every recorded device profile (machine/profiles.py), with torchao's version
injected (the planner reads it from package metadata): docs/decode.md "Fast by default".
"""

from __future__ import annotations

from typing import Any

import pytest

from xpukit.machine.profiles import device_profile, machine_profile, profile_names
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load


@pytest.fixture(autouse=True)
def torchao_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import xpukit.planning.device.layout as layout_module

    monkeypatch.setattr(layout_module, "torchao_version", lambda: "0.18.0")


def _decision(plan: Any) -> Any:
    return next((d for d in plan.decisions if d.name == "fast_decode"), None)


@pytest.mark.parametrize("profile", profile_names())
@pytest.mark.parametrize("quantize", ["4bit", "8bit", "auto", None])
def test_auto_on_every_profile(profile: str, quantize: str | None) -> None:
    from xpukit.errors import InvalidRequestError

    try:
        plan = plan_load(reference_config("qwen3-0.6b"), facts=profile, quantize=quantize)
    except InvalidRequestError as exc:  # no 4-bit format on MPS: refused before any plan
        assert profile == "apple-m2" and "MPS" in str(exc)
        return
    decision = _decision(plan)
    gpu = device_profile(profile).backend in {"cuda", "xpu"}
    if gpu and plan.quantization == "torchao":
        assert decision is not None and decision.source == "auto" and plan.decode is not None
        assert plan.decode.compile and plan.decode.graph_batch_sizes == (1,)
        assert decision.value["compile"] in {"default", "reduce-overhead"}
        assert decision.value["tiers"][1] == "compiled" and plan.decode.tiered  # no wait for the compile
        for said in (
            "fast_decode by default",
            "13 tokens/s with plain generate() against 253",
            "fast_decode=False opts out",
            "59-119 s cold",
            "decodes at once",
            "warmup=True",
        ):
            assert said in decision.reason, said
    else:  # bf16, bitsandbytes, the CPU, MPS: as fast_decode=False, no decision at all
        assert decision is None and plan.decode is None


@pytest.mark.parametrize(
    ("profile", "quantize", "fused", "mode"),
    [
        # tinygemm's tile-packed int4 slices by rows, but its scales come out non-contiguous, which
        # torchao's int4 product asserts against (seen on the H200): kept apart
        ("h200", "4bit", False, "reduce-overhead"),
        ("h200", "8bit", True, "reduce-overhead"),
        ("h100", "4bit", False, "reduce-overhead"),
        ("max-1550", "4bit", False, "default"),  # plain_int32 has no row slicing in torchao 0.18
        ("arc-b580", "4bit", False, "default"),
        ("arc-b580", "8bit", True, "default"),
        ("lunar-lake", "4bit", False, "default"),
    ],
)
def test_gpu_formats_take_the_same_rules(profile: str, quantize: str, fused: bool, mode: str) -> None:
    plan = plan_load(reference_config("qwen3-8b"), facts=profile, quantize=quantize)
    decision = _decision(plan)
    assert decision.source == "auto" and decision.value["compile"] == mode
    assert plan.decode is not None and plan.decode.fused_projections is fused
    assert plan.decode.weights == plan.decode.weights.strip() and plan.decode.weights.startswith("torchao")
    assert ("fused into one product each" in decision.reason) is fused
    kept_apart = ("does not slice by rows" in decision.reason) or ("non-contiguous" in decision.reason)
    assert kept_apart is not fused
    xpu = device_profile(profile).backend == "xpu"
    assert ("not yet measured on an Intel GPU" in decision.reason) is xpu
    assert plan.decode.step_graph is not xpu


def test_opt_out_unfused_and_what_auto_leaves_alone() -> None:
    config = reference_config("qwen3-8b")
    assert plan_load(config, facts="h200", quantize="4bit", fast_decode=False).decode is None
    unfused = plan_load(config, facts="h200", quantize="4bit", fast_decode="unfused")
    assert unfused.decode.compile and not unfused.decode.fused_projections
    assert _decision(unfused).source == "user" and "fused into" not in _decision(unfused).reason
    asked = plan_load(config, facts="h200", fast_decode=True)  # bf16: asked for, fused
    assert asked.decode.fused_projections and _decision(asked).source == "user"
    assert asked.decode.weights == "bfloat16"
    # Adapters (training), bf16 and nf4 (QLoRA's format) are not loads "to run quantized".
    assert plan_load(config, facts="h200", quantize="4bit", lora=True).decode is None
    assert plan_load(config, facts="h200").decode is None
    assert plan_load(config, facts="h200", quantize="nf4").decode is None


def test_auto_over_a_split_model_keeps_the_cache_and_says_why_not_compiled() -> None:
    limits = {0: "6GiB", 1: "80GiB"}  # the int8 8B model cannot sit on one card: split over two
    plan = plan_load(
        reference_config("qwen3-8b"), facts=machine_profile("h200", 2), quantize="8bit", max_memory=limits
    )
    decision = _decision(plan)
    assert plan.device_map == "auto" and plan.quantization == "torchao"  # accelerate splits it
    assert decision.source == "fallback" and decision.value["compile"] is False
    assert decision.reason.startswith("quantized weights to run on cuda, so fast_decode by default")


def test_a_torchao_config_given_is_left_to_the_user() -> None:
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    given = TorchAoConfig(quant_type=Int8WeightOnlyConfig())
    plan = plan_load(reference_config("qwen3-8b"), facts="h200", quantize=given)
    assert plan.quantization == "torchao" and plan.decode is None
