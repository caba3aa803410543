"""The other ways to set up QLoRA the benches compare xpukit with: the hand-written recipe of the
tutorials (bitsandbytes nf4 + peft) and unsloth's ``FastLanguageModel``."""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any


def bnb_config(dtype: str) -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=getattr(torch, dtype),
        bnb_4bit_use_double_quant=True,
    )


def load_recipe(args: argparse.Namespace, facts: Any, dtype: str) -> tuple[Any, list[str], Any]:
    """The hand-written QLoRA recipe: nf4, prepare_model_for_kbit_training, get_peft_model."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    from xpukit.planning.training.lora_request import DEFAULT_LORA

    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=getattr(torch, dtype), device_map=facts.torch_device,
        quantization_config=bnb_config(dtype),
    )  # fmt: skip
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    torch.manual_seed(0)  # the same LoRA initialisation in every variant
    model = get_peft_model(model, LoraConfig(**DEFAULT_LORA))
    return model, ["peft.prepare_model_for_kbit_training: non-4-bit weights upcast to float32"], None


def load_unsloth(args: argparse.Namespace, variant: str, dtype: str) -> tuple[Any, list[str], Any]:
    """unsloth's FastLanguageModel (imported before transformers, as it requires)."""
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="unsloth-"))
    import torch
    import unsloth
    from unsloth import FastLanguageModel

    from xpukit.planning.training.lora_request import DEFAULT_LORA

    tokenizer = args.tokenizer
    if tokenizer is None:  # the random model has none; a family's default class may need sentencepiece
        from xpukit.demo.tiny import demo_model_dir

        tokenizer = str(demo_model_dir())
    model, _ = FastLanguageModel.from_pretrained(
        args.model_dir, max_seq_length=args.seq, dtype=getattr(torch, dtype), load_in_4bit=True,
        tokenizer_name=tokenizer,
    )  # fmt: skip
    torch.manual_seed(0)
    gc: Any = "unsloth" if variant == "unsloth" else False
    model = FastLanguageModel.get_peft_model(
        model, r=DEFAULT_LORA["r"], lora_alpha=DEFAULT_LORA["lora_alpha"],
        lora_dropout=DEFAULT_LORA["lora_dropout"], use_gradient_checkpointing=gc,
        target_modules=unsloth_targets(model),
    )  # fmt: skip
    return model, [f"unsloth {getattr(unsloth, '__version__', '?')}, use_gradient_checkpointing={gc!r}"], None


def unsloth_targets(model: Any) -> list[str]:
    """The same layers xpukit's ``all-linear`` adapts: unsloth's usual seven names, or a stored
    ``qkv_proj``/``gate_up_proj`` where the checkpoint fuses them (Phi-3/4: with the seven names
    alone, only ``o_proj`` and ``down_proj`` exist, 8.9 M trainable parameters against 23.1 M)."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    wanted = [
        "q_proj",
        "k_proj",
        "v_proj",
        "qkv_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "gate_up_proj",
        "down_proj",
    ]
    return [name for name in wanted if name in present]
