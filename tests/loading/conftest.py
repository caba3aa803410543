"""Fixtures of the loading tests (merge, export): models saved as a fine-tune is."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _trained_tiny(built: Path, out: Path, steps: int) -> Path:
    """``built`` trained on the bundled corpus (every weight, AdamW, ``steps`` batches of 8 x 128
    tokens, seed 0) and saved in bfloat16 with its tokenizer: a model with real margins between its
    top tokens, where random weights give near-flat logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.demo.tiny import corpus_lines

    tokenizer = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    ids = tokenizer(" ".join(corpus_lines())).input_ids
    data = torch.tensor(ids[: len(ids) // 128 * 128]).view(-1, 128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = data[torch.randint(len(data), (8,), generator=generator)]
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def trained_tiny(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """``trained_tiny(arch, steps=60, **config_overrides) -> Path``: the tiny model trained on the
    bundled corpus and saved in bfloat16, built once per arguments (seconds each on one thread)."""
    root = tmp_path_factory.mktemp("trained-tiny")
    built: dict[str, Path] = {}

    def get(arch: str, steps: int = 60, **config_overrides: Any) -> Path:
        key = json.dumps([arch, steps, config_overrides], sort_keys=True, default=str)
        if key not in built:
            source = tiny_model_factory(arch, **config_overrides)
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
