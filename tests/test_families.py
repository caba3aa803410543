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
