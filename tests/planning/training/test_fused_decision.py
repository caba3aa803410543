"""The fused_lora decision (planning/training/fused.py; docs/planning.md "Fused LoRA"): on by
default for 4-bit new adapters on cuda/xpu, every condition the fused path cannot express keeps
peft's path with its reason, and lora={"fused": True} insists or is refused."""

from __future__ import annotations

from typing import Any

import pytest

from xpukit import plan_load
from xpukit.errors import InvalidRequestError
from xpukit.planning.model.reference_models import reference_config

QWEN3 = reference_config("qwen3-0.6b")


def _fused(lora: Any = True, facts: str = "h200", quantize: Any = "4bit", config: Any = QWEN3) -> Any:
    return plan_load(config, facts=facts, lora=lora, quantize=quantize).decision("fused_lora")


def test_on_by_default_for_4bit_on_cuda_and_xpu() -> None:
    for facts in ("h200", "arc-b580"):
        d = _fused(facts=facts)
        assert (d.value, d.source) == (True, "auto"), d


def test_off_by_default_on_the_cpu_but_can_be_insisted() -> None:
    d = _fused(facts="cpu")
    assert (d.value, d.source) == (False, "auto") and "cuda and xpu only" in d.reason
    d = _fused(lora={"fused": True}, facts="cpu")
    assert (d.value, d.source) == (True, "user")


def test_off_when_asked() -> None:
    d = _fused(lora={"fused": False})
    assert (d.value, d.source) == (False, "user") and "lora={'fused': False} given" in d.reason


@pytest.mark.parametrize(
    ("lora", "quantize", "why"),
    [
        ({"lora_dropout": 0.1}, "4bit", "lora_dropout=0.1"),
        ({"use_dora": True}, "4bit", "use_dora"),
        ({"bias": "lora_only"}, "4bit", "bias adapters"),
        ({"target_modules": ["q_proj", "v_proj"]}, "4bit", "does not adapt all of"),
        (True, None, "this plan has no quantization"),
        (True, "8bit", "8bit weights"),
    ],
    ids=["dropout", "dora", "bias", "partial-targets", "not-quantized", "8bit"],
)
def test_what_it_cannot_express_keeps_peft_with_the_reason(lora: Any, quantize: Any, why: str) -> None:
    d = _fused(lora=lora, quantize=quantize)
    assert d.value is False and d.source == "auto" and why in d.reason, d
    assert d.rejected and d.rejected[0][0] is True
    insisted = {**(lora if isinstance(lora, dict) else {}), "fused": True}
    with pytest.raises(InvalidRequestError, match=r"lora=\{'fused': True\}.*Fix: drop 'fused'"):
        _fused(lora=insisted, quantize=quantize)


def test_a_block_of_another_shape_keeps_peft() -> None:
    """GPT-2 has c_attn/c_proj/c_fc, not q/k/v/o + gate/up/down."""
    from transformers import GPT2Config

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128)
    d = _fused(config=config)
    assert d.value is False and "q_proj" in d.reason and "not a shape the fused path computes" in d.reason


def test_no_decision_without_new_adapters() -> None:
    plan = plan_load(QWEN3, facts="h200", quantize="4bit")
    assert all(d.name != "fused_lora" for d in plan.decisions)


def test_an_unknown_fused_value_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="fused"):
        plan_load(QWEN3, facts="h200", lora={"fused": "yes"})


@pytest.mark.parametrize(
    ("arch", "head"),
    [
        ("gemma", "fused LoRA: 2 decoder blocks (q/k/v, o, gate/up/down with GELU (tanh))"),
        ("phi3", "fused LoRA: 2 decoder blocks (qkv, o, gate_up/down)"),
        ("granite", "fused LoRA: 2 decoder blocks (q/k/v, o, gate/up/down)"),
    ],
)
def test_load_for_xpu_fuses_other_families(tiny_models: Any, arch: str, head: str) -> None:
    """The plan's rules and the load agree for GeGLU and stored fused projections: whole blocks,
    proven at load, the check's measurements among the plan's events."""
    from xpukit import load_for_xpu

    model = load_for_xpu(
        tiny_models[arch], device="cpu", dtype="float32", quantize="4bit", lora={"fused": True}
    )
    notes = [str(e.actual) for e in model.xpukit_plan.events if e.what == "lora"]
    assert head in notes, notes
    assert any(n.startswith("fused LoRA check: ") and "DIFFERS" not in n for n in notes), notes


def test_load_for_xpu_carries_the_decision_out(tiny_model: Any) -> None:
    """lora={"fused": True} on the CPU reaches the fused path through the one call; False keeps peft."""
    from xpukit import load_for_xpu

    def notes(model: Any) -> list[str]:
        return [str(e.actual) for e in model.xpukit_plan.events if e.what == "lora"]

    fused = load_for_xpu(tiny_model, device="cpu", dtype="float32", quantize="4bit", lora={"fused": True})
    assert fused.xpukit_plan.decision("fused_lora").source == "user"
    assert any(n.startswith("fused LoRA: ") for n in notes(fused)), notes(fused)
    plain = load_for_xpu(tiny_model, device="cpu", dtype="float32", quantize="4bit", lora={"fused": False})
    assert not any(n.startswith("fused LoRA: ") for n in notes(plain))
    assert type(fused).__name__ == type(plain).__name__ == "PeftModelForCausalLM"


def _config(name: str, **extra: Any) -> Any:
    import transformers

    small = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return getattr(transformers, name)(**{**small, **extra})


@pytest.mark.parametrize(
    ("config_class", "extra", "expected"),
    [
        ("Gemma3TextConfig", {"head_dim": 16}, "down(act(gate(x)) * up(x)) in one function, act = tanh"),
        ("GemmaConfig", {"head_dim": 16}, "GELU (GeGLU)"),
        ("Phi3Config", {}, "the stored qkv_proj"),
        ("Glm4Config", {"head_dim": 16}, "halves of the stored gate_up_proj"),
        ("GraniteConfig", {}, "SiLU (SwiGLU)"),
        ("Olmo2Config", {}, "q/k/v in one function"),
        ("SmolLM3Config", {}, "SiLU (SwiGLU)"),
    ],
)
def test_the_plan_says_what_it_expects_to_fuse_from_the_config(
    config_class: str, extra: dict[str, Any], expected: str
) -> None:
    """One rule per block shape, read from the config before loading: whole blocks fuse."""
    from xpukit.planning.model.facts import model_facts
    from xpukit.planning.training.fused import fused_blocks

    config = _config(config_class, **extra)
    d = _fused(config=config)
    assert d.value is True and expected in d.reason and "checked against peft's block at load" in d.reason
    assert fused_blocks(model_facts(config)).whole
    assert _fused(lora={"fused": True}, config=config, facts="cpu").value is True


@pytest.mark.parametrize(
    ("config_class", "extra"),
    [
        ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2}),
        ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
)
def test_mixture_of_experts_fuses_the_attention_and_says_what_the_experts_run(
    config_class: str, extra: dict[str, Any]
) -> None:
    from xpukit.planning.model.facts import model_facts
    from xpukit.planning.training.fused import fused_blocks

    config = _config(config_class, **extra)
    d = _fused(config=config)
    assert d.value is True and "q/k/v in one function" in d.reason and "mixture of 4 experts" in d.reason
    blocks = fused_blocks(model_facts(config))
    assert blocks.attention is not None and blocks.mlp is None and blocks.experts and not blocks.whole
    # The experts are not 4-bit projections: insisting on the fused path is not refused for them.
    assert _fused(lora={"fused": True}, config=config).value is True


def test_an_mlp_activation_it_does_not_compute_keeps_peft_for_the_mlp() -> None:
    config = _config("LlamaConfig", hidden_act="relu")
    d = _fused(config=config)
    assert d.value is True and "activation 'relu' is not one the fused MLP computes" in d.reason
    with pytest.raises(InvalidRequestError, match="MLP cannot be fused: activation 'relu'"):
        _fused(lora={"fused": True}, config=config)


def test_the_plan_maps_activations_onto_the_names_the_kernel_takes() -> None:
    """planning/training/fused.py (pure) and kernels/lora_ops.py (the fused MLP) sit side by side and do
    not import each other: the plan's targets must be exactly what the kernel accepts."""
    from xpukit.kernels import lora_ops
    from xpukit.planning.training import fused

    assert set(fused.GATE_ACTIVATIONS.values()) == set(lora_ops.GATE_ACTIVATIONS)
