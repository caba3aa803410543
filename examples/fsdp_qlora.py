"""QLoRA with FSDP2: a 4-bit model whose weights are sharded over the ranks, LoRA adapters trained.

    xpukit launch --devices all --nproc auto -- examples/fsdp_qlora.py Qwen/Qwen3-8B --steps 100
    xpukit launch --nproc 2 -- examples/fsdp_qlora.py          # CPU: torch's fully_shard, tiny model

``load_for_xpu(..., quantize="4bit", lora=True, strategy="fsdp")`` plans the load for sharding: the
4-bit weights are stored in the compute dtype (``bnb_4bit_quant_storage``), which FSDP needs to
shard them beside the other weights. On an XPU/GPU ``training_args(model, strategy="fsdp")`` gives
``Trainer`` the FSDP2 ``fsdp_config`` (auto-wrap by the model's decoder layers, activation
checkpointing through FSDP). accelerate applies FSDP only on accelerators, so on the CPU this
script shards with torch's ``fully_shard`` and a plain loop instead (docs/distributed.md).
"""

from __future__ import annotations

import argparse

from xpukit import load_for_xpu, training_args
from xpukit.demo.tiny import corpus_lines, demo_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model directory or Hub id (default: embedded tiny model)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, help="default 1e-2 for the tiny model, 2e-4 for a real one")
    parser.add_argument("--output-dir", default="fsdp-out")
    options = parser.parse_args()
    model_id = options.model or str(demo_model_dir())
    lr = options.lr or (2e-4 if options.model else 1e-2)

    model = load_for_xpu(model_id, quantize="4bit", lora=True, strategy="fsdp", seed=0)
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    tokenizer = AutoTokenizer.from_pretrained(model_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lines = corpus_lines()
    if model.xpukit_plan.device.backend in {"cpu", "mps"}:
        cpu_loop(model, tokenizer, lines, options.steps, lr)
        return
    data = [tokenizer(line, truncation=True, max_length=64) for line in lines]
    args = training_args(
        model,
        strategy="fsdp",
        output_dir=options.output_dir,
        per_device_train_batch_size=2,
        max_steps=options.steps,
        learning_rate=lr,
        logging_steps=5,
        save_strategy="no",
        gradient_checkpointing=True,  # becomes FSDP activation checkpointing
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()
    trainer.save_model(options.output_dir)


def cpu_loop(model: object, tokenizer: object, lines: list[str], steps: int, lr: float) -> None:
    """FSDP2 on the CPU (gloo) with torch's own fully_shard, wrapping the model's decoder layers."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from xpukit.training.strategy import strategy_facts

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wrap = strategy_facts(model, world).wrap_classes
    for module in model.modules():  # type: ignore[attr-defined]
        if type(module).__name__ in wrap:
            fully_shard(module)
    fully_shard(model)  # type: ignore[arg-type]
    params = [p for p in model.parameters() if p.requires_grad]  # type: ignore[attr-defined]
    optimizer = torch.optim.AdamW(params, lr=lr)
    for step in range(steps):
        texts = lines[(step * world + rank) * 2 :][:2]
        batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=64)  # type: ignore[operator]
        loss = model(**batch, labels=batch["input_ids"]).loss  # type: ignore[operator]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
