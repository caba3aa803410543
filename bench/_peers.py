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
        args.model_dir,
        dtype=getattr(torch, dtype),
        device_map=facts.torch_device,
        quantization_config=bnb_config(dtype),
    )
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
        args.model_dir,
        max_seq_length=args.seq,
        dtype=getattr(torch, dtype),
        load_in_4bit=True,
        tokenizer_name=tokenizer,
    )
    torch.manual_seed(0)
    gc: Any = "unsloth" if variant == "unsloth" else False
    model = FastLanguageModel.get_peft_model(
        model,
        r=DEFAULT_LORA["r"],
        lora_alpha=DEFAULT_LORA["lora_alpha"],
        lora_dropout=DEFAULT_LORA["lora_dropout"],
        use_gradient_checkpointing=gc,
        target_modules=unsloth_targets(model),
    )
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


# unsloth's set-ups a user would pick: (trainer, unsloth's checkpointing). "sft": TRL's SFTTrainer,
# which turns padding-free batches on for unsloth; "trainer": transformers' Trainer with the padding
# collator. Checkpointing "unsloth" (its offloaded one) or off (faster where it fits).
UNSLOTH_SETUPS: dict[str, tuple[str, Any]] = {
    "unsloth": ("sft", "unsloth"),
    "unsloth-nogc": ("sft", False),
    "unsloth-trainer": ("trainer", "unsloth"),
    "unsloth-trainer-nogc": ("trainer", False),
}


def budget_bytes(text: str | None) -> int | None:
    """``8GB`` / ``7.5GiB`` as bytes; ``None`` / ``none``: no budget."""
    if not text or text.strip().lower() == "none":
        return None
    units = {"GIB": 2**30, "GB": 10**9, "MIB": 2**20, "MB": 10**6}
    upper = text.strip().upper()
    for unit, size in units.items():
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * size)
    return int(upper)


def against_fastest_peer(
    rows: dict[str, list[dict[str, Any]]], bench: str, prefix: str = "unsloth"
) -> list[dict[str, Any]]:
    """For each xpukit row set (``variant`` or ``variant@budget``): its ratio to the fastest peer
    set-up (``prefix``) that fits the budget (its median reserved peak at most the budget; every
    set-up without one), per round of the interleaved runs, as the median and the range, for the
    timed steps and for the first 20 steps (captures and warm-up included), with the reserved peaks."""
    import statistics

    peers = {v: r for v, r in rows.items() if v.startswith(prefix) and r}
    out: list[dict[str, Any]] = []
    for variant, mine in rows.items():
        if variant.startswith(prefix) or not mine or not peers:
            continue
        limit = budget_bytes(variant.partition("@")[2] or None)

        def median(key: str, of: list[dict[str, Any]]) -> float:
            values = [r[key] for r in of if r.get(key) is not None]
            return statistics.median(values) if values else 0.0

        fitting = {v: r for v, r in peers.items() if limit is None or median("peak_mem_gb", r) * 1e9 <= limit}
        if not fitting:
            out.append({"bench": bench, "versus": variant, "peer": None, "why": "no peer set-up fits"})
            continue
        best = max(fitting, key=lambda v: median("tokens_per_s", fitting[v]))
        row: dict[str, Any] = {
            "bench": bench,
            "versus": variant,
            "peer": best,
            "rounds": len(mine),
            "peer_tokens_per_s": {v: median("tokens_per_s", r) for v, r in peers.items()},
        }
        for key in ("tokens_per_s", "tokens_per_s_first20"):
            theirs = {r.get("round"): r.get(key) for r in fitting[best]}
            ratios = [
                r[key] / theirs[r.get("round")] for r in mine if r.get(key) and theirs.get(r.get("round"))
            ]
            if ratios:
                name = "ratio" if key == "tokens_per_s" else "ratio_first20"
                row[name] = round(statistics.median(ratios), 3)
                row[f"{name}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        row["reserved_gb"] = median("peak_mem_gb", mine)
        row["peer_reserved_gb"] = median("peak_mem_gb", fitting[best])
        out.append(row)
    return out
