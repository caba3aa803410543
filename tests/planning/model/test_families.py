"""The family table (xpukit.planning.model.families) is what its readers use, and it is true.

Each place that knows about model families reads the table: the layouts written from the config
(decoder_layout), the block traits of the size estimates (shape), the tiny models (demo.tiny) and the
GGUF export's architectures; and what an entry says about its family's blocks is what the fused-path
rules find in the family's real config.
"""

from __future__ import annotations

from typing import Any

import pytest

from xpukit.planning.model import decoder_layout, gguf_export
from xpukit.planning.model.families import FAMILIES, ModelFamily, family, shape_traits

TINY = {f.model_type: f for f in FAMILIES.values() if f.tiny is not None}


def _tiny_config(entry: ModelFamily) -> Any:
    """The family's tiny config, as xpukit.demo.tiny builds it (without building the model)."""
    import transformers

    from xpukit.demo.tiny import ARCHITECTURES

    assert entry.tiny is not None
    spec = ARCHITECTURES[entry.tiny.name]
    return getattr(transformers, spec.config_class)(**spec.config, pad_token_id=0, eos_token_id=1)


def test_each_reader_takes_its_part_of_the_table() -> None:
    from xpukit.demo.tiny import ARCHITECTURES, DEMO_ARCHITECTURE

    assert set(decoder_layout.FAMILIES) == {t for t, f in FAMILIES.items() if f.layout is not None}
    assert dict(gguf_export.FAMILIES) == {t: f.gguf for t, f in FAMILIES.items() if f.gguf is not None}
    assert list(gguf_export.FAMILIES) == ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
    assert set(ARCHITECTURES) == {f.tiny.name for f in TINY.values() if f.tiny is not None}
    assert next(iter(ARCHITECTURES)) == DEMO_ARCHITECTURE
    for entry in TINY.values():
        assert entry.tiny is not None
        built = ARCHITECTURES[entry.tiny.name]
        assert (built.config_class, built.model_class) == (entry.tiny.config_class, entry.tiny.model_class)
        assert dict(entry.tiny.config).items() <= dict(built.config).items()
    assert family("qwen3") is FAMILIES["qwen3"] and family("bert") is None and family(None) is None


@pytest.mark.parametrize(
    ("model_type", "qk_norm", "norms"),
    [
        ("qwen3", True, 2),
        ("qwen3_moe", True, 2),  # a prefix covers the family's relatives
        ("gemma3_text", True, 4),
        ("gemma3", True, 4),
        ("gemma2", False, 4),
        ("olmo2", True, 2),
        ("llama", False, 2),
        ("granite", False, 2),
        ("bert", False, 2),
        ("", False, 2),
    ],
)
def test_shape_traits_by_model_type(model_type: str, qk_norm: bool, norms: int) -> None:
    from transformers import AutoConfig

    traits = shape_traits(model_type)
    assert (traits.qk_norm, traits.norms) == (qk_norm, norms)
    if model_type in ("qwen3", "gemma3_text", "llama", "granite"):
        from xpukit.planning.model.shape import model_shape

        shape = model_shape(AutoConfig.for_model(model_type))
        assert shape is not None and (shape.qk_norm, shape.norms) == (qk_norm, norms)


@pytest.mark.parametrize("model_type", sorted(t for t, f in TINY.items() if f.attention is not None))
def test_the_blocks_an_entry_names_are_what_the_fused_rules_find(model_type: str) -> None:
    """The entry's attention and MLP projections match the fused-path rule the config's facts select."""
    from xpukit.planning.model.facts import model_facts
    from xpukit.planning.training.fused import fused_blocks

    entry = FAMILIES[model_type]
    blocks = fused_blocks(model_facts(_tiny_config(entry), cache=False))
    assert blocks.attention is not None and blocks.attention.projections == entry.attention
    assert (None if blocks.mlp is None else blocks.mlp.projections) == entry.mlp


def test_families_without_block_projections_have_no_fused_rule() -> None:
    from xpukit.planning.model.facts import model_facts
    from xpukit.planning.training.fused import fused_blocks

    blocks = fused_blocks(model_facts(_tiny_config(FAMILIES["gpt2"]), cache=False))
    assert (
        blocks.attention is None
        and blocks.mlp is None
        and "GPT2LMHeadModel has no" in str(blocks.attention_problem)
    )


# Granite, the family added through the table alone: its tiny model, its plan from the config, and a
# CPU load that trains.


def test_granite_tiny_model_keeps_its_multipliers(tiny_models: Any) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_models["granite"])
    assert type(config).__name__ == "GraniteConfig" and config.architectures == ["GraniteForCausalLM"]
    assert (config.embedding_multiplier, config.residual_multiplier) == (12.0, 0.22)
    assert (config.attention_multiplier, config.logits_scaling) == (0.0625, 8.0)


def test_granite_is_planned_from_its_config(tiny_models: Any) -> None:
    """Written from the config (no meta build), and the fused 4-bit LoRA path expected on a GPU."""
    from transformers import AutoConfig

    from xpukit.planning.model.decoder_layout import decoder_layout
    from xpukit.planning.plan import plan_load

    layout = decoder_layout(AutoConfig.from_pretrained(tiny_models["granite"]))
    assert layout is not None and layout.architecture == "GraniteForCausalLM"
    assert "model.layers.1.mlp.gate_proj" in layout.linear_modules
    plan = plan_load(tiny_models["granite"], facts="h200", quantize="4bit", lora=True)
    fused = plan.decision("fused_lora")
    assert fused.value is True and "q/k/v in one function" in fused.reason and "SiLU" in fused.reason
    cpu = plan_load(tiny_models["granite"], facts="cpu", lora=True)
    assert cpu.device.backend == "cpu" and str(cpu.decision("lora").value).startswith("new LoRA")
    # liger-kernel's Granite patch refuses its fused loss (the logits are scaled after lm_head): the
    # plan takes another loss and says why, instead of a load that fails over to no liger at all.
    assert plan.decision("liger").value is False and plan.training is not None
    assert plan.training.loss != "liger" and "no fused loss for Granite" in plan.decision("liger").reason


def test_granite_loads_and_trains_lora_on_the_cpu(tiny_models: Any, tmp_path: Any, six_steps: Any) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from xpukit import load_for_xpu

    path = tiny_models["granite"]
    model = load_for_xpu(path, device="cpu", dtype="float32", quantize="4bit", lora=True)
    assert model.xpukit_plan.carried_out and type(model).__name__ == "PeftModelForCausalLM"
    losses = six_steps(model, path, tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.mark.gpu
def test_granite_default_training_path_gives_the_plain_loss_on_cuda(tiny_model_factory: Any) -> None:
    """On CUDA the default 4-bit LoRA load of Granite (fused path, liger where installed) computes
    the loss of peft's modules without liger, same weights: its logits_scaling is kept."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("bitsandbytes")
    from xpukit import load_for_xpu

    path = tiny_model_factory("granite", hidden_size=256, intermediate_size=768, head_dim=64)
    ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(0)).cuda()

    def loss(lora: Any) -> tuple[float, list[str]]:
        model = load_for_xpu(path, device="cuda", quantize="4bit", lora=lora, seed=0)
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = float(model(input_ids=ids, labels=ids).loss)
        return value, [str(e.actual) for e in model.xpukit_plan.events if e.what == "lora"]

    default, notes = loss(True)
    plain, _ = loss({"fused": False, "liger": False})
    assert any(n.startswith("fused LoRA: ") for n in notes), notes
    assert abs(default - plain) <= 2e-2 * abs(plain), (default, plain, notes)
