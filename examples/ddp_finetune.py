"""LoRA fine-tuning with DDP: one process per device, each with a full copy of the model.

    xpukit launch --devices all --nproc auto -- examples/ddp_finetune.py      # every XPU/GPU
    xpukit launch --nproc 2 -- examples/ddp_finetune.py                       # 2 CPU processes (gloo)
    xpukit launch --devices 0,1 --nproc auto -- examples/ddp_finetune.py Qwen/Qwen3-0.6B --steps 200

Every rank runs this script. ``load_for_xpu`` reads the rank from the launcher's variables and puts
the whole model on ``<backend>:<local rank>`` (``device_map={"": local_rank}``); ``training_args(...,
strategy="ddp")`` adds the process-group backend (xccl on XPU, nccl on CUDA, gloo on CPU) and
``ddp_find_unused_parameters=False`` for LoRA. ``print(model.xpukit_plan.explain())`` shows the
``Launch`` line. See docs/distributed.md.
"""

from __future__ import annotations

import argparse

from xpukit import load_for_xpu, training_args
from xpukit.demo.tiny import corpus_lines, demo_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model directory or Hub id (default: embedded tiny model)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, help="default 1e-2 for the tiny model, 2e-4 for a real one")
    parser.add_argument("--output-dir", default="ddp-out", help="where rank 0 saves the adapter")
    options = parser.parse_args()
    model_id = options.model or str(demo_model_dir())
    lr = options.lr or (2e-4 if options.model else 1e-2)

    model = load_for_xpu(model_id, lora=True, strategy="ddp", seed=0)
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    tokenizer = AutoTokenizer.from_pretrained(model_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = [tokenizer(line, truncation=True, max_length=64) for line in corpus_lines()]
    args = training_args(
        model,
        strategy="ddp",
        output_dir=options.output_dir,
        per_device_train_batch_size=4,
        max_steps=options.steps,
        learning_rate=lr,
        logging_steps=5,
        save_strategy="no",
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()
    if args.process_index == 0:
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        print(f"{args.world_size} ranks on {args.device.type}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        model.save_pretrained(options.output_dir)


if __name__ == "__main__":
    main()
