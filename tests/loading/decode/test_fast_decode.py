"""fast_decode=True: the decision per device (pure), and what the load sets and runs (CPU, tiny models).

Compiled decoding itself runs only on CUDA/XPU (bench/bench_decode.py measures it); here the CPU
fallback is checked to be recorded, and the static-cache and compile settings xpukit writes are
checked to leave greedy tokens, sampling and pipeline() working.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.loading.load import carry_out, load_for_xpu
from xpukit.planning.budgets import HEADROOM_FIXED, HEADROOM_WEIGHT_FRACTION
from xpukit.planning.device.decode import CACHE_LENGTH_STEP, DecodePlan
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

PROMPTS = [
    "the quick brown fox",
    "a",
    "when the bell rings in the morning",
    "bread",
    "x y",
    "fox",
    "the",
    "ok",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.padding_side = "left"
    return tok


def _greedy(model, tokenizer, batch):
    import torch

    inputs = tokenizer(PROMPTS[:batch], return_tensors="pt", padding=True)
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)


def test_auto_by_default_changes_nothing_here_and_only_known_values(tiny_model):
    plan = plan_load(tiny_model)  # "auto" on the CPU, unquantized: as fast_decode=False
    assert plan.decode is None and "fast_decode" not in {d.name for d in plan.decisions}
    assert plan_load(tiny_model, fast_decode="AUTO").decode is None
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidRequestError, match="expected True, False, 'auto'"):
            plan_load(tiny_model, fast_decode=bad)


@pytest.mark.parametrize(("facts", "mode"), [("h200", "reduce-overhead"), ("max-1550", "default")])
def test_cuda_and_xpu_compile_with_a_cache_sized_from_the_headroom(facts, mode):
    plan = plan_load(reference_config("qwen3-8b"), facts=facts, fast_decode=True)
    decision = plan.decision("fast_decode")
    assert decision.source == "user" and plan.decode is not None
    budget = plan.memory.headroom - int(plan.memory.weights * HEADROOM_WEIGHT_FRACTION) - HEADROOM_FIXED
    per_token = plan.model_facts.kv_bytes_per_token
    assert plan.decode.max_cache_len == budget // per_token // CACHE_LENGTH_STEP * CACHE_LENGTH_STEP == 4096
    first = "graph" if facts == "h200" else "eager"  # the tier that serves while the step compiles
    assert decision.value == {
        "static_cache": True,
        "max_cache_len": 4096,
        "compile": mode,
        "tiers": [first, "compiled"],
    }
    assert plan.decode.graph_batch_sizes == (1,) and plan.decode.tiered
    assert "decodes at once with the uncompiled step" in decision.reason
    assert "4096 tokens" in decision.reason and "fast_decode" in plan.explain()
    assert plan.to_dict()["decode"] == decision.value
    # grouped decode attention: measured on CUDA only (docs/decode-internals.md "Grouped decode attention")
    assert plan.decode.grouped_attention == (facts == "h200")
    assert ("repeat_kv" in decision.reason) == (facts == "h200")
    # On CUDA xpukit's loop compiles its step without inductor's graphs and captures it itself.
    assert plan.decode.step_graph == (facts == "h200")
    assert plan.decode.loop_compile_options() == {"fullgraph": True, "dynamic": False, "mode": "default"}
    assert ("captures the step as one CUDA graph" in decision.reason) == (facts == "h200")


def test_grouped_attention_is_applied_and_recorded(tiny_model):
    from transformers import AutoModelForCausalLM

    from xpukit.loading.decode.attention import NAME
    from xpukit.loading.decode.fast_decode import _grouped_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    event = _grouped_attention(model)
    assert (event.kind, event.actual) == ("applied", NAME) and "repeat_kv" in event.cause
    eager = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    event = _grouped_attention(eager)
    assert (event.kind, event.actual) == ("note", "eager") and "kept 'eager'" in event.cause


def test_cache_length_follows_the_headroom_and_the_context():
    config = reference_config("qwen3-0.6b")
    plan = plan_load(config, facts="h200", headroom="1GiB", fast_decode=True)
    budget = 2**30 - int(plan.memory.weights * HEADROOM_WEIGHT_FRACTION) - HEADROOM_FIXED
    expected = budget // plan.model_facts.kv_bytes_per_token // CACHE_LENGTH_STEP * CACHE_LENGTH_STEP
    assert plan.decode is not None and plan.decode.max_cache_len == expected > 4096
    config.max_position_embeddings = 1000
    assert plan_load(config, facts="h200", headroom="1GiB", fast_decode=True).decode.max_cache_len == 768
    small = plan_load(reference_config("qwen3-0.6b"), facts="h200", headroom="300MiB", fast_decode=True)
    assert small.decode is not None and not small.decode.static_cache
    assert (
        small.decision("fast_decode").source == "fallback"
        and "headroom" in small.decision("fast_decode").reason
    )


def test_not_compiled_for_bitsandbytes_or_a_split_model():
    from xpukit.machine.profiles import machine_profile

    quantized = plan_load(reference_config("qwen3-8b"), facts="arc-b580", quantize="nf4", fast_decode=True)
    decision = quantized.decision("fast_decode")
    # Measured slower than plain generate: nothing changes (tests/planning/device/test_serve_quant.py has
    # the rest).
    assert decision.value["compile"] is False and decision.value["static_cache"] is False
    assert decision.source == "fallback" and "bitsandbytes" in decision.reason
    assert quantized.decode is not None and quantized.decode.graph_batch_sizes == ()
    split = plan_load(reference_config("llama-3.1-70b"), facts=machine_profile("h200", 2), fast_decode=True)
    assert split.memory.placement == "split"
    assert split.decision("fast_decode").value["compile"] is False


@pytest.mark.parametrize("facts", ["cpu", "apple-m2"])
def test_cpu_and_mps_change_nothing_and_say_why(facts):
    plan = plan_load(reference_config("qwen3-0.6b"), facts=facts, fast_decode=True)
    decision = plan.decision("fast_decode")
    assert decision.source == "fallback" and decision.value == {"static_cache": False, "compile": False}
    assert ("CPU" if facts == "cpu" else "MPS") in decision.reason
    # what happens comes first: the short explain (each reason's first clause) says it
    where = "the CPU" if facts == "cpu" else "MPS"
    assert decision.reason.startswith(f"nothing changes on {where}")
    assert f"nothing changes on {where}" in plan.explain()


def test_a_cpu_load_asked_for_fast_decode_says_nothing_changes(tiny_model, caplog):
    """fast_decode=True on the CPU: the load's log says it changes nothing, and why."""
    import logging

    with caplog.at_level(logging.WARNING, logger="xpukit"):
        model = load_for_xpu(tiny_model, fast_decode=True)
    said = [r.getMessage() for r in caplog.records if "fast_decode changes nothing" in r.getMessage()]
    assert len(said) == 1 and "nothing changes on the CPU" in said[0]
    note = next(e for e in model.xpukit_plan.events if e.what == "fast_decode")
    assert "nothing changes on the CPU" in str(note.actual)


@pytest.mark.slow
def test_cpu_load_records_the_fallback_and_keeps_tokens(tiny_model, tokenizer):
    plain = load_for_xpu(tiny_model)
    fast = load_for_xpu(tiny_model, fast_decode=True, warmup=True)
    plan = fast.xpukit_plan
    assert plan.decision("fast_decode").source == "fallback"
    assert [e.what for e in plan.events if e.what in {"fast_decode", "warmup"}] == ["fast_decode", "warmup"]
    assert fast.generation_config.cache_implementation is None
    for batch in (1, 8):
        assert _greedy(fast, tokenizer, batch).tolist() == _greedy(plain, tokenizer, batch).tolist()


def _static_plan(tiny_model, *, compile_mode=None):
    decode = DecodePlan(
        static_cache=True, max_cache_len=256, compile=compile_mode is not None, compile_mode=compile_mode
    )
    return replace(plan_load(tiny_model, fast_decode=True), decode=decode)


@pytest.mark.slow
def test_static_cache_settings_keep_greedy_tokens_sampling_and_pipeline(tiny_model, tokenizer):
    import torch
    from transformers import pipeline

    plain = load_for_xpu(tiny_model)
    model = carry_out(_static_plan(tiny_model), warmup=True)
    config = model.generation_config
    assert (config.cache_implementation, config.max_cache_len, config.disable_compile) == (
        "static",
        256,
        True,
    )
    applied = [e for e in model.xpukit_plan.events if e.what == "fast_decode"]
    assert applied[0].actual == {
        "cache_implementation": "static",
        "max_cache_len": 256,
        "disable_compile": True,
    }
    loop_event = next(e for e in model.xpukit_plan.events if e.what == "decode_loop")
    assert loop_event.actual == {"compile": None, "step_graph": False, "graph_batch_sizes": []}
    warm = next(e for e in model.xpukit_plan.events if e.what == "warmup")
    assert warm.actual["compiled"] is False and warm.actual["first_call_s"] > 0
    assert warm.actual["loop"] == "xpukit" and model.xpukit_decode_loop.max_cache_len == 256
    for batch in (1, 8):
        assert _greedy(model, tokenizer, batch).tolist() == _greedy(plain, tokenizer, batch).tolist()
        inputs = tokenizer(PROMPTS[:batch], return_tensors="pt", padding=True)
        torch.manual_seed(0)
        sampled = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=True, top_k=20)
        assert sampled.shape == (batch, inputs["input_ids"].shape[1] + 5)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = generator(PROMPTS[:8], max_new_tokens=3, do_sample=False, batch_size=8)
    assert len(out) == 8 and out[0][0]["generated_text"].startswith(PROMPTS[0])
    assert model.xpukit_last_decode["loop"] == "xpukit"  # pipeline() calls the same generate


@pytest.mark.slow
def test_compile_config_is_transformers_own(tiny_model, tokenizer):
    from transformers import CompileConfig

    plain = load_for_xpu(tiny_model)
    model = carry_out(_static_plan(tiny_model, compile_mode="reduce-overhead"))
    config = model.generation_config.compile_config
    assert isinstance(config, CompileConfig) and not model.generation_config.disable_compile
    assert (config.fullgraph, config.dynamic, config.mode) == (True, False, "reduce-overhead")
    # On the CPU generate() does not compile (its criteria name cuda/xpu): the same tokens, no compiled call.
    assert _greedy(model, tokenizer, 8).tolist() == _greedy(plain, tokenizer, 8).tolist()
    assert not hasattr(model, "_compiled_call")


def test_a_compile_failure_in_the_warmup_falls_back(tiny_model, monkeypatch, caplog):
    import torch

    from xpukit.loading.decode.fast_decode import warm_up

    model = carry_out(_static_plan(tiny_model, compile_mode="default"))
    model.generation_config.compile_config._compile_all_devices = True  # compile here, as on a GPU

    def broken(fn, **kwargs):
        def call(*args, **kw):
            raise RuntimeError("inductor could not build the graph")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    events = warm_up(model, model.xpukit_plan)
    assert [(e.kind, e.what) for e in events] == [("fallback", "fast_decode")]
    assert "inductor could not build" in events[0].cause and "decoding uncompiled" in caplog.text
    assert model.generation_config.disable_compile is True
    assert warm_up(model, model.xpukit_plan)[0].what == "warmup"  # decodes again, uncompiled


def test_warmup_needs_fast_decode(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights read"))
    with pytest.raises(InvalidRequestError, match="fast_decode=True, warmup=True"):
        load_for_xpu(tiny_model, warmup=True)


def test_plan_cli_fast_decode(capsys):
    import json

    from xpukit.cli.main import main

    assert main(["plan", "qwen3-8b", "--assume", "max-1550", "--fast-decode", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["decode"] == {
        "static_cache": True,
        "max_cache_len": 4096,
        "compile": "default",
        "tiers": ["eager", "compiled"],
    }
    assert main(["plan", "qwen3-8b", "--assume", "max-1550", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode"] is None  # bf16: "auto" leaves it off


def test_plan_cli_auto_and_no_fast_decode(capsys, monkeypatch):
    import json

    import xpukit.planning.device.layout as layout_module
    from xpukit.cli.main import main

    monkeypatch.setattr(layout_module, "torchao_version", lambda: "0.18.0")
    assert main(["plan", "qwen3-8b", "--assume", "arc-b580", "--quantize", "4bit", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["decode"] == {
        "static_cache": True,
        "max_cache_len": 4096,
        "compile": "default",
        "tiers": ["eager", "compiled"],
    }
    off = ["plan", "qwen3-8b", "--assume", "arc-b580", "--quantize", "4bit", "--no-fast-decode", "--json"]
    assert main(off) == 0
    assert json.loads(capsys.readouterr().out)["decode"] is None
