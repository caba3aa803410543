"""QLoRA memory and speed: peft's k-bit recipe vs xpukit's lean preparation (± liger-kernel) vs bf16 LoRA.

One LoRA training step of ``batch × seq`` tokens (default 4 × 512) on a Qwen3-8B-shaped model with
random weights built from a config (nothing is downloaded). Each variant runs in its own process, so
peak memory is its own and liger-kernel's module-level patches cannot leak into the next variant.
Prints one JSON line per variant.

Variants:
    peft-kbit         nf4 + ``peft.prepare_model_for_kbit_training`` (non-4-bit weights upcast to fp32)
    xpukit-lean       nf4 + ``xpukit.loading.lora.apply_lora`` without liger (non-4-bit weights stay bf16)
    xpukit-lean-liger the same with liger-kernel where installed and the device runs Triton
    bf16-lora         bf16 weights + ``apply_lora`` without liger

All use LoRA r=16/alpha=32 on all linear layers, non-reentrant gradient checkpointing, AdamW on the
LoRA weights and bf16 autocast (what ``Trainer(bf16=True)`` does).

Usage::

    python bench/bench_qlora.py                      # CUDA (or XPU): Qwen3-8B shape, 36 layers
    python bench/bench_qlora.py --layers 8           # the same widths, fewer layers
    python bench/bench_qlora.py --tiny               # any device, a tiny shape (CPU check: ~2 min)

Peak memory is ``torch.<device>.max_memory_allocated`` over the whole child (loading included); on
CPU it is the child's peak RSS, which also counts the Python libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # bitsandbytes reaches for the Hub at import otherwise

VARIANTS = ("peft-kbit", "xpukit-lean", "xpukit-lean-liger", "bf16-lora")

# Qwen3-8B (config.json of Qwen/Qwen3-8B): 8.2 B parameters, untied embeddings.
QWEN3_8B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
TINY = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny shape that runs on CPU in seconds")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers (keeps the widths)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 512; 128 with --tiny)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--device", help="cuda, xpu or cpu (default: the first available)")
    parser.add_argument("--workdir", help="where the random model is written (default: a temp dir)")
    parser.add_argument(
        "--model-cache",
        help="keep the random model in this directory and reuse it (--variants '' only builds)",
    )
    parser.add_argument("--variant-child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (128 if args.tiny else 512)
    if args.variant_child:
        print(json.dumps(run_variant(args)), flush=True)
        return 0

    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model_dir = Path(args.model_cache) if args.model_cache else Path(tmp) / "model"
        if not any(
            (model_dir / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
        ):
            started = time.perf_counter()
            shape = build_model(model_dir, args)
            print(json.dumps({"bench": "qlora", "event": "built", "shape": shape,
                              "seconds": round(time.perf_counter() - started, 1)}), flush=True)  # fmt: skip
        failed = 0
        for variant in variants:
            child = [
                sys.executable,
                __file__,
                *sys.argv[1:],
                "--variant-child",
                variant,
                "--model-dir",
                str(model_dir),
            ]
            proc = subprocess.run(child, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                failed += 1
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                print(
                    json.dumps({"bench": "qlora", "variant": variant, "error": " | ".join(tail)}), flush=True
                )
            else:
                print(lines[-1], flush=True)
    return 1 if failed else 0


def pick_device(requested: str | None) -> str:
    import torch

    if requested:
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def build_model(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Random bf16 weights of the chosen shape, saved with transformers (built on the device: fast)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = dict(TINY if args.tiny else QWEN3_8B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    device = pick_device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    return shape


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from xpukit.loading.lora import apply_lora
    from xpukit.planning.lora_request import DEFAULT_LORA, resolve_lora

    variant = args.variant_child
    device = pick_device(args.device)
    facts = device_facts(device)
    quantized = variant != "bf16-lora"
    load_kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "device_map": facts.torch_device}
    if quantized:
        load_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **load_kwargs)
    torch.manual_seed(0)  # the same LoRA initialisation in every variant
    notes: list[str] = []
    if variant == "peft-kbit":
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        model = get_peft_model(model, LoraConfig(**DEFAULT_LORA))
        notes.append("peft.prepare_model_for_kbit_training: non-4-bit weights upcast to float32")
    else:
        lora = {"gradient_checkpointing": True, "liger": variant == "xpukit-lean-liger"}
        request = resolve_lora(lora, quantized=quantized)
        assert request is not None
        model, notes = apply_lora(model, request, compute_dtype="bfloat16", quantized=quantized, device=facts)
    liger = any(n.startswith("applied liger-kernel") for n in notes)
    weights_mem = memory_allocated(device)

    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(facts.torch_device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    model.train()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        losses.append(float(loss.detach()))
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak, mem_kind = peak_memory(device)
    n_trainable = sum(p.numel() for p in trainable)
    return {
        "bench": "qlora",
        "variant": variant,
        "device": facts.name,
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
        "batch": args.batch,
        "seq": args.seq,
        "peak_mem_gb": round(peak / 1e9, 2),
        "mem_kind": mem_kind,
        "weights_mem_gb": round(weights_mem / 1e9, 2) if weights_mem is not None else None,
        "tokens_per_s": round(args.batch * args.seq / step_s, 1),
        "step_s_median": round(step_s, 4),
        "steps_timed": args.steps,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "trainable_params": n_trainable,
        "gradient_checkpointing": True,
        "liger": liger,
        "notes": notes,
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
    }


def device_facts(device: str) -> Any:
    from xpukit.machine.probe import cpu_facts, detect

    if device == "cpu":
        return cpu_facts()
    return next(d for d in detect().devices if d.backend == device)


def synchronize(device: str) -> None:
    import torch

    if device != "cpu":
        getattr(torch, device).synchronize()


def memory_allocated(device: str) -> int | None:
    import torch

    return None if device == "cpu" else int(getattr(torch, device).memory_allocated())


def peak_memory(device: str) -> tuple[int, str]:
    if device == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_peak_rss"
    import torch

    return int(getattr(torch, device).max_memory_allocated()), f"{device}_max_memory_allocated"


def versions() -> dict[str, str | None]:
    from xpukit._compat import installed_version

    names = ("torch", "transformers", "peft", "bitsandbytes", "liger-kernel", "triton")
    return {name: installed_version(name) for name in names}


if __name__ == "__main__":
    sys.exit(main())
