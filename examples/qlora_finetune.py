"""QLoRA fine-tuning in one call: a 4-bit base model with LoRA adapters, ready for ``Trainer``.

    python examples/qlora_finetune.py                          # embedded tiny model, offline
    python examples/qlora_finetune.py Qwen/Qwen3-0.6B --steps 200 --lr 2e-4

``load_for_xpu(..., quantize="4bit", lora=True)`` returns a ``peft.PeftModel`` (nf4 + double
quantisation, compute in the device's dtype, gradient checkpointing where the step needs it to
fit), and ``training_args``
returns ``TrainingArguments`` whose precision and device settings work on this machine (bf16 where
native, ``use_cpu`` on a CPU, a paged 8-bit optimizer where bitsandbytes has one). Everything else is
plain transformers. The text is xpukit's small bundled corpus; use your own dataset instead.
"""

from __future__ import annotations

import argparse

from xpukit import load_for_xpu, training_args
from xpukit.demo.tiny import corpus_lines, demo_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model directory or Hub id (default: embedded tiny model)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, help="default 1e-2 for the tiny model, 2e-4 for a real one")
    parser.add_argument("--output-dir", default="qlora-out", help="where the adapter is saved")
    options = parser.parse_args()
    model_id = options.model or str(demo_model_dir())
    lr = options.lr or (2e-4 if options.model else 1e-2)

    model = load_for_xpu(model_id, quantize="4bit", lora=True)
    # Imported only now: `transformers.Trainer` imports peft and bitsandbytes, and on CPUs with
    # avx512_bf16 importing bitsandbytes asks the Hub with no timeout. load_for_xpu has imported
    # them already, under a bounded Hub check, so these imports cannot wait on the network.
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    model.print_trainable_parameters()
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    data = [tokenizer(line, truncation=True, max_length=64) for line in corpus_lines()]
    args = training_args(
        model,
        output_dir=options.output_dir,
        per_device_train_batch_size=8,
        max_steps=options.steps,
        learning_rate=lr,
        logging_steps=5,
        save_strategy="no",
    )
    print(f"training on {args.device}: bf16={args.bf16} fp16={args.fp16} optim={args.optim}")
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()

    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.save_pretrained(options.output_dir)  # the adapter only: a few hundred KB to a few hundred MB
    tokenizer.save_pretrained(options.output_dir)
    print(
        f"adapter saved in {options.output_dir}; load it with load_for_xpu(base, lora={options.output_dir!r})"
    )


if __name__ == "__main__":
    main()
