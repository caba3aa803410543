"""load_for_xpu for real on CPU: every tiny architecture, fallbacks recorded, errors before weights."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from xpukit.demo.tiny import ARCHITECTURES
from xpukit.errors import DeviceUnavailableError, InvalidRequestError, XpukitError
from xpukit.loading.load import load_for_xpu
from xpukit.planning.plan import plan_load

ARCHS = list(ARCHITECTURES)  # every family's tiny model


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("arch", ARCHS)
def test_load_generate_and_pipeline(tiny_models, arch):
    import torch
    from transformers import AutoTokenizer, pipeline

    path = tiny_models[arch]
    model = load_for_xpu(path)
    plan = model.xpukit_plan
    assert plan.carried_out and plan.model == str(path)
    assert model.dtype == getattr(torch, plan.dtype)
    assert str(model.device) == "cpu" and plan.device_map == "cpu"
    assert model.config._attn_implementation == plan.attn_implementation == "sdpa"
    tok = AutoTokenizer.from_pretrained(path)
    out = model.generate(
        **tok(["the quick brown fox"], return_tensors="pt"), max_new_tokens=4, do_sample=False
    )
    assert out.shape[1] > 4
    text = pipeline("text-generation", model=model, tokenizer=tok)(
        "the quick", max_new_tokens=3, do_sample=False
    )
    assert text[0]["generated_text"].startswith("the quick")


def test_same_model_as_raw_from_pretrained(tiny_model, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = load_for_xpu(tiny_model)
    raw = AutoModelForCausalLM.from_pretrained(tiny_model, **model.xpukit_plan.from_pretrained_kwargs())
    batch = tokenizer(["load weight on the device"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, raw(**batch).logits)


def test_overrides_and_passthrough(tiny_model):
    import torch

    model = load_for_xpu(tiny_model, dtype="float32", attn="eager", use_cache=False)
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "eager"
    assert model.config.use_cache is False  # a config override, passed through to from_pretrained
    assert model.xpukit_plan.from_pretrained_kwargs()["use_cache"] is False
    again = load_for_xpu(model.xpukit_plan)  # a plan can be carried out as it is
    assert again.dtype == torch.float32


def test_hub_attention_kernel_that_cannot_be_had_falls_back(tiny_model, monkeypatch, tmp_path, caplog):
    from xpukit import hub

    if not hub.kernels_support().accepted:
        pytest.skip("needs a kernels release this transformers accepts")
    # A kernel the cache claims to have (refs/v1 → snapshot) but whose files are not there: the plan
    # takes it; fetching it at load fails; the load goes on with SDPA and says why.
    root = tmp_path / "kernels--acme--attn-kernel"
    commit = "abc123" + "0" * 34  # a full commit id, as the kernels library writes (>= 0.19 needs one)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "v1").write_text(commit)
    (root / "snapshots" / commit).mkdir(parents=True)
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    # dtype pinned: flash attention computes in half precision, which the plan picks on a CPU only
    # where it is native; the fallback under test must not depend on the CPU.
    plan = plan_load(tiny_model, attn="acme/attn-kernel", dtype="bfloat16")
    assert plan.attn_implementation == "acme/attn-kernel" and plan.attention_kernel == "acme/attn-kernel"
    with caplog.at_level(logging.WARNING, logger="xpukit.loading"):
        model = load_for_xpu(plan)
    carried = model.xpukit_plan
    assert model.config._attn_implementation == "sdpa" == carried.attn_implementation
    (fallback,) = carried.fallbacks
    assert fallback.what == "attn_implementation" and fallback.planned == "acme/attn-kernel"
    assert "acme/attn-kernel" in fallback.cause
    assert carried.decision("attn_implementation").source == "fallback"
    assert len([r for r in caplog.records if r.name.startswith("xpukit.loading")]) == 1
    assert "fallback attn_implementation" in carried.explain()


def test_layer_kernels_that_cannot_be_had_fall_back(tiny_model, monkeypatch, caplog):
    import xpukit.loading.hub_kernels as hub_kernels
    import xpukit.loading.load as load

    def fail(plan):
        raise FileNotFoundError("kernels-community/rmsnorm: no build for this device")

    monkeypatch.setattr(hub_kernels, "preload_layer_kernels", fail)
    plan = replace(plan_load(tiny_model), use_kernels=True)
    with caplog.at_level(logging.WARNING, logger="xpukit.loading"):
        model = load.carry_out(plan)
    carried = model.xpukit_plan
    assert carried.use_kernels is False and not getattr(model, "use_kernels", False)
    assert carried.fallbacks[0].what == "use_kernels" and "no build" in carried.fallbacks[0].cause


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weights are read."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained was called")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"dtype": "float8"}, "bfloat16"),
        ({"attn": "flash"}, "sdpa"),
        ({"attn": "flash_attention_3"}, "cuda"),
        ({"dtype": "float16", "torch_dtype": "bfloat16"}, "only dtype="),
        ({"quantize": "2bit"}, "4bit"),
        ({"max_memory": {"gpu": "1GiB"}}, "cpu"),
    ],
)
def test_bad_input_fails_before_any_weight(tiny_model, no_weights, kwargs, fix):
    with pytest.raises(XpukitError, match=fix):
        load_for_xpu(tiny_model, **kwargs)


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"target_modules": ["query", "value"]}, r"match no module.*q_proj"),
        ({"target_modules": r".*\.nothing_here"}, "match no module"),
        ({"layers_pattern": "layers"}, "LoraConfig rejected"),
    ],
)
def test_bad_lora_settings_fail_before_any_weight(tiny_model, no_weights, lora, match):
    pytest.importorskip("peft")
    with pytest.raises(InvalidRequestError, match=match):
        plan_load(tiny_model, lora=lora)


def test_lora_safety_net_drops_the_loaded_model(tiny_model, monkeypatch):
    """A model that differs from its facts fails after loading; the error must not keep it alive."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    from xpukit.loading import load
    from xpukit.planning.training.lora_request import resolve_lora

    pytest.importorskip("peft")
    loaded: list[weakref.ref] = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        out = real(cls, *args, **kwargs)  # (model, loading info): load_for_xpu asks for the report
        loaded.append(weakref.ref(out[0] if isinstance(out, tuple) else out))
        return out

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    bad = resolve_lora({"target_modules": ["no_such_layer"]}, quantized=False)
    plan = replace(plan_load(tiny_model), lora=bad)  # skips the planner's check on purpose
    with pytest.raises(InvalidRequestError, match="match no module") as err:
        load.carry_out(plan)
    gc.collect()
    assert loaded and loaded[0]() is None, "the exception's traceback still holds the loaded model"
    assert err.value is not None


def test_bad_paths_fail_before_any_weight(tmp_path, no_weights):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_for_xpu(tmp_path / "nope")
    with pytest.raises(InvalidRequestError, match=r"config\.json"):
        load_for_xpu(tmp_path)


def test_device_this_build_cannot_use(tiny_model, no_weights):
    with pytest.raises(DeviceUnavailableError, match=r"download\.pytorch\.org/whl/xpu"):
        load_for_xpu(tiny_model, device="xpu")
    # A plan made for a profile is refused here before from_pretrained would assert.
    with pytest.raises(DeviceUnavailableError, match="no XPU support"):
        load_for_xpu(tiny_model, facts="arc-b580")


def test_a_bare_config_has_nothing_to_load(no_weights):
    from xpukit.planning.model.reference_models import reference_config

    with pytest.raises(InvalidRequestError, match="no weights"):
        load_for_xpu(reference_config("qwen3-0.6b"), facts="cpu")


@pytest.mark.slow
def test_4bit_load_on_cpu(tiny_model, tokenizer):
    pytest.importorskip("bitsandbytes")
    model = load_for_xpu(tiny_model, quantize="4bit")
    plan = model.xpukit_plan
    assert plan.quantization == "4bit" and getattr(model, "is_loaded_in_4bit", False)
    # The estimate leaves out bitsandbytes' quantization state (absmax…), a few percent at most.
    assert plan.memory.weights == pytest.approx(model.get_memory_footprint(), rel=0.05)
    out = model.generate(**tokenizer(["the quick brown fox"], return_tensors="pt"), max_new_tokens=3)
    assert out.shape[1] > 3


@pytest.mark.slow
def test_lora_is_applied_and_recorded(tiny_model):
    pytest.importorskip("peft")
    model = load_for_xpu(tiny_model, lora=True)
    plan = model.xpukit_plan
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert plan.decision("lora").value.startswith("new LoRA")
    assert any(e.what == "lora" for e in plan.events)
    assert plan.use_kernels is False


# --- a Hub endpoint that accepts connections and never answers (fixture in conftest.py) ------------


CHILD = r"""
import json, sys
from xpukit.errors import InvalidRequestError
from xpukit.loading.load import load_for_xpu
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

out = {}
plan = plan_load(reference_config("qwen3-0.6b"), facts="arc-b580", kernels="auto", attn="auto")
out["attn"] = plan.attn_implementation
out["use_kernels"] = plan.use_kernels
out["why"] = dict(plan.decision("attn_implementation").rejected)
try:
    plan_load("Qwen/Qwen3-0.6B", facts="cpu")
    out["hub_id"] = "planned"
except InvalidRequestError as exc:
    out["hub_id"] = str(exc)
model = load_for_xpu(sys.argv[1], kernels="auto", attn="auto")
out["loaded"] = model.xpukit_plan.attn_implementation
out["bitsandbytes_imported"] = "bitsandbytes" in sys.modules
# peft imports bitsandbytes, whose import reaches the Hub on avx512_bf16 CPUs: LoRA, like 4-bit, must
# run under the guard (it once ran after it and hung here).
# A plan whose LoRA request was not checked by plan_load (which imports peft under its own guard):
# the load itself must import peft under the guard.
from dataclasses import replace
from xpukit.planning.training.lora_request import resolve_lora
unchecked = replace(plan_load(sys.argv[1]), lora=resolve_lora(True, quantized=False))
out["lora"] = type(load_for_xpu(unchecked)).__name__
out["lora_again"] = type(load_for_xpu(sys.argv[1], lora=True)).__name__
if len(sys.argv) > 2:
    quantized = load_for_xpu(sys.argv[1], quantize="4bit", lora=True)
    out["quantized"] = quantized.xpukit_plan.quantization
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_silent_hub_endpoint_costs_seconds_not_forever(tiny_model, silent_endpoint):
    env = {k: v for k, v in os.environ.items() if k not in {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}}
    env |= {"HF_ENDPOINT": silent_endpoint, "XPUKIT_HUB_TIMEOUT": "1"}
    args = [sys.executable, "-c", CHILD, str(tiny_model)]
    try:
        import bitsandbytes  # noqa: F401  (only to know whether the child can try the 4-bit path)

        args.append("quant")
    except ImportError:
        pass
    done = subprocess.run(
        args, capture_output=True, text=True, env=env, timeout=240, cwd=Path(tiny_model).parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["attn"] == "sdpa" and out["use_kernels"] is False
    assert "no answer" in out["why"]["kernels-community/flash-attn2"]
    assert "cannot be used" in out["hub_id"] and "no answer" in out["hub_id"]
    assert out["loaded"] == "sdpa" and out["bitsandbytes_imported"] is False
    assert out["lora"] == out["lora_again"] == "PeftModelForCausalLM"
    if len(args) > 4:
        assert out["quantized"] == "4bit"


def test_a_given_config_is_used(tiny_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model)
    config.use_cache = False
    model = load_for_xpu(tiny_model, config=config)
    assert model.config.use_cache is False
    assert model.xpukit_plan.from_pretrained_kwargs()["config"] is config
    # A config read from a model directory knows where its weights are.
    again = load_for_xpu(config)
    assert again.xpukit_plan.model == str(tiny_model) and again.config.use_cache is False
