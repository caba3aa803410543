"""Inference with xpukit: plan, load on the best device this machine has, generate, use a pipeline.

    python examples/inference.py                        # the embedded tiny model, offline
    python examples/inference.py Qwen/Qwen3-0.6B         # a real model (downloaded once by transformers)
    python examples/inference.py Qwen/Qwen3-0.6B "The capital of France is"

The same script runs on an Intel GPU (xpu), CUDA, Apple MPS or the CPU: xpukit picks the device,
dtype, attention and placement, and ``model.xpukit_plan`` says what it chose and why. The embedded
tiny model has random weights, so its text is noise; it is here so the script runs anywhere, offline.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, pipeline

from xpukit import load_for_xpu, plan_load
from xpukit.demo.tiny import demo_model_dir


def main() -> None:
    model_id = sys.argv[1] if len(sys.argv) > 1 else str(demo_model_dir())
    prompt = sys.argv[2] if len(sys.argv) > 2 else "The baker"

    # 1. The dry run: every choice and its reason, from the config alone (no weights read).
    print(plan_load(model_id).explain())

    # 2. Load as planned. The result is a plain transformers model, already on its device.
    model = load_for_xpu(model_id)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    plan = model.xpukit_plan
    print(f"\nloaded on {model.device} in {plan.dtype} with {plan.attn_implementation} attention")
    for fallback in plan.fallbacks:  # anything that could not be had as planned, with the cause
        print(f"  fallback: {fallback.what} {fallback.planned} -> {fallback.actual} ({fallback.cause})")

    # 3. generate(): inputs go to the model's device.
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        tokens = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    print("\ngenerate():", tokenizer.decode(tokens[0], skip_special_tokens=True))

    # 4. A pipeline over the loaded model. Pass no device=: the model is already placed.
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    result = generator(prompt, max_new_tokens=20, do_sample=False)
    print("pipeline(): ", result[0]["generated_text"])


if __name__ == "__main__":
    main()
