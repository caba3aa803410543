"""Fixtures of the training tests: a tiny LoRA model, a padded batch and the comparison of two steps.

``lora_case`` serves the packing tests and the varlen attention tests alike (both compare a packed
step's loss and LoRA gradients with another run of the same batch, in float32 on the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


class LoraCase:
    """What a packed-training test builds and compares (``lora_case``)."""

    lengths = (5, 11, 3, 8)

    def model(self, path: Path) -> Any:
        """The model at ``path`` in float32 under SDPA with non-zero LoRA adapters (r=4, every linear
        layer, no dropout), in training mode."""
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        torch.manual_seed(1)  # non-zero adapters, so every LoRA gradient is exercised
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
        )
        model = get_peft_model(model, config)
        model.train()
        return model

    def batch(self, side: str, *, seed: int = 3, lengths: tuple[int, ...] | list[int] | None = None) -> Any:
        """``(ids, mask, labels)`` of examples of ``lengths`` padded on the ``side`` ("right" or
        "left"); no label at the padding, nor where a left-padded row's first token would be
        predicted from a padding position."""
        import torch

        lengths = list(self.lengths if lengths is None else lengths)
        gen = torch.Generator().manual_seed(seed)
        width = max(lengths)
        ids = torch.randint(5, 500, (len(lengths), width), generator=gen)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for row, n in enumerate(lengths):
            if side == "right":
                mask[row, :n] = 1
            else:
                mask[row, width - n :] = 1
        ids = ids * mask
        labels = ids.masked_fill(mask == 0, -100)
        if side == "left":  # in a left-padded row the first token is the target of a padding position
            labels[torch.arange(len(lengths)), width - torch.tensor(lengths)] = -100
        return ids, mask, labels

    @staticmethod
    def grads(model: Any) -> dict[str, Any]:
        """The trainable parameters' gradients, cloned."""
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    @staticmethod
    def assert_same(loss: Any, want_loss: Any, grads: dict[str, Any], want: dict[str, Any]) -> None:
        """The loss within float32's rounding (rtol 1e-5) and every gradient within 1e-4 of its
        largest entry."""
        import torch

        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == want.keys() and len(grads) > 0
        for name, grad in grads.items():
            scale = want[name].abs().max().clamp_min(1e-12)
            assert float((grad - want[name]).abs().max() / scale) < 1e-4, name


@pytest.fixture
def lora_case() -> LoraCase:
    """A :class:`LoraCase`: ``model(path)``, ``batch(side, *, seed=3, lengths=None)``, ``grads(model)``,
    ``assert_same(loss, want_loss, grads, want)``."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    return LoraCase()
