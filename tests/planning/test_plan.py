"""plan_load decided from recorded device profiles and real-size model shapes (no hardware, no Hub)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xpukit import hub
from xpukit.errors import (
    DeviceSelectionError,
    DeviceUnavailableError,
    InvalidRequestError,
    MissingExtraError,
    PlanError,
    XpukitError,
)
from xpukit.planning.budgets import GiB
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

QWEN3_8B = "qwen3-8b"


@pytest.fixture(scope="module")
def shapes():
    """Real-size configs, built once (no network)."""
    return {
        name: reference_config(name)
        for name in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama-3.1-8b", "llama-3.1-70b")
    }


def fake_kernel(cache: Path, repo: str, version: int) -> None:
    """Lay out a Hub kernel in a kernels cache the way the kernels library does (refs/vN → snapshot)."""
    root = cache / f"kernels--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    commit = "0123abcd" * 5  # a full commit id: kernels >= 0.19 refuses anything shorter
    (root / "refs" / f"v{version}").write_text(commit)
    (root / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (root / "snapshots" / commit / "README.md").write_text("fake")


@pytest.fixture
def bnb(monkeypatch):
    """Pretend a bitsandbytes version (or none) is installed, as package metadata would say.

    torchao is hidden: these tests are about bitsandbytes, which a load without adapters takes only
    where torchao's faster formats cannot run (tests/planning/device/test_serve_quant.py).
    """

    def set_version(version: str | None) -> None:
        import xpukit._compat as compat
        import xpukit.planning.device.layout as layout
        import xpukit.planning.device.quantization as quantization

        monkeypatch.setattr(layout, "torchao_version", lambda: None)

        for module in (compat, quantization):
            real_version = module.installed_version
            monkeypatch.setattr(
                module,
                "installed_version",
                lambda pkg, v=version, real=real_version: v if pkg == "bitsandbytes" else real(pkg),
            )
            real = module.is_installed
            monkeypatch.setattr(
                module,
                "is_installed",
                lambda mod, v=version, real=real: v is not None if mod == "bitsandbytes" else real(mod),
            )

    return set_version


# --- the profile table ---------------------------------------------------------------------------

# (profile, shape, quantize) -> (device, dtype, placement kind, quantization)
TABLE = [
    ("max-1550", "qwen3-32b", None, "xpu:0", "bfloat16", "split", None),
    ("max-1550", "qwen3-8b", None, "xpu:0", "bfloat16", "single", None),
    ("max-1550", "llama-3.1-70b", "auto", "xpu:0", "bfloat16", "single", "4bit"),
    ("arc-a770", "qwen3-8b", None, "xpu:0", "bfloat16", "offload", None),
    ("arc-a770", "qwen3-8b", "4bit", "xpu:0", "bfloat16", "single", "4bit"),
    ("arc-a770", "qwen3-8b", "auto", "xpu:0", "bfloat16", "single", "4bit"),
    ("arc-b580", "qwen3-8b", "auto", "xpu:0", "bfloat16", "single", "4bit"),
    ("arc-b580", "qwen3-0.6b", "auto", "xpu:0", "bfloat16", "single", None),
    ("lunar-lake", "qwen3-8b", "4bit", "xpu:0", "bfloat16", "single", "4bit"),
    ("meteor-lake", "qwen3-0.6b", None, "xpu:0", "float16", "single", None),
    ("t4", "qwen3-0.6b", None, "cuda:0", "float16", "single", None),
    ("t4", "qwen3-8b", None, "cuda:0", "float16", "offload", None),
    ("h100", "llama-3.1-8b", None, "cuda:0", "bfloat16", "single", None),
    ("max-1550", "llama-3.1-70b", None, "xpu:0", "bfloat16", "offload", None),
    ("h100", "llama-3.1-70b", "auto", "cuda:0", "bfloat16", "single", "4bit"),
    ("cpu-bf16", "qwen3-0.6b", None, "cpu", "bfloat16", "single", None),
    ("cpu", "qwen3-0.6b", None, "cpu", "float32", "single", None),
    ("apple-m2", "qwen3-0.6b", None, "mps:0", "float16", "single", None),
]


@pytest.mark.parametrize(("profile", "shape", "quantize", "device", "dtype", "kind", "quant"), TABLE)
def test_profile_table(shapes, bnb, profile, shape, quantize, device, dtype, kind, quant):
    bnb("0.50.2")
    plan = plan_load(shapes[shape], facts=profile, quantize=quantize)
    assert plan.device.torch_device == device
    assert plan.dtype == dtype
    assert plan.memory.placement == kind
    assert plan.quantization == quant
    assert plan.attn_implementation == "sdpa"  # offline, empty kernel cache: never the Hub kernel
    key = f"{quant}/{dtype}" if quant else dtype
    assert plan.memory.weights == plan.model_facts.weights(dtype, quant)
    assert plan.memory.weights_key == key
    if kind == "single":
        assert plan.device_map == ("mps" if device == "mps:0" else device) and plan.max_memory is None
        assert plan.memory.needed <= plan.memory.budgets[0].usable
    else:
        # Never a bare "auto": accelerate drops an XPU whose free memory cannot be queried.
        assert plan.device_map == "auto" and plan.max_memory
        assert all(isinstance(k, int) for k in plan.max_memory if k != "cpu")
    if kind == "offload":
        assert "cpu" in plan.max_memory
        assert any("CPU offload" in w for w in plan.warnings)
    if kind == "split":
        assert set(plan.max_memory) == {0, 1}
        assert sum(plan.max_memory.values()) >= plan.memory.weights


def test_split_budgets_leave_the_headroom(shapes):
    plan = plan_load(shapes["qwen3-32b"], facts="max-1550")
    usable = sum(b.usable for b in plan.memory.budgets)
    assert sum(plan.max_memory.values()) == pytest.approx(usable - plan.memory.headroom, abs=2)
    assert plan.memory.needed > plan.memory.budgets[0].usable  # it really did not fit one stack


def test_unknown_free_memory_uses_the_stated_fraction(shapes):
    plan = plan_load(shapes["qwen3-0.6b"], facts="lunar-lake")
    budget = plan.memory.budgets[0]
    assert plan.device.free_memory is None
    assert budget.usable == int(plan.device.total_memory * 0.6)
    assert "cannot be queried" in budget.rule and "0.6" in budget.rule
    assert "cannot be queried" in plan.explain(verbose=True)


def test_offload_warning_points_at_4bit(shapes):
    plan = plan_load(shapes[QWEN3_8B], facts="arc-b580")
    assert plan.memory.placement == "offload"
    assert any("quantize='4bit'" in w for w in plan.warnings)


def test_no_offload_is_an_error_with_the_numbers(shapes):
    with pytest.raises(PlanError) as err:
        plan_load(shapes[QWEN3_8B], facts="arc-b580", offload=False)
    text = str(err.value)
    assert "GiB" in text and "xpu:0" in text and "headroom" in text
    assert "quantize='4bit'" in text and "offload=True" in text


def test_fits_nowhere(shapes):
    with pytest.raises(PlanError, match=r"does not fit cpu"):
        plan_load(shapes["llama-3.1-70b"], facts="cpu")
    # An H100 host with 24 GiB of RAM cannot take the 52 GiB an unquantized 70B leaves over.
    with pytest.raises(
        PlanError, match=r"quantize='4bit' \(35.79 GiB of weights\) fits; even with CPU offload"
    ):
        plan_load(shapes["llama-3.1-70b"], facts="h100")


def test_explicit_device_index(shapes):
    plan = plan_load(shapes["qwen3-0.6b"], facts="max-1550", device="xpu:1")
    assert plan.device.torch_device == "xpu:1" and plan.device_map == "xpu:1"
    assert plan.decision("device").source == "user"
    with pytest.raises(DeviceSelectionError, match="xpu:0, xpu:1"):
        plan_load(shapes["qwen3-0.6b"], facts="max-1550", device="xpu:2")


def test_given_max_memory_and_device_map(shapes):
    plan = plan_load(shapes[QWEN3_8B], facts="max-1550", max_memory={0: "10GiB", "xpu:1": "10GiB"})
    assert plan.max_memory == {0: 10 * GiB, 1: 10 * GiB} and plan.device_map == "auto"
    with pytest.raises(PlanError, match="exceed the max_memory"):
        plan_load(shapes[QWEN3_8B], facts="max-1550", max_memory={0: "1GiB"})
    plan = plan_load(shapes["qwen3-0.6b"], facts="max-1550", device_map="xpu:1")
    assert plan.device_map == "xpu:1" and plan.device.index == 1
    with pytest.raises(DeviceSelectionError, match="only 2 xpu device"):
        plan_load(shapes["qwen3-0.6b"], facts="max-1550", device_map={"": "xpu:5"})
    with pytest.raises(InvalidRequestError, match="no such device"):
        plan_load(shapes["qwen3-0.6b"], facts="max-1550", device_map={"model": "xpu:5", "lm_head": 0})


def test_headroom_rule_and_override(shapes):
    plan = plan_load(shapes[QWEN3_8B], facts="h100")
    facts = plan.model_facts
    kv = facts.kv_bytes_per_token * 4096
    assert plan.memory.headroom == kv + int(plan.memory.weights * 0.10) + 256 * 2**20
    assert plan.decision("headroom").reason == plan.memory.headroom_rule
    plan = plan_load(shapes[QWEN3_8B], facts="h100", headroom="1GiB")
    assert plan.memory.headroom == GiB and plan.decision("headroom").source == "user"


# --- dtype ---------------------------------------------------------------------------------------


def test_explicit_dtype_wins_and_emulation_warns(shapes):
    plan = plan_load(shapes["qwen3-0.6b"], facts="meteor-lake", dtype="bf16")
    assert plan.dtype == "bfloat16" and plan.decision("dtype").source == "user"
    assert any("emulated" in w for w in plan.warnings)
    plan = plan_load(shapes["qwen3-0.6b"], facts="arc-b580", dtype="float32")
    assert plan.dtype == "float32" and not plan.warnings
    assert plan.memory.weights == plan.model_facts.weights("float32")


def test_dtype_accepts_torch_dtypes_and_refuses_the_rest(shapes):
    import torch

    assert plan_load(shapes["qwen3-0.6b"], facts="h100", dtype=torch.float16).dtype == "float16"
    for bad in ("int8", torch.int8, "bfloat17"):
        with pytest.raises(InvalidRequestError, match="bfloat16"):
            plan_load(shapes["qwen3-0.6b"], facts="h100", dtype=bad)


def test_a_keyword_typo_is_refused_before_any_weight_is_read(shapes, tiny_model, monkeypatch):
    import transformers

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    from xpukit import load_for_xpu

    for typo, right in (
        ("quantise", "quantize"),
        ("devcie", "device"),
        ("ouput_loading_info", "output_loading_info"),
    ):
        with pytest.raises(InvalidRequestError, match=rf"Unknown keyword: {typo}=.*did you mean {right}\?"):
            load_for_xpu(str(tiny_model), **{typo: "x"})
    # a LoRA setting given flat is pointed into lora=, not at the closest name (lora_r is close to "lora")
    for flat, field in (("lora_r", "r"), ("lora_alpha", "lora_alpha"), ("target_modules", "target_modules")):
        with pytest.raises(
            InvalidRequestError, match=rf"{flat}=8 \(did you mean lora=\{{'{field}': 8\}}\?\)"
        ):
            load_for_xpu(str(tiny_model), lora=True, **{flat: 8})
    with pytest.raises(
        InvalidRequestError, match="rope_theta"
    ):  # not a Qwen3 config attribute in transformers 5
        plan_load(shapes["qwen3-0.6b"], facts="h100", rope_theta=1e6)
    # from_pretrained's own keywords (also those it only pops and ignores) and config attributes pass.
    plan = plan_load(
        str(tiny_model), facts="cpu", revision="main", low_cpu_mem_usage=True, use_cache=False, variant=None
    )
    assert plan.passthrough["low_cpu_mem_usage"] is True
    assert (
        plan_load(str(tiny_model), facts="cpu", trust_remote_code=True, anything=1).passthrough["anything"]
        == 1
    )


def test_torch_dtype_alias_and_conflicts(shapes):
    plan = plan_load(shapes["qwen3-0.6b"], facts="h100", torch_dtype="float16")
    assert plan.dtype == "float16"
    assert "torch_dtype" not in plan.from_pretrained_kwargs()
    with pytest.raises(InvalidRequestError, match="only dtype="):
        plan_load(shapes["qwen3-0.6b"], facts="h100", dtype="bfloat16", torch_dtype="float16")
    with pytest.raises(InvalidRequestError, match="only attn="):
        plan_load(shapes["qwen3-0.6b"], facts="h100", attn="eager", attn_implementation="sdpa")
    with pytest.raises(InvalidRequestError, match="quantize='4bit'"):
        plan_load(shapes["qwen3-0.6b"], facts="h100", load_in_4bit=True)


# --- attention -----------------------------------------------------------------------------------


def test_attention_defaults_and_refusals(shapes):
    plan = plan_load(shapes["qwen3-0.6b"], facts="t4")
    rejected = dict(plan.decision("attn_implementation").rejected)
    assert "compute capability 7.5" in rejected["kernels-community/flash-attn2"]
    assert plan_load(shapes["qwen3-0.6b"], facts="h100", attn="eager").attn_implementation == "eager"
    for bad_attn in ("flash_attention_3", "flash_attention_4"):
        with pytest.raises(InvalidRequestError, match="Hopper/Blackwell"):
            plan_load(shapes["qwen3-0.6b"], facts="arc-b580", attn=bad_attn)
    with pytest.raises(InvalidRequestError, match="cuda/xpu only"):
        plan_load(shapes["qwen3-0.6b"], facts="cpu-bf16", attn="flash_attention_2")
    with pytest.raises(InvalidRequestError, match="fp16/bf16"):
        plan_load(shapes["qwen3-0.6b"], facts="arc-b580", attn="flash_attention_2", dtype="float32")
    with pytest.raises(InvalidRequestError, match="flash_attention_2"):
        plan_load(shapes["qwen3-0.6b"], facts="arc-b580", attn="fast")


def test_flash_attn2_offline_falls_back_to_sdpa(shapes):
    plan = plan_load(shapes["qwen3-0.6b"], facts="arc-b580", attn="flash_attention_2")
    decision = plan.decision("attn_implementation")
    assert plan.attn_implementation == "sdpa" and decision.source == "fallback"
    assert "HF_HUB_OFFLINE" in decision.reason
    assert any("flash_attention_2" in w for w in plan.warnings)
    assert plan.attention_kernel is None


def test_flash_attn2_without_kernels_falls_back(shapes, monkeypatch):
    missing = hub.KernelsSupport(
        installed=None,
        required=">=0.17.2,<0.18",
        transformers="5",
        accepted=False,
        reason='the `kernels` package is not installed (pip install "xpukit[kernels]")',
    )
    monkeypatch.setattr("xpukit.sources.hub_access.kernels_support", lambda: missing)
    plan = plan_load(shapes["qwen3-0.6b"], facts="h100", attn="flash_attention_2")
    assert plan.attn_implementation == "sdpa"
    assert "xpukit[kernels]" in plan.decision("attn_implementation").reason


def test_installed_but_rejected_kernels_is_named(shapes, monkeypatch):
    monkeypatch.setattr(hub, "_transformers_kernels_requirement", lambda: ">=0.18.2,<0.19")
    hub.kernels_support.cache_clear()
    try:
        plan = plan_load(shapes["qwen3-0.6b"], facts="arc-b580", attn="flash_attention_2")
        reason = plan.decision("attn_implementation").reason
        assert "is installed, but transformers" in reason and "kernels>=0.18.2" in reason
    finally:
        hub.kernels_support.cache_clear()


def test_cached_flash_attn2_is_chosen(shapes, monkeypatch, tmp_path):
    if not hub.kernels_support().accepted:
        pytest.skip("needs a kernels release this transformers accepts")
    from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_VERSIONS

    fake_kernel(
        tmp_path, "kernels-community/flash-attn2", FLASH_ATTN_KERNEL_VERSIONS["kernels-community/flash-attn2"]
    )
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "_probe", _no_network)
    plan = plan_load(shapes["qwen3-0.6b"], facts="arc-b580")
    assert plan.attn_implementation == "kernels-community/flash-attn2"
    assert plan.attention_kernel == "kernels-community/flash-attn2"
    assert "local kernel cache" in plan.decision("attn_implementation").reason
    # ...but never on a device without flash-attn2 builds, and never for a model that lacks it.
    assert plan_load(shapes["qwen3-0.6b"], facts="t4").attn_implementation == "sdpa"


# --- use_kernels ---------------------------------------------------------------------------------


def test_use_kernels_rules(shapes, monkeypatch, tmp_path):
    with pytest.raises(InvalidRequestError, match="KernelConfig accepts"):
        plan_load(shapes["qwen3-0.6b"], facts="cpu-bf16", kernels=True)
    cpu = plan_load(shapes["qwen3-0.6b"], facts="cpu-bf16")
    assert cpu.use_kernels is False and "replaces nothing" in cpu.decision("use_kernels").reason
    offline = plan_load(shapes["qwen3-0.6b"], facts="arc-b580")
    assert offline.use_kernels is False and "not in the local cache" in offline.decision("use_kernels").reason
    asked = plan_load(shapes["qwen3-0.6b"], facts="arc-b580", kernels=True)
    assert asked.use_kernels is False and asked.decision("use_kernels").source == "fallback"
    assert offline.from_pretrained_kwargs()["use_kernels"] is False  # given: transformers >= 5.25 defaults on
    if not hub.kernels_support().accepted:
        return
    from xpukit.planning.device.layer_kernels import mapping_refs

    # The kernels this transformers' default mapping names for Qwen3's layers on XPU (they differ by
    # release: 5.22 maps RMSNorm to kernels-community/rmsnorm, 5.25 no RMSNorm kernel on XPU).
    refs = mapping_refs(offline.model_facts.kernel_layers, "xpu")
    assert refs
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    for ref in refs[1:]:
        fake_kernel(tmp_path, ref.repo, ref.version or 1)
    one_missing = plan_load(shapes["qwen3-0.6b"], facts="arc-b580")
    assert one_missing.use_kernels is False and refs[0].repo in one_missing.decision("use_kernels").reason
    fake_kernel(tmp_path, refs[0].repo, refs[0].version or 1)
    cached = plan_load(shapes["qwen3-0.6b"], facts="arc-b580")
    assert cached.use_kernels is True and cached.from_pretrained_kwargs()["use_kernels"] is True
    reason = cached.decision("use_kernels").reason
    assert "in the local kernel cache" in reason and all(ref.repo in reason for ref in refs)


# --- quantization --------------------------------------------------------------------------------


def test_quantize_auto_without_bitsandbytes_says_what_it_would_do(shapes, bnb):
    bnb(None)
    plan = plan_load(shapes[QWEN3_8B], facts="arc-b580", quantize="auto")
    reason = plan.decision("quantization").reason
    assert plan.quantization is None and plan.memory.placement == "offload"
    assert "would pick 4-bit" in reason and "xpukit[quant]" in reason


def test_explicit_4bit_needs_bitsandbytes_here(shapes, bnb, tiny_model):
    bnb(None)
    with pytest.raises(MissingExtraError, match=r"xpukit\[quant\]"):
        plan_load(tiny_model, quantize="4bit")  # this machine: enforced
    plan = plan_load(shapes[QWEN3_8B], facts="arc-b580", quantize="4bit")  # assumed machine: noted
    assert plan.quantization == "4bit" and any("xpukit[quant]" in w for w in plan.warnings)
    bnb("0.47.0")
    with pytest.raises(MissingExtraError, match=r">=0\.48"):
        plan_load(tiny_model, quantize="8bit")


def test_arc_a_with_old_bitsandbytes_computes_in_fp16(shapes, bnb):
    bnb("0.49.0")
    plan = plan_load(shapes[QWEN3_8B], facts="arc-a770", quantize="4bit")
    assert plan.dtype == "float16" and plan.quantization_config["bnb_4bit_compute_dtype"] == "float16"
    assert "0.50" in plan.decision("dtype").reason
    with pytest.raises(InvalidRequestError, match=r"bitsandbytes>=0\.50"):
        plan_load(shapes[QWEN3_8B], facts="arc-a770", quantize="4bit", dtype="bfloat16")
    bnb("0.50.2")
    assert plan_load(shapes[QWEN3_8B], facts="arc-a770", quantize="4bit").dtype == "bfloat16"


def test_quantize_refusals(shapes, bnb):
    bnb("0.50.2")
    with pytest.raises(InvalidRequestError, match="no MPS backend"):
        plan_load(shapes["qwen3-0.6b"], facts="apple-m2", quantize="4bit")
    with pytest.raises(InvalidRequestError, match="'4bit'"):
        plan_load(shapes["qwen3-0.6b"], facts="h100", quantize="3bit")
    with pytest.raises(PlanError, match="fp32"):  # a 4-bit 70B does not fit one B580 and is not offloaded
        plan_load(shapes["llama-3.1-70b"], facts="arc-b580", quantize="4bit")


def test_4bit_config_and_user_config(shapes, bnb):
    import torch
    from transformers import BitsAndBytesConfig

    bnb("0.50.2")
    plan = plan_load(shapes[QWEN3_8B], facts="h100", quantize="4bit", dtype="float16")
    cfg = plan.from_pretrained_kwargs()["quantization_config"]
    assert cfg.load_in_4bit and cfg.bnb_4bit_quant_type == "nf4" and cfg.bnb_4bit_use_double_quant
    assert cfg.bnb_4bit_compute_dtype == torch.float16
    mine = BitsAndBytesConfig(load_in_8bit=True)
    plan = plan_load(shapes[QWEN3_8B], facts="h100", quantize=mine)
    assert plan.quantization == "8bit" and plan.from_pretrained_kwargs()["quantization_config"] is mine
    assert plan.quantization_config["load_in_8bit"] is True
    offloading = BitsAndBytesConfig(load_in_4bit=True, llm_int8_enable_fp32_cpu_offload=True)
    plan = plan_load(shapes["qwen3-32b"], facts="arc-a770", quantize=offloading)
    assert plan.memory.placement == "offload"


# --- the plan object -----------------------------------------------------------------------------


def test_explain_is_short_by_default_and_full_on_request(shapes):
    plan = plan_load(shapes[QWEN3_8B], facts="arc-b580", lora=True, batch_size=4, seq_len=512)
    short, full = plan.explain(), plan.explain(verbose=True)
    rows = [line for line in short.splitlines() if line.startswith("  ") and not line.startswith("  !")]
    for d in plan.decisions:  # every choice, with one line of reason (a long value takes its own line)
        (row,) = [r for r in rows if r.split()[0] == d.name]
        assert len(row) <= 100
    squeezed = "".join(full.split())  # the full form wraps every reason whole
    assert all("".join(d.reason.split()) in squeezed for d in plan.decisions)
    assert "Rejected alternatives" in full and "Rejected alternatives" not in short
    assert "from_pretrained(" in full and "from_pretrained(" not in short
    assert "Memory: " in short and "Training: batch 4 × seq 512" in short
    assert all("".join(w.split()) in "".join(short.split()) for w in plan.warnings)  # warnings stay whole
    assert len(short.splitlines()) <= 40 < len(full.splitlines())


def test_plan_is_explained_serialised_and_frozen(shapes):
    import dataclasses

    plan = plan_load(shapes[QWEN3_8B], facts="lunar-lake", quantize="auto")
    text = plan.explain()
    for d in plan.decisions:
        assert d.name in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["dtype"] == plan.dtype and data["memory"]["weights"] == plan.memory.weights
    assert {d["name"] for d in data["decisions"]} >= {"device", "dtype", "device_map", "attn_implementation"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dtype = "float32"  # type: ignore[misc]
    import torch

    assert plan.from_pretrained_kwargs()["dtype"] is torch.bfloat16


def test_plan_makes_no_network_call_even_online(shapes, monkeypatch, tmp_path):
    """Without HF_HUB_OFFLINE every connection attempt fails loudly; a plan that needs the Hub's
    status finds it unreachable through the bounded probe (whose thread hits the patched connect),
    and a plan that needs nothing from the Hub never tries at all."""
    import socket

    attempts: list[object] = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError("network disabled by the test")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(hub, "_STATUS_CACHE", {})
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))  # empty: kernels would need the Hub
    assert not hub.hub_offline()
    plan_load(shapes["qwen3-0.6b"], facts="arc-b580", attn="sdpa", kernels=False)
    assert attempts == []  # nothing Hub-backed on the table: not even a probe
    plan = plan_load(shapes["qwen3-0.6b"], facts="arc-b580", attn="flash_attention_2", kernels=True)
    assert plan.attn_implementation == "sdpa" and plan.use_kernels is False
    assert "network disabled" in plan.decision("attn_implementation").reason
    assert len(attempts) == 1  # one probe, its failure cached for the second choice


def test_hub_id_not_cached_offline_is_refused():
    with pytest.raises(InvalidRequestError, match=r"hf download Qwen/Qwen3-0\.6B"):
        plan_load("Qwen/Qwen3-0.6B", facts="cpu")


def test_bad_paths(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        plan_load(str(tmp_path / "missing" / "model"), facts="cpu")
    with pytest.raises(InvalidRequestError, match=r"no config\.json"):
        plan_load(tmp_path, facts="cpu")


def test_torch_build_without_the_backend_is_refused(tiny_model):
    # This CPU wheel: transformers itself would raise a bare AssertionError from from_pretrained.
    with pytest.raises(DeviceUnavailableError, match="whl/xpu"):
        plan_load(tiny_model, device="xpu")
    with pytest.raises(DeviceUnavailableError, match="whl/cu"):
        plan_load(tiny_model, device="cuda:0")
    with pytest.raises(InvalidRequestError, match="not a device"):
        plan_load(tiny_model, device="gpu")


def test_errors_are_xpukit_errors(shapes):
    for kwargs in ({"dtype": "int4"}, {"attn": "nope"}, {"kernels": "maybe"}, {"max_memory": {"gpu0": 1}}):
        with pytest.raises(XpukitError):
            plan_load(shapes["qwen3-0.6b"], facts="h100", **kwargs)


@pytest.mark.slow
def test_planning_for_a_profile_imports_no_bitsandbytes_and_initialises_nothing():
    code = (
        "import sys, xpukit.planning.plan as p\n"
        "assert 'torch' not in sys.modules\n"
        "from xpukit.planning.model.reference_models import reference_config\n"
        "import xpukit.machine.probe as probe\n"
        "probe.detect = lambda **k: (_ for _ in ()).throw(AssertionError('detect called'))\n"
        "plan = p.plan_load(reference_config('qwen3-8b'), facts='arc-b580', quantize='4bit')\n"
        "import torch\n"
        "assert not probe.runtime_initialized()\n"
        "assert not torch.xpu.is_initialized() and not torch.cuda.is_initialized()\n"
        "print(plan.memory.weights, 'bitsandbytes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    weights, bnb_imported = out.stdout.split()
    assert int(weights) > 5 * GiB and bnb_imported == "False"


def _no_network(*args, **kwargs):
    raise AssertionError("the Hub was contacted")


# --- xpukit plan ---------------------------------------------------------------------------------


def test_cli_plan_json_and_text(capsys):
    from xpukit.cli.main import main

    assert main(["plan", "qwen3-8b", "--assume", "arc-b580", "--quantize", "nf4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device_map"] == "xpu:0" and data["quantization"] == "4bit"
    assert data["machine"]["source"] == "profile:arc-b580"
    spec = ["plan", "qwen3-8b", "--assume", "max-1550x2", "--max-memory", "0=20GiB,1=20GiB"]
    assert main([*spec, "--explain"]) == 0
    full = capsys.readouterr().out
    assert "max_memory argument" in full and "Rejected alternatives" in full
    assert main(spec) == 0  # the short form: the choices, one line of reason each
    short = capsys.readouterr().out
    assert "Rejected alternatives" not in short and "explain(verbose=True)" in short
    assert len(short.splitlines()) < len(full.splitlines()) / 2


def test_cli_plan_says_what_a_profile_is_and_offers_the_built_in_shapes(capsys, monkeypatch):
    from xpukit.cli.main import main

    assert main(["plan", "qwen3-8b", "--assume", "arc-b580", "--explain"]) == 0
    out = capsys.readouterr().out
    # A recorded profile was described as "free memory reported by the runtime".
    assert "recorded profile: its 12.00 GiB, all assumed free" in out and "reported by the runtime" not in out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "qwen3-9b"]) == 1
    err = capsys.readouterr().err
    assert "hf download qwen3-9b" in err
    assert "Did you mean the built-in shape 'qwen3-8b'?" in err


def test_plan_load_takes_the_built_in_shapes_and_gives_the_clis_advice(monkeypatch, capsys):
    """plan_load('qwen3-8b') plans the built-in shape as `xpukit plan qwen3-8b` does; a Hub id that
    cannot be read names the built-in shape only when that shape is this model's (the same words from
    the API and the command line), never as if any shape were the model asked for."""
    from xpukit.cli.main import main
    from xpukit.errors import InvalidRequestError

    plan = plan_load("qwen3-8b", facts="h100")
    assert plan.model is None and plan.model_facts.architecture == "Qwen3ForCausalLM"
    assert plan.model_facts.num_parameters > 8e9
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InvalidRequestError) as info:
        plan_load("Qwen/Qwen3-8B", facts="h100")
    assert "the built-in shape 'qwen3-8b' has Qwen/Qwen3-8B's config" in str(info.value)
    assert main(["plan", "Qwen/Qwen3-8B"]) == 1
    assert str(info.value) in capsys.readouterr().err
    with pytest.raises(InvalidRequestError) as info:
        plan_load("someone/some-model", facts="h100")
    assert "built-in" not in str(info.value) and "qwen3" not in str(info.value)


def test_cli_plan_errors_exit_1(capsys):
    from xpukit.cli.main import main

    assert main(["plan", "qwen3-8b", "--assume", "arc-b580", "--no-offload"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("xpukit plan: error:") and "quantize='4bit'" in err
    assert main(["plan", "qwen3-8b", "--assume", "arc-b580", "--max-memory", "lots"]) == 1
    assert "DEVICE=SIZE" in capsys.readouterr().err
    assert main(["plan", "qwen3-8b", "--assume", "rtx-9090"]) == 1
    assert "arc-b580" in capsys.readouterr().err


# --- shared memory, pre-quantized checkpoints, given maps, families, inputs -------------------------


def test_integrated_gpu_and_host_are_one_pool(shapes):
    from dataclasses import replace

    from xpukit.machine.profiles import machine_profile

    laptop = machine_profile("lunar-lake")
    assert laptop.cpu.total_memory == 16 * GiB and "shared" in laptop.cpu.name
    assert machine_profile("apple-m2").cpu == machine_profile("meteor-lake").cpu == laptop.cpu
    assert machine_profile("arc-b580").cpu.total_memory == 24 * GiB
    # 16 GB shared: the iGPU's 9.6 GiB leave the host nothing more to offload to.
    with pytest.raises(PlanError, match="shares it") as err:
        plan_load(shapes[QWEN3_8B], facts="lunar-lake")
    assert "quantize='4bit'" in str(err.value)
    # A detected 32 GB laptop with 28 GiB free: the host budget is what the iGPU does not use.
    host_facts = replace(laptop.cpu, total_memory=32 * GiB, free_memory=28 * GiB)
    machine = replace(laptop, cpu=host_facts, source="hand-made")
    plan = plan_load(shapes["llama-3.1-8b"], facts=machine, headroom="1GiB")
    host = plan.memory.budgets[-1]
    igpu = plan.memory.budgets[0]
    assert plan.memory.placement == "offload" and host.device == "cpu"
    assert host.usable == 28 * GiB - igpu.usable and plan.max_memory["cpu"] == host.usable
    assert "shared" in host.rule
    # A discrete card's host is separate memory: all of it counts.
    b580 = plan_load(shapes[QWEN3_8B], facts="arc-b580")
    assert b580.max_memory["cpu"] == 24 * GiB


def _prequantized(shape, quantization_config):
    config = reference_config(shape)
    config.quantization_config = quantization_config
    return config


def test_pre_quantized_checkpoints_are_sized_quantized(shapes, bnb):
    bnb("0.50.2")
    unquantized = plan_load(shapes[QWEN3_8B], facts="arc-b580", quantize="4bit").model_facts
    bnb4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    plan = plan_load(_prequantized(QWEN3_8B, bnb4), facts="arc-b580")
    assert plan.memory.placement == "single" and plan.device_map == "xpu:0"
    assert plan.memory.weights == unquantized.weights("bfloat16", "4bit")
    assert plan.quantization is None  # the checkpoint's own config does the quantizing
    assert "already quantized" in plan.decision("quantization").reason
    assert not any("quantize=" in w for w in plan.warnings)
    auto = plan_load(_prequantized(QWEN3_8B, bnb4), facts="arc-b580", quantize="auto")
    assert auto.quantization is None and "nothing to do" in auto.decision("quantization").reason
    with pytest.raises(InvalidRequestError, match="already quantized"):
        plan_load(_prequantized(QWEN3_8B, bnb4), facts="arc-b580", quantize="4bit")
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    eight = plan_load(_prequantized(QWEN3_8B, {**gptq, "bits": 8}), facts="h100")
    assert plan_load(_prequantized(QWEN3_8B, gptq), facts="h100").memory.weights < eight.memory.weights
    assert eight.memory.weights < unquantized.weights("bfloat16")
    # Too big even quantized: never offloaded, never told to quantize again.
    with pytest.raises(PlanError, match="already quantized") as err:
        plan_load(_prequantized("llama-3.1-70b", gptq), facts="arc-b580")
    assert "quantize=" not in str(err.value)


def test_dict_device_map_on_one_device_sets_the_device(shapes):
    plan = plan_load(shapes["qwen3-0.6b"], facts="meteor-lake", device_map={"": "cpu"})
    assert plan.device.backend == "cpu" and plan.dtype == "float32"  # the laptop CPU has no bf16
    assert plan.attn_implementation == "sdpa" and plan.use_kernels is False
    on_one = plan_load(shapes["qwen3-0.6b"], facts="max-1550", device_map={"model": 1, "lm_head": "xpu:1"})
    assert on_one.device.torch_device == "xpu:1"
    with pytest.raises(InvalidRequestError, match=r"disagree|puts every module"):
        plan_load(shapes["qwen3-0.6b"], facts="max-1550", device="xpu:0", device_map={"": "xpu:1"})


def test_modules_off_the_accelerator_refuse_hub_kernels(shapes):
    mixed = {"model.embed_tokens": "cpu", "model.layers": 0, "model.norm": 0, "lm_head": 0}
    plan = plan_load(shapes["qwen3-0.6b"], facts="arc-b580", device_map=mixed)
    assert plan.attn_implementation == "sdpa" and plan.use_kernels is False
    assert (
        "device_map puts modules on cpu"
        in dict(plan.decision("attn_implementation").rejected)["kernels-community/flash-attn2"]
    )
    with pytest.raises(InvalidRequestError, match="device_map puts modules on cpu"):
        plan_load(shapes["qwen3-0.6b"], facts="arc-b580", device_map=mixed, attn="flash_attention_2")
    with pytest.raises(InvalidRequestError, match="device_map puts modules on cpu"):
        plan_load(shapes["qwen3-0.6b"], facts="arc-b580", device_map=mixed, kernels=True)


def test_quantize_auto_honours_a_given_map_or_budget(shapes, bnb):
    bnb("0.50.2")
    plan = plan_load(shapes[QWEN3_8B], facts="arc-b580", device_map="xpu:0", quantize="auto")
    assert plan.quantization == "4bit" and "given device_map" in plan.decision("quantization").reason
    small = plan_load(shapes["qwen3-0.6b"], facts="arc-b580", device_map="xpu:0", quantize="auto")
    assert small.quantization is None and "not needed" in small.decision("quantization").reason
    budget = plan_load(shapes[QWEN3_8B], facts="arc-b580", max_memory={0: "10GiB"}, quantize="auto")
    assert budget.quantization == "4bit" and budget.max_memory == {0: 10 * GiB}
    # A given device that is too small: planned as asked, with a warning that names the fix.
    tight = plan_load(shapes[QWEN3_8B], facts="arc-b580", device_map="xpu:0")
    assert tight.quantization is None
    assert any("may run out of memory" in w and "quantize='4bit'" in w for w in tight.warnings)


@pytest.mark.parametrize(
    ("profile", "auto_takes_it"),
    [
        ("max-1100", True),
        ("arc-b580", True),
        ("lunar-lake", True),
        ("arc-a770", False),
        ("meteor-lake", False),
    ],
)
def test_flash_attn2_auto_only_on_the_families_it_targets(
    shapes, monkeypatch, tmp_path, profile, auto_takes_it
):
    if not hub.kernels_support().accepted:
        pytest.skip("needs a kernels release this transformers accepts")
    from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_VERSIONS

    repo = "kernels-community/flash-attn2"
    fake_kernel(tmp_path, repo, FLASH_ATTN_KERNEL_VERSIONS[repo])
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    dtype = "float16" if profile == "meteor-lake" else "auto"
    auto = plan_load(shapes["qwen3-0.6b"], facts=profile, dtype=dtype)
    assert (auto.attn_implementation == repo) is auto_takes_it
    if auto_takes_it:
        return
    assert "pytorch#167057" in dict(auto.decision("attn_implementation").rejected)[repo]
    asked = plan_load(shapes["qwen3-0.6b"], facts=profile, dtype=dtype, attn="flash_attention_2")
    assert asked.attn_implementation == repo
    assert any("target" in w and profile.split("-")[0] in w for w in asked.warnings)


def test_user_bnb_config_with_bf16_compute_on_arc_a_warns(shapes, bnb):
    import torch
    from transformers import BitsAndBytesConfig

    mine = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    bnb("0.49.0")
    plan = plan_load(shapes[QWEN3_8B], facts="arc-a770", quantize=mine)
    assert plan.from_pretrained_kwargs()["quantization_config"] is mine  # used as given
    assert any("bitsandbytes>=0.50" in w for w in plan.warnings)
    fp16 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float16)
    assert not any("0.50" in w for w in plan_load(shapes[QWEN3_8B], facts="arc-a770", quantize=fp16).warnings)
    bnb("0.50.2")
    assert not any("0.50" in w for w in plan_load(shapes[QWEN3_8B], facts="arc-a770", quantize=mine).warnings)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kernels": ["x"]}, "KernelConfig"),
        ({"max_memory": {0: float("inf")}}, "finite"),
        ({"headroom": float("inf")}, "finite"),
        ({"headroom": "9999999TiB"}, "1 PiB"),
        ({"model_class": "AutoModelForCausalLMM"}, "AutoModelForCausalLM'"),
        ({"model_class": 42}, "from_pretrained"),
    ],
)
def test_bad_input_is_an_invalid_request(shapes, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        plan_load(shapes["qwen3-0.6b"], facts="arc-b580", **kwargs)


def test_other_quantization_configs_pass_through(shapes):
    from transformers import GPTQConfig, QuantoConfig

    quanto = QuantoConfig(weights="int4")
    plan = plan_load(shapes[QWEN3_8B], facts="arc-b580", quantization_config=quanto)
    assert plan.quantization == "quanto" and plan.from_pretrained_kwargs()["quantization_config"] is quanto
    facts = plan.model_facts
    assert plan.memory.weights == facts.weights_at_bits("bfloat16", 4) < facts.weights("bfloat16")
    assert plan.memory.placement == "single" and "4-bit" in plan.memory.weights_key
    assert "QuantoConfig" in json.dumps(plan.to_dict())
    gptq = plan_load(shapes[QWEN3_8B], facts="h100", quantize=GPTQConfig(bits=8))
    assert gptq.memory.weights == facts.weights_at_bits("bfloat16", 8)

    class Custom:  # a config that states no bit width: sized unquantized, and the plan says so
        quant_method = "custom"

        def to_dict(self):
            return {"quant_method": "custom"}

    odd = plan_load(shapes["qwen3-0.6b"], facts="h100", quantize=Custom())
    assert odd.memory.weights == odd.model_facts.weights("bfloat16")
    assert any("unquantized" in w for w in odd.warnings)


def test_plan_load_and_load_for_xpu_take_exactly_the_request_s_keywords() -> None:
    """LoadRequest (planning/request.py) is the one listing of the request: plan_load's and
    load_for_xpu's signatures are its keywords, names, defaults and types, and nothing else."""
    import inspect

    from xpukit.loading.load import load_for_xpu
    from xpukit.planning.request import LoadRequest

    def keywords(fn: object) -> list[tuple[str, object, object, object]]:
        params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
        return [(p.name, p.kind, p.default, p.annotation) for p in params if p.name != "model"]

    listed = keywords(LoadRequest)
    assert [name for name, *_ in listed][-1] == "from_pretrained_kwargs"
    assert keywords(plan_load) == listed
    assert keywords(load_for_xpu) == listed
    # The keywords really reach the request: an unknown value is refused by LoadRequest's checks.
    with pytest.raises(InvalidRequestError, match="fast_decode='fastest'"):
        plan_load("Qwen/Qwen3-0.6B", fast_decode="fastest")


def test_the_request_s_keyword_list_is_written_once_in_src() -> None:
    """Each keyword is declared (``name: type = default``) once in src: in LoadRequest's
    constructor; nowhere are they listed again or passed on one by one (``device=device, ...``)."""
    from pathlib import Path

    from xpukit.planning.request import LoadRequest, keywords

    src = Path(__file__).resolve().parents[2] / "src" / "xpukit"
    names = keywords()
    assert len(names) >= 20 and names[:3] == ("device", "dtype", "attn")
    listings, forwarded = [], []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        declared = [name for name in names if re.search(rf"^\s+{name}: [^=\n]+= [^\n]+,$", text, re.M)]
        if len(declared) > len(names) // 2:  # a signature (or a class) listing the request
            listings.append(path.relative_to(src).as_posix())
        passed = [name for name in names if re.search(rf"\b{name}={name}\b", text)]
        if len(passed) > len(names) // 2:
            forwarded.append(path.relative_to(src).as_posix())
    assert listings == ["planning/request.py"]
    assert forwarded == []
    request = LoadRequest(dtype="bf16", trust_remote_code=True)
    assert request.dtype == "bfloat16" and request.from_pretrained_kwargs == {"trust_remote_code": True}
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.dtype = "float32"  # type: ignore[misc]


def test_quantize_to_run_without_an_importable_torchao_falls_back_to_bitsandbytes(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchao's metadata without an importable module (or no torchao at all): the plan takes
    bitsandbytes nf4 and says why, rather than planning torchao for a load that would refuse it;
    without bitsandbytes either, the error names both installs."""
    import xpukit._compat as compat
    import xpukit.planning.device.serve_quant as serve_quant
    from xpukit.errors import MissingExtraError

    hidden: set[str] = {"torchao"}
    real = compat.is_installed

    def is_installed(module: str) -> bool:
        return module.split(".")[0] not in hidden and real(module)

    import xpukit.planning.device.quantization as quantization

    for module in (serve_quant, compat, quantization):
        monkeypatch.setattr(module, "is_installed", is_installed)
    pytest.importorskip("bitsandbytes")
    plan = plan_load(tiny_model, device="cpu", dtype="bfloat16", quantize="4bit")
    assert plan.quantization == "4bit"
    assert "bitsandbytes nf4, the slower format" in plan.decision("quantization").reason
    assert "torchao is not installed" in plan.decision("quantization").reason
    hidden.add("bitsandbytes")
    with pytest.raises(MissingExtraError) as info:
        plan_load(tiny_model, device="cpu", dtype="bfloat16", quantize="4bit")
    assert 'pip install "xpukit[quant]"' in str(info.value) and 'pip install "xpukit[serve]"' in str(
        info.value
    )


def test_doctor_says_what_torchao_enables() -> None:
    from xpukit.doctor.ecosystem import enabled_by_versions

    for torchao, says in (
        (None, 'no torchao, so quantize="4bit"/"8bit" loads to run use bitsandbytes'),
        ("0.18.0", 'torchao 0.18.0: quantize="4bit"/"8bit" loads to run'),
    ):
        lines = enabled_by_versions({"torchao": torchao}, kernels_accepted=None, kernels_reason="")
        assert any(says in line for line in lines), lines
