"""ModelFacts: sizes from the meta device, checked against published counts and real loaded models."""

from __future__ import annotations

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.planning.model.facts import SIZE_KEYS, model_facts, quantized_bits
from xpukit.planning.model.reference_models import REFERENCE_CONFIGS, reference_config
from xpukit.sources.model_config import local_model_dir

MiB = 2**20


@pytest.fixture(scope="module")
def qwen06():
    return model_facts(reference_config("qwen3-0.6b"))


def test_reference_shapes_match_published_parameter_counts():
    # Published totals: Llama-3.1-8B 8,030,261,248 parameters (meta-llama model card / params.json
    #  tables); Qwen3-0.6B 596,049,920 once its tied embedding is counted once (docs/known-issues.md "Size
    # estimates without weights: Qwen3-0.6B").
    assert model_facts(reference_config("llama-3.1-8b")).num_parameters == 8_030_261_248
    assert model_facts(reference_config("qwen3-0.6b")).num_parameters == 596_049_920


def test_sizes_match_transformers_quantizer_aware_sizing(qwen06):
    #  docs/known-issues.md "Size estimates without weights: Qwen3-0.6B" measured these with
    # AutoHfQuantizer.preprocess_model + compute_module_sizes
    # (which imports bitsandbytes); model_facts gets the same numbers without it.
    assert round(qwen06.weight_bytes["bfloat16"] / MiB, 2) == 1136.88
    assert round(qwen06.weight_bytes["4bit/bfloat16"] / MiB, 2) == 506.88
    assert set(qwen06.weight_bytes) == set(SIZE_KEYS)


def test_size_relations(qwen06):
    w = qwen06.weight_bytes
    assert w["float16"] == w["bfloat16"]
    assert w["float32"] == pytest.approx(2 * w["bfloat16"], rel=1e-3)
    assert w["4bit/bfloat16"] < w["8bit/bfloat16"] < w["bfloat16"]
    # The tied embedding stays unquantized: 4-bit saves only on the decoder's linear layers.
    assert w["bfloat16"] - w["4bit/bfloat16"] < w["bfloat16"] * 0.75


def test_facts_describe_the_architecture(qwen06):
    assert qwen06.architecture == "Qwen3ForCausalLM" and qwen06.auto_class == "AutoModelForCausalLM"
    assert qwen06.supports_sdpa and qwen06.supports_flash_attn
    assert "Qwen3DecoderLayer" in qwen06.no_split_modules
    assert "RMSNorm" in qwen06.kernel_layers
    assert qwen06.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, 2 bytes
    assert qwen06.max_positions == 40960 and qwen06.pre_quantized is None
    assert qwen06.to_dict()["weight_bytes"]["bfloat16"] == qwen06.weight_bytes["bfloat16"]


def test_reference_config_names():
    assert set(REFERENCE_CONFIGS) >= {"qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama-3.1-8b", "llama-3.1-70b"}
    assert reference_config("Qwen3-8B").num_hidden_layers == 36
    with pytest.raises(InvalidRequestError, match="qwen3-8b"):
        reference_config("qwen9")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral", "gemma", "phi3", "gpt2"])
def test_estimate_matches_a_loaded_tiny_model(tiny_models, arch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_models[arch]
    facts = model_facts(AutoConfig.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu")
    # get_memory_footprint counts parameters and buffers, as compute_module_sizes does.
    assert facts.weight_bytes["bfloat16"] == model.get_memory_footprint()
    assert facts.num_parameters == sum(p.numel() for p in model.parameters())


def test_pre_quantized_checkpoint_is_sized_quantized(qwen06):
    config = reference_config("qwen3-0.6b")
    config.quantization_config = {"quant_method": "awq", "bits": 4}
    facts = model_facts(config)
    assert facts.pre_quantized == "awq" and facts.pre_quantized_bits == 4
    assert "4-bit" in facts.notes[0]
    # Every dtype gives the quantized size: the checkpoint loads quantized whatever is asked.
    assert facts.weights("bfloat16") == qwen06.weights("bfloat16", "4bit")
    assert facts.weights("float32") == qwen06.weights_at_bits("float32", 4) < qwen06.weights("float32")
    config.quantization_config = {"quant_method": "mystery"}
    unknown = model_facts(config)
    assert unknown.pre_quantized_bits is None and "upper bound" in unknown.notes[0]
    assert unknown.weights("bfloat16") == qwen06.weights("bfloat16")


def test_quantized_bits_reads_each_kind_of_config():
    assert quantized_bits({"load_in_4bit": True}) == 4
    assert quantized_bits({"load_in_8bit": True}) == 8
    assert quantized_bits({"bits": 3}) == 3
    assert quantized_bits({"weights": "int2"}) == 2
    assert quantized_bits({"bits": True}) is None and quantized_bits({"quant_type": "x"}) is None


def test_linear_layers_and_module_names_are_recorded(qwen06):
    assert {"q_proj", "down_proj", "lm_head"} <= set(qwen06.linear_layers)
    assert "model.layers.0.self_attn.q_proj" in qwen06.module_names
    assert qwen06.quantizable_numel > 0
    assert qwen06.weights_at_bits("bfloat16", 4) == qwen06.weights("bfloat16", "4bit")


def test_local_model_dir(tmp_path, tiny_model):
    assert local_model_dir(tiny_model) == tiny_model
    assert local_model_dir("Qwen/Qwen3-0.6B") is None
    with pytest.raises(InvalidRequestError, match="does not exist"):
        local_model_dir("./no/such/model")
    with pytest.raises(InvalidRequestError, match=r"no config\.json"):
        local_model_dir(tmp_path)
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(InvalidRequestError, match="is a file"):
        local_model_dir(tmp_path / "file.bin")


def test_config_without_an_auto_class_is_refused():
    from transformers import PretrainedConfig

    class Odd(PretrainedConfig):
        model_type = "odd-xpukit-test"

    with pytest.raises(InvalidRequestError, match="model_class"):
        model_facts(Odd())
