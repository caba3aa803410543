"""The loss over a large vocabulary: plain vs xpukit's chunked vs liger-kernel's fused linear CE.

One ``lm_head`` + causal-LM cross-entropy, forward and backward, on random bf16 hidden states
(``--tokens`` × ``--hidden``) and a frozen ``--vocab`` × ``--hidden`` head (the Qwen3-8B sizes by
default: 2 048 tokens, 4 096, 151 936): time per call (median of ``--steps`` after 3 untimed) and the
peak memory above the inputs, per variant, one JSON line each. Variants:

* ``plain``: ``lm_head`` then transformers' ``ForCausalLMLoss`` (fp32 logits);
* ``chunked``: :func:`xpukit.kernels.chunked_ce.chunked_linear_cross_entropy`;
* ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropyLoss`` (skipped without liger/triton), in
  its default chunks;
* ``liger-chunk``: :func:`xpukit.kernels.chunked_ce.liger_linear_cross_entropy`, the same kernel in
  chunks of ``LOSS_CHUNK_TOKENS`` (what xpukit's plan runs; skipped without liger/triton).

The loss and the hidden-state gradient of each variant are compared with ``plain``'s.

Usage::

    python bench/bench_loss.py                    # CUDA / XPU
    python bench/bench_loss.py --device cpu --tokens 256 --vocab 32000 --hidden 512
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from typing import Any


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default="plain,chunked,liger,liger-chunk")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(1, args.tokens, args.hidden, generator=g) / 4).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / 64).to(device, dtype)
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=g).to(device)
    reference: tuple[Any, Any] | None = None
    for variant in args.variants.split(","):
        loss_fn = make(variant, weight, args.vocab)
        if loss_fn is None:
            print(json.dumps({"bench": "loss", "variant": variant, "skipped": "liger-kernel/triton missing"}))
            continue

        def step(loss_fn: Any = loss_fn) -> tuple[Any, Any]:
            h = hidden.detach().requires_grad_()
            loss = loss_fn(h, labels)
            loss.backward()
            return loss.detach(), h.grad

        for _ in range(3):
            step()
        sync(device)
        base = memory(device, reset=True)
        times = []
        for _ in range(args.steps):
            sync(device)
            start = time.perf_counter()
            loss, grad = step()
            sync(device)
            times.append(time.perf_counter() - start)
        peak = memory(device, reset=False)
        if reference is None:
            reference = (loss.float(), grad.float())
        row = {
            "bench": "loss",
            "variant": variant,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "tokens": args.tokens,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "dtype": str(dtype).removeprefix("torch."),
            "ms": round(statistics.median(times) * 1e3, 2),
            "ms_range": [round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
            "peak_extra_gb": round((peak - base) / 1e9, 3) if peak is not None and base is not None else None,
            "loss": round(float(loss), 5),
            "loss_diff": abs(float(loss) - float(reference[0])),
            "grad_rel_diff": float((grad.float() - reference[1]).norm() / reference[1].norm()),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        print(json.dumps(row), flush=True)


def make(variant: str, weight: Any, vocab: int) -> Any:
    if variant == "plain":
        from transformers.loss.loss_utils import ForCausalLMLoss

        return lambda h, y: ForCausalLMLoss(h @ weight.t(), y, vocab_size=vocab)
    if variant == "chunked":
        from xpukit.kernels.chunked_ce import chunked_linear_cross_entropy
        from xpukit.planning.training.activation_memory import chunk_tokens

        return lambda h, y: chunked_linear_cross_entropy(h, weight, y, chunk=chunk_tokens(vocab))
    if variant in ("liger", "liger-chunk"):
        if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
            return None
        import torch
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        if variant == "liger-chunk":
            from xpukit.kernels.chunked_ce import liger_linear_cross_entropy
            from xpukit.planning.training.loss_chunk import liger_chunk_mem_const

            def chunked(h: Any, y: Any) -> Any:
                c = liger_chunk_mem_const(h.numel() // h.shape[-1], vocab, h.shape[-1])
                return liger_linear_cross_entropy(h, weight, y, chunk_mem_const=c)

            return chunked

        liger = LigerFusedLinearCrossEntropyLoss()

        def loss(h: Any, y: Any) -> Any:
            shifted = torch.nn.functional.pad(y, (0, 1), value=-100)[..., 1:]
            return liger(weight, h.reshape(-1, h.shape[-1]), shifted.reshape(-1))

        return loss
    raise SystemExit(f"unknown variant {variant!r}: plain, chunked, liger or liger-chunk")


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device: Any, *, reset: bool) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    return int(torch.cuda.max_memory_allocated(device))


if __name__ == "__main__":
    main()
