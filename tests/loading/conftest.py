"""Fixtures of the loading tests (merge, export): models saved as a fine-tune is."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The length of the windows trained_tiny trains on; a test that compares its logits does so over
# windows no longer than this (positions beyond it were never trained: their logits are near-flat).
TRAINED_WINDOW = 128


def _tiny_qwen2(llama: Path, out: Path, seed: int, **config_overrides: Any) -> Path:
    """A tiny Qwen2 (biased q/k/v projections; tied embeddings, as Qwen2's small models have): the
    tiny Llama's sizes and tokenizer in Qwen2's classes. Qwen2 is one of the GGUF exporter's families
    but has no tiny architecture of its own in ``xpukit.demo.tiny``."""
    import torch
    import transformers

    from xpukit.demo.tiny import ARCHITECTURES

    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    ids = {
        "bos_token_id": tokenizer.eos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    sizes = {k: v for k, v in ARCHITECTURES["llama"].config.items() if k != "head_dim"}
    config = transformers.Qwen2Config(**{**sizes, "tie_word_embeddings": True, **ids, **config_overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(**ids)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def export_tiny_factory(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """``factory(arch, *, seed=0, **config_overrides) -> Path``: ``tiny_model_factory``'s models, and
    ``"qwen2"`` (:func:`_tiny_qwen2`) beside them, built once per arguments."""
    root = tmp_path_factory.mktemp("tiny-qwen2")
    built: dict[str, Path] = {}

    def get(arch: str, *, seed: int = 0, **config_overrides: Any) -> Path:
        if arch != "qwen2":
            return tiny_model_factory(arch, seed=seed, **config_overrides)
        key = json.dumps([seed, config_overrides], sort_keys=True, default=str)
        if key not in built:
            llama = tiny_model_factory("llama")
            built[key] = _tiny_qwen2(llama, root / f"qwen2-{len(built)}", seed, **config_overrides)
        return built[key]

    return get


def _trained_tiny(built: Path, out: Path, steps: int) -> Path:
    """``built`` trained on the bundled corpus and saved in bfloat16 with its tokenizer: a model with
    real margins between its top tokens, where random weights give near-flat logits.

    Every weight trains (AdamW, lr 1e-2, seed 0) on ``steps`` batches of 8 windows of
    :data:`TRAINED_WINDOW` tokens, each window starting at a random offset of the corpus: the model
    learns the text at every offset, not 8 fixed windows by heart (which leaves it near-flat on the
    same text shifted by half a window)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.demo.tiny import corpus_lines

    tokenizer = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    ids = torch.tensor(tokenizer(" ".join(corpus_lines())).input_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    offsets = torch.arange(TRAINED_WINDOW)
    model.train()
    for _ in range(steps):
        starts = torch.randint(len(ids) - TRAINED_WINDOW + 1, (8, 1), generator=generator)
        batch = ids[starts + offsets]
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def trained_tiny(
    export_tiny_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """``trained_tiny(arch, steps=100, **config_overrides) -> Path``: the tiny model (``"qwen2"``
    included, :func:`export_tiny_factory`) trained on the bundled corpus and saved in bfloat16, built
    once per arguments (seconds each on one thread)."""
    root = tmp_path_factory.mktemp("trained-tiny")
    built: dict[str, Path] = {}

    def get(arch: str, steps: int = 100, **config_overrides: Any) -> Path:
        key = json.dumps([arch, steps, config_overrides], sort_keys=True, default=str)
        if key not in built:
            source = export_tiny_factory(arch, **config_overrides)
            built[key] = _trained_tiny(source, root / f"{arch}-{len(built)}", steps)
        return built[key]

    return get


@pytest.fixture(scope="session")
def bf16_base(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 saved in bfloat16 (its config says so), with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("bf16-base")
    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out
