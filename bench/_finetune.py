"""``bench_qlora.py --finetune``: a short real fine-tune of the demo model on the demo corpus per
``lora_dropout`` value (and, at dropout 0, per fused path and loss): loss per step, held-out loss,
tokens/s (the measurement behind the ``lora_dropout`` default, docs/training.md)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from _harness import today, versions


def finetune(args: argparse.Namespace) -> int:
    """A short real fine-tune of the demo model on the demo corpus per lora_dropout value."""
    import torch
    from transformers import AutoTokenizer

    from xpukit import load_for_xpu
    from xpukit.demo.tiny import corpus_lines, demo_model_dir

    path = demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = corpus_lines()
    held_out, train_lines = lines[::10], [ln for i, ln in enumerate(lines) if i % 10]
    steps = args.steps if args.steps != 5 else 50
    for round_ in range(args.repeat):
        settings: list[tuple[float, bool | None, str]] = [
            (float(d), None, "plain") for d in args.dropouts.split(",") if d
        ]
        settings += [(0.0, f == "on", "plain") for f in args.fused.split(",") if f]
        settings += [(0.0, None, loss) for loss in args.losses.split(",") if loss]
        for dropout, fused, loss_kind in settings[:: 1 if round_ % 2 == 0 else -1]:
            lora: dict[str, Any] = {"lora_dropout": dropout}
            if fused is not None:
                lora["fused"] = fused
            model = load_for_xpu(path, device=args.device or "cpu", quantize="4bit", lora=lora, seed=0)
            if loss_kind == "chunked":
                from xpukit.loading.training.chunked_loss import apply_chunked_loss

                apply_chunked_loss(model.get_base_model())
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-2)
            generator = torch.Generator().manual_seed(round_)
            losses, tokens, started = [], 0, time.perf_counter()
            model.train()
            for _ in range(steps):
                pick = torch.randint(0, len(train_lines), (8,), generator=generator).tolist()
                batch = tokenizer([train_lines[i] for i in pick], return_tensors="pt", padding=True)
                labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
                loss = model(**batch, labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(round(float(loss), 4))
                tokens += int(batch["attention_mask"].sum())
            seconds = time.perf_counter() - started
            model.eval()
            with torch.no_grad():
                batch = tokenizer(held_out, return_tensors="pt", padding=True)
                labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
                held = float(model(**batch, labels=labels).loss)
            print(
                json.dumps(
                    {
                        "bench": "qlora-finetune",
                        "round": round_,
                        "lora_dropout": dropout,
                        "fused": fused,
                        "loss": loss_kind,
                        "steps": steps,
                        "loss_first": losses[0],
                        "loss_last10_mean": round(statistics.mean(losses[-10:]), 4),
                        "held_out_loss": round(held, 4),
                        "tokens_per_s": round(tokens / seconds, 1),
                        "seconds": round(seconds, 2),
                        "losses": losses,
                        "versions": versions(),
                        "date": today(),
                    }
                ),
                flush=True,
            )
    return 0
