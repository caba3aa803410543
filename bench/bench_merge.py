"""Merging a LoRA adapter trained on a 4-bit base: into which weights (docs/merging.md "Merging an adapter")?

Builds a tiny Qwen3 (``--hidden``, ``--layers``; float32 checkpoint), trains a LoRA adapter on it
for ``--steps`` AdamW steps on the bundled corpus — once on the 4-bit base (QLoRA: nf4, double
quantisation, float32 compute, the base ``load_for_xpu(quantize="4bit")`` gives) and once on the
full-precision base (plain LoRA) — and compares, on held-out corpus lines, the model each adapter
was trained in (the reference) with:

- ``original``: the adapter merged into the original full-precision weights
  (``PeftModel.from_pretrained(base).merge_and_unload()``);
- ``dequantized``: the adapter merged into the 4-bit weights dequantised back to full precision
  (transformers' ``model.dequantize()``, i.e. bitsandbytes' ``dequantize_4bit``), then merged;
- ``peft-4bit``: peft's ``merge_and_unload()`` on the 4-bit model itself (re-quantises every merged
  weight: the path xpukit refuses);
- ``xpukit-dequantized`` / ``xpukit-original``: ``load_for_xpu(base, lora=adapter, merge=...)``, which
  must reproduce the two rows above;
- ``base-original`` / ``base-4bit``: the base without the adapter (the adapter's own effect, for scale).

Per row: logits max-abs and mean-abs difference against the reference, the share of greedy tokens
(``--new-tokens`` per prompt) equal to the reference's, and the held-out loss. Everything runs on the
CPU in float32 with fixed seeds; bitsandbytes' CPU repacking is kept off so every 4-bit forward takes
the same kernel. One JSON line per row.

Usage::

    python bench/bench_merge.py                        # hidden 256, 4 layers, 150 steps
    python bench/bench_merge.py --hidden 64 --layers 2 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import warnings
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "xpukit"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def no_repack(model: Any) -> Any:
    """bitsandbytes' CPU inference repacking off: every 4-bit forward takes the training kernel."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def train(model: Any, batches: list[dict[str, Any]], steps: int, lr: float) -> list[float]:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def outputs(model: Any, held_out: dict[str, Any], prompts: Any, new_tokens: int) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        out = model(**held_out)
        generated = model.generate(**prompts, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[
            :, prompts["input_ids"].shape[1] :
        ]
    return {"logits": out.logits.float(), "loss": float(out.loss), "tokens": generated}


def compare(name: str, got: dict[str, Any], ref: dict[str, Any], mask: Any) -> dict[str, Any]:
    diff = (got["logits"] - ref["logits"]).abs()[mask]
    return {
        "variant": name,
        "logits_max_abs": round(float(diff.max()), 6),
        "logits_mean_abs": round(float(diff.mean()), 6),
        "greedy_same": round(float((got["tokens"] == ref["tokens"]).float().mean()), 4),
        "loss": round(got["loss"], 5),
        "reference_loss": round(ref["loss"], 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.demo.tiny import corpus_lines
    from xpukit.loading.load import load_for_xpu
    from xpukit.planning.plan import plan_load

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings(
        "ignore", category=UserWarning
    )  # peft's "merge into 4-bit" warning, measured here
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    common: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "versions": versions(),
        "hidden": args.hidden,
        "layers": args.layers,
        "steps": args.steps,
        "lr": args.lr,
        "rank": args.rank,
        "dtype": "float32",
    }
    from xpukit.demo.tiny import build_tiny_model

    lines = corpus_lines()
    train_lines, held_lines = lines[:-12], lines[-12:]
    lora = {"r": args.rank, "lora_alpha": 2 * args.rank, "lora_dropout": 0.0}
    with tempfile.TemporaryDirectory(prefix="xpukit-bench-merge-") as root:
        base = build_tiny_model(
            "qwen3",
            Path(root) / "base",
            seed=args.seed,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            head_dim=32 if args.hidden >= 128 else 16,
        )
        tok = AutoTokenizer.from_pretrained(base)

        def encode(texts: list[str]) -> dict[str, Any]:
            enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=32)
            enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
            return dict(enc)

        batches = [encode(train_lines[i : i + 8]) for i in range(0, len(train_lines) - 7, 8)]
        held_out = encode(held_lines)
        mask = held_out["attention_mask"].bool()
        prompt_texts = [" ".join(line.split()[:3]) for line in held_lines]
        tok.padding_side = "left"
        prompts = dict(tok(prompt_texts, return_tensors="pt", padding=True))
        four_bit = plan_load(base, device="cpu", dtype="float32", quantize="4bit").from_pretrained_kwargs()
        full = {"dtype": torch.float32, "device_map": "cpu"}

        for trained_on in ("4bit", "full"):
            quantize = "4bit" if trained_on == "4bit" else None
            model = load_for_xpu(
                base, device="cpu", dtype="float32", quantize=quantize, lora=lora, seed=args.seed
            )
            losses = train(no_repack(model), batches, args.steps, args.lr)
            adapter = Path(root) / f"adapter-{trained_on}"
            model.save_pretrained(adapter)
            reference = outputs(model, held_out, prompts, args.new_tokens)
            del model

            variants: dict[str, Any] = {}
            variants["original"] = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(base, **full), adapter
            ).merge_and_unload()
            quantized = no_repack(AutoModelForCausalLM.from_pretrained(base, **four_bit))
            variants["dequantized"] = PeftModel.from_pretrained(
                quantized.dequantize(dtype=torch.float32), adapter
            ).merge_and_unload()
            quantized = no_repack(AutoModelForCausalLM.from_pretrained(base, **four_bit))
            variants["peft-4bit"] = no_repack(
                PeftModel.from_pretrained(quantized, adapter).merge_and_unload()
            )
            for merge in ("dequantized", "original"):  # xpukit's own merge must give the rows above
                variants[f"xpukit-{merge}"] = load_for_xpu(
                    base, device="cpu", dtype="float32", lora=str(adapter), merge=merge
                )
            variants["base-original"] = AutoModelForCausalLM.from_pretrained(base, **full)
            variants["base-4bit"] = no_repack(AutoModelForCausalLM.from_pretrained(base, **four_bit))
            for name, merged in variants.items():
                row = compare(name, outputs(merged, held_out, prompts, args.new_tokens), reference, mask)
                print(
                    json.dumps(
                        {
                            **common,
                            "trained_on": trained_on,
                            "train_loss_first": round(losses[0], 4),
                            "train_loss_last": round(losses[-1], 4),
                            **row,
                        }
                    ),
                    flush=True,
                )
            del variants


if __name__ == "__main__":
    main()
