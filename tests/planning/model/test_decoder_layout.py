"""Facts from the config alone equal the facts of the model built on the meta device.

For every tiny architecture, every built-in shape and the config variants the decoder families take
(biases, untied heads, Qwen2), the layout :mod:`xpukit.planning.model.decoder_layout` writes must be
the one a meta-device build has, field by field, and so must every fact drawn from it: a transformers
release that changes a family's structure, class attributes or Hub-kernel names fails here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from xpukit.machine.library_source import MISSING, module_source, pretrained_defaults
from xpukit.planning.model import facts as facts_module
from xpukit.planning.model.classes import build_meta_model
from xpukit.planning.model.decoder_layout import FAMILIES, _should_convert, decoder_layout
from xpukit.planning.model.facts import model_facts
from xpukit.planning.model.families import FAMILIES as ALL_FAMILIES
from xpukit.planning.model.layout import Layout, layout_of
from xpukit.planning.model.reference_models import REFERENCE_CONFIGS, reference_config

# Written from the config: the tiny architecture of every family with layout rules, every built-in shape.
WRITTEN_TINY = {f.tiny.name for f in ALL_FAMILIES.values() if f.layout is not None and f.tiny is not None}


def _built(config: Any) -> Layout:
    _, model = build_meta_model(config, None, trust_remote_code=False)
    return layout_of(model)


def _assert_same(config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    written = decoder_layout(config)
    assert written is not None, f"{config.model_type} is not written from its config"
    built = _built(config)
    for name in Layout.__slots__:
        assert getattr(written, name) == getattr(built, name), name
    from_config = model_facts(config, cache=False)
    with monkeypatch.context() as patch:
        patch.setattr(facts_module, "decoder_layout", lambda *a, **k: None)
        from_model = model_facts(config, cache=False)
    assert from_config.to_dict() == from_model.to_dict()
    assert from_config.module_names == from_model.module_names
    assert from_config == from_model


def _tiny_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("arch", sorted(WRITTEN_TINY))
def test_tiny_architectures_from_config_equal_meta_build(
    arch: str, tiny_models: Mapping[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_same(_tiny_config(tiny_models[arch]), monkeypatch)


def test_other_tiny_architectures_are_built(tiny_models: Mapping[str, Path]) -> None:
    for arch in set(tiny_models) - WRITTEN_TINY:
        config = _tiny_config(tiny_models[arch])
        assert config.model_type not in FAMILIES
        assert decoder_layout(config) is None


@pytest.mark.parametrize("shape", sorted(REFERENCE_CONFIGS))
def test_built_in_shapes_from_config_equal_meta_build(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(reference_config(shape), monkeypatch)


def _small(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    sizes = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return AutoConfig.for_model(model_type, **(sizes | overrides))


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("qwen2", {"architectures": ["Qwen2ForCausalLM"]}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
        ("llama", {"head_dim": 32}),
        ("qwen3", {"attention_bias": True, "tie_word_embeddings": False}),
        ("mistral", {"head_dim": None, "tie_word_embeddings": True}),
        ("gemma3_text", {"head_dim": 16, "tie_word_embeddings": False, "attention_bias": True}),
        ("gemma3_text", {"head_dim": 16, "layer_types": ["full_attention", "full_attention"]}),
        ("granite", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    ],
)
def test_family_variants_from_config_equal_meta_build(
    model_type: str, overrides: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_same(_small(model_type, **overrides), monkeypatch)


@pytest.mark.parametrize(
    ("model_class", "overrides"),
    [
        ("AutoModelForSequenceClassification", {}),  # a task head: built
        ("AutoModel", {}),
        (None, {"architectures": ["LlamaForSequenceClassification"]}),
        (None, {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}),
        (None, {"auto_map": {"AutoModelForCausalLM": "modeling_x.LlamaForCausalLM"}}),
        (None, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}),
    ],
)
def test_what_is_not_written_is_built(model_class: Any, overrides: dict[str, Any]) -> None:
    assert decoder_layout(_small("llama", **overrides), model_class) is None


def test_a_class_object_is_built() -> None:
    from transformers import LlamaForCausalLM

    config = _small("llama")
    assert decoder_layout(config, LlamaForCausalLM) is None
    assert model_facts(config, model_class=LlamaForCausalLM, cache=False).architecture == "LlamaForCausalLM"


def test_without_kernels_no_kernel_layers_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' decorators are no-ops without a usable `kernels`: the built model names none.
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda *a, **k: False)
    layout = decoder_layout(reference_config("qwen3-0.6b"))
    assert layout is not None and layout.kernel_layers == ()


def test_should_convert_is_transformers_rule() -> None:
    from transformers.quantizers.quantizers_utils import should_convert_module

    names = ["lm_head", "model.norm", "model.layers.1.mlp.gate_proj", "model.layers.11.self_attn.q_proj"]
    for patterns in ({"lm_head"}, {"model.norm", "model.embed_tokens"}, {"layers.1"}, {"layers.*q_proj"}):
        for name in names:
            assert _should_convert(name, patterns) == should_convert_module(name, list(patterns)), (
                name,
                patterns,
            )


def test_class_source_reads_literals_through_local_bases() -> None:
    source = module_source("models/qwen3/modeling_qwen3.py")
    assert source is not None
    assert source.attribute("Qwen3ForCausalLM", "_no_split_modules") == ["Qwen3DecoderLayer"]
    assert source.attribute("Qwen3ForCausalLM", "_keep_in_fp32_modules") is MISSING  # PreTrainedModel's
    defaults = pretrained_defaults()
    assert defaults is not None and defaults.attribute("PreTrainedModel", "_supports_sdpa") is False
    assert module_source("models/no_such_model/modeling_no_such_model.py") is None
