"""QLoRA memory and speed: the hand-written recipe vs xpukit's one call vs each saver forced vs unsloth.

One LoRA training step (forward, backward, AdamW on the LoRA weights: fused on CUDA/XPU, the
default of transformers' ``Trainer``; the loss read once the step is queued) of ``batch × seq`` tokens
(default 4 × 512) on a Qwen3-8B-shaped model (``--shape``: or Llama-3.1-8B, Phi-4-mini, Gemma-3-4B's
text model) with random weights built from a config (nothing is downloaded). Each variant runs in
its own process, so peak memory is its own and liger-kernel's
module-level patches cannot leak into the next variant; the variants are interleaved and the whole
round repeated (``--repeat``), and each row reports the median over rounds with the spread.
Prints one JSON line per variant and round, then one summary line per variant.

Variants:
    recipe            nf4 + ``peft.prepare_model_for_kbit_training`` + ``get_peft_model`` (what
                      tutorials write by hand; non-4-bit weights upcast to fp32, checkpointing on)
    xpukit-auto       ``load_for_xpu(quantize="4bit", lora=True, batch_size=, seq_len=)``: the
                      savers the training plan chose by fit
    xpukit-none       the same with ``lora={"gradient_checkpointing": False, "liger": False}``
    xpukit-liger      ``{"gradient_checkpointing": False, "liger": True}``
    xpukit-gc         ``{"gradient_checkpointing": True, "liger": False}``
    xpukit-gc-liger   ``{"gradient_checkpointing": True, "liger": True}``
    xpukit-offload    ``{"gradient_checkpointing": "offload", "liger": False}``
    xpukit-fused      the plan's savers with the fused 4-bit LoRA path: ``lora={"fused": True}``
                      (until the plan knows that key: ``lora=True``, then
                      ``xpukit.loading.training.fused_lora.apply_fused_lora(model, insist=True)``)
    xpukit-unfused    the plan's savers with the fused path off (``lora={"fused": False}``, or
                      ``lora=True`` while the plan does not know the key)
    xpukit-fused-none the fused path with the savers off
    xpukit-fused-liger / -gc / -offload
                      the fused path with one rung of the ladder forced: liger's fused linear
                      cross-entropy, checkpointing, offloaded checkpointing (the calibration of the
                      activation estimate, rung by rung)
    xpukit-fused-eager
                      the plan's savers with the fused path and the CUDA graphs of the decoder
                      layers off (``lora={"fused": True, "graphs": False}``): what the graphs save
    xpukit-fused-chunked
                      xpukit-fused-none with xpukit's chunked cross-entropy
                      (``xpukit.loading.training.chunked_loss.apply_chunked_loss``)
    unsloth           ``FastLanguageModel`` with ``use_gradient_checkpointing="unsloth"`` (skipped
                      with a note when unsloth is not installed)
    unsloth-nogc      unsloth with checkpointing off
    xpukit-gc-graphs  ``lora={"gradient_checkpointing": True, "graphs": True}``: each layer
                      checkpointed inside the layer graphs
    xpukit-nocheck    xpukit-auto with the fused path's load-time check skipped (the bench replaces
                      ``check_blocks`` with one that checks nothing): ``load_s`` + ``first_step_s``
                      against xpukit-auto's is the check's own cost, apart from the kernels' first
                      compilation, which the first step pays when the check did not (with
                      ``--kernel-caches empty`` or the default ``own``, bench/_caches.py)

A step runs the plan's micro-batch (``micro_batch_run``) with gradient accumulation up to
``--batch``, as ``Trainer`` does with ``training_args``; the other variants run the whole batch.
``lora_grad_gb`` is the LoRA gradients' size: they are inside the measured ``activation_gb`` and in
the plan's fixed part, not in its estimate.

All use LoRA r=16/alpha=32 on all linear layers (dropout as xpukit's default) and bf16 autocast
(fp32 on a CPU without native bf16). Each xpukit row also carries the plan's activation estimate
(``estimate_gb``) beside the measured peak above the weights, to check the estimate (±15 %).

Every row on CUDA/XPU carries ``kernels_per_step`` (device kernels and copies launched by one
training step, counted by ``torch.profiler`` over one extra untimed step). ``--profile`` adds a
``torch.profiler`` breakdown over 3 more untimed steps, printed as one ``{"profile": VARIANT}`` line
per variant and round: wall and device time per step, GPU busy % (the union of kernel intervals over
the wall time; the profiler itself slows the host), kernels per step, and device time per step by
category (GEMM, 4-bit dequantisation, copies/casts, other elementwise, attention, optimizer, other),
with the top kernels.

``--profile`` also runs ``cProfile`` over 2 more steps and prints the host's top functions by own
time (``host_top``), to show where the host's time goes when the device waits for it.

``--finetune`` instead runs a short real fine-tune on the demo model and corpus
(:func:`xpukit.demo.tiny.corpus_lines`) for each ``--dropouts`` value: loss per step, held-out loss
and tokens/s (the measurement behind the ``lora_dropout`` default, docs/training.md).

Usage::

    python bench/bench_qlora.py                      # CUDA (or XPU): Qwen3-8B shape, 36 layers
    python bench/bench_qlora.py --layers 8           # the same widths, fewer layers
    python bench/bench_qlora.py --shape gemma-3-4b   # another family: llama-3.1-8b, phi-4-mini, gemma-3-4b
    python bench/bench_qlora.py --shape gemma-3-4b --liger-chunk-mem-const 26  # liger CE, larger chunks
    python bench/bench_qlora.py --tiny               # any device, a tiny shape (CPU check: ~2 min)
    python bench/bench_qlora.py --finetune --steps 50  # lora_dropout 0.05 vs 0 on the demo corpus
    python bench/bench_qlora.py --variants xpukit-fused,xpukit-unfused,unsloth-nogc --profile

Peak memory (``peak_mem_gb``) is ``torch.<device>.max_memory_allocated`` over the timed steps plus,
with the layer graphs, what their private pool holds beyond its live tensors: a replay writes the
step's activations into that pool without the allocator seeing it, so the allocated figure alone
(``peak_allocated_gb``) misses them (rows before 2026-12-02's second H200 round did).
On CPU it is the child's peak RSS over the timed steps, which also counts the Python libraries.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import _harness as h  # bench/_harness.py, beside this script: devices, memory, rounds, rows
from _kernels import host_profile, profile_steps
from _peers import load_recipe, load_unsloth
from _shapes import SHAPES, build_model
from _switches import chunked_loss_instead, liger_chunks, liger_rope

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # bitsandbytes reaches for the Hub at import otherwise
# On the CPU, peak memory is the RSS high-water mark: with a fixed mmap threshold every tensor buffer
# is its own mapping, returned to the OS when freed, so RSS follows what torch holds.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

VARIANTS = (
    "recipe",
    "xpukit-auto",
    "xpukit-none",
    "xpukit-liger",
    "xpukit-gc",
    "xpukit-gc-liger",
    "xpukit-offload",
    "xpukit-fused",
    "xpukit-unfused",
    "xpukit-fused-none",
    "xpukit-fused-liger",
    "xpukit-fused-gc",
    "xpukit-fused-offload",
    "xpukit-fused-eager",
    "xpukit-fused-chunked",
    "xpukit-nocheck",
    "xpukit-gc-graphs",
    "unsloth",
    "unsloth-nogc",
)
# lora= for each forced xpukit variant.
FORCED: dict[str, dict[str, Any]] = {
    "xpukit-none": {"gradient_checkpointing": False, "liger": False},
    "xpukit-liger": {"gradient_checkpointing": False, "liger": True},
    "xpukit-gc": {"gradient_checkpointing": True, "liger": False},
    "xpukit-gc-liger": {"gradient_checkpointing": True, "liger": True},
    "xpukit-offload": {"gradient_checkpointing": "offload", "liger": False},
    "xpukit-fused": {"fused": True},
    "xpukit-unfused": {"fused": False},
    "xpukit-fused-none": {"gradient_checkpointing": False, "liger": False, "fused": True},
    "xpukit-fused-liger": {"gradient_checkpointing": False, "liger": True, "fused": True},
    "xpukit-fused-gc": {"gradient_checkpointing": True, "liger": False, "fused": True},
    "xpukit-fused-offload": {"gradient_checkpointing": "offload", "liger": False, "fused": True},
    "xpukit-fused-eager": {"fused": True, "graphs": False},
    "xpukit-fused-chunked": {"gradient_checkpointing": False, "liger": False, "fused": True},
    "xpukit-gc-graphs": {"gradient_checkpointing": True, "graphs": True},
}
PROFILE_STEPS = 3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny shape that runs on CPU in seconds")
    parser.add_argument(
        "--shape",
        default="qwen3-8b",
        choices=sorted(SHAPES),
        help="the model family and size (random weights)",
    )
    parser.add_argument("--layers", type=int, help="override num_hidden_layers (keeps the widths)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 512; 128 with --tiny)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    h.add_variant_arguments(parser, VARIANTS)
    parser.add_argument("--max-memory", help="the device budget for xpukit-auto, e.g. 8GB")
    parser.add_argument(
        "--liger-chunk-mem-const",
        type=int,
        help="xpukit variants: liger's fused linear cross-entropy with this chunk_mem_const in place of "
        "the per-call value xpukit passes for 512-token chunks (liger's chunk is about this many "
        "times tokens x hidden; liger's default 1)",
    )
    parser.add_argument(
        "--liger-rope",
        action="store_true",
        help="xpukit variants: liger-kernel's RoPE kernel as the model family's apply_rotary_pos_emb in "
        "this process (xpukit leaves transformers' RoPE; a measurement switch)",
    )
    parser.add_argument(
        "--chunked-loss-tokens",
        type=int,
        help="xpukit variants: xpukit's chunked cross-entropy at this many tokens a chunk instead of "
        "the loss the plan chose (liger's fused loss is taken off the model)",
    )
    parser.add_argument("--device", help="cuda, xpu or cpu (default: the first available)")
    parser.add_argument("--workdir", help="where the random model is written (default: a temp dir)")
    parser.add_argument(
        "--model-cache",
        help="keep the random model in this directory and reuse it (--variants '' only builds)",
    )
    parser.add_argument("--finetune", action="store_true", help="the lora_dropout fine-tune (docstring)")
    parser.add_argument("--dropouts", default="0.05,0", help="--finetune: lora_dropout values")
    parser.add_argument(
        "--fused", default="", help="--finetune: also vary the fused path, e.g. 'off,on' (dropout 0 only)"
    )
    parser.add_argument(
        "--losses", default="", help="--finetune: also vary the loss, e.g. 'plain,chunked' (dropout 0 only)"
    )
    parser.add_argument(
        "--tokenizer",
        help="unsloth: a small local tokenizer (it always loads one; default: the demo model's)",
    )
    parser.add_argument("--profile", action="store_true", help="torch.profiler breakdown (docstring)")
    args = parser.parse_args()
    args.seq = args.seq or (128 if args.tiny else 512)
    if args.variant_child:
        h.emit(run_variant(args))
        return 0
    if args.finetune:
        from _finetune import finetune  # bench/_finetune.py: the lora_dropout fine-tune

        return finetune(args)
    variants = h.chosen_variants(parser, args.variants, VARIANTS)
    return h.rounds_of_children(
        args, variants, script=__file__, bench="qlora", summarize=summary, build=build_model
    )


SUMMED = ("tokens_per_s", "peak_mem_gb", "activation_gb", "loss_first", "kernels_per_step")
KEPT = ("estimate_gb", "gradient_checkpointing", "liger", "fused", "micro_batch", "device", "mem_kind")


def summary(variant: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over the rounds of one variant, and the last round's settings."""
    return h.summary(variant, rows, bench="qlora", summed=SUMMED, kept=KEPT)


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    variant = args.variant_child
    device = h.pick_device(args.device)
    facts = h.device_facts(device)
    dtype = "bfloat16" if device != "cpu" or facts.native_bf16 else "float32"
    load_started = time.perf_counter()
    if variant.startswith("unsloth"):
        model, notes, plan = load_unsloth(args, variant, dtype)
    elif variant == "recipe":
        model, notes, plan = load_recipe(args, facts, dtype)
    else:
        model, notes, plan = load_xpukit(args, variant, device, dtype)
    h.synchronize(device)
    load_s = time.perf_counter() - load_started  # the fused path's load-time check included
    check = check_seconds(device)
    weights_mem = h.memory_allocated(device)
    if variant == "xpukit-fused-chunked":
        from xpukit.loading.training.chunked_loss import apply_chunked_loss

        notes.append(apply_chunked_loss(model.get_base_model()))
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(facts.torch_device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # transformers' Trainer defaults to the fused AdamW (optim="adamw_torch_fused"); so does the bench.
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=device in ("cuda", "xpu"))
    model.train()

    # The plan's micro-batch, as Trainer runs it through training_args (gradient accumulation).
    micro = int(getattr(getattr(plan, "training", None), "micro_batch", None) or args.batch)
    parts = ids.split(micro)

    def train_step() -> float:
        total = []
        for part in parts:
            with torch.autocast(device_type=device, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
                loss = model(input_ids=part, labels=part).loss / len(parts)
            loss.backward()
            total.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Read once the step is queued, as Trainer does (it reads the loss at logging steps only).
        return float(sum(total))

    timing = h.timed_steps(train_step, device, args.warmup, args.steps)
    times, losses, base, first_step_s = timing.times, timing.results, timing.base, timing.first_step_s
    peak, mem_kind = h.peak_memory(device)  # before the profiled steps, which hold the profiler's buffers
    # The graphs' pools are written by replays the allocator does not see (graph_pool_slack).
    slack = h.graph_pool_slack(device)
    kernels = profile_steps(train_step, device, 1)["kernels_per_step"] if device != "cpu" else None
    profile = profile_steps(train_step, device, PROFILE_STEPS) if args.profile and device != "cpu" else None
    if profile is not None:
        profile["host_top"] = host_profile(train_step, device, 2)
    step_s = statistics.median(times)
    training = getattr(plan, "training", None)
    return {
        "bench": "qlora",
        "variant": variant,
        "device": facts.name,
        "dtype": dtype,
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
        "model_type": model.config.model_type,
        "load_s": round(load_s, 2),
        "check_s": check,
        "first_step_s": round(first_step_s, 3) if first_step_s is not None else None,
        "batch": args.batch,
        "seq": args.seq,
        "peak_mem_gb": round((peak + slack) / 1e9, 3),
        "peak_allocated_gb": round(peak / 1e9, 3),
        "graph_pool_slack_gb": round(slack / 1e9, 3),
        "peak_reserved_gb": round(reserved / 1e9, 3) if (reserved := h.peak_reserved(device)) else None,
        "activation_gb": round((peak + slack - base) / 1e9, 3) if base is not None else None,
        "estimate_gb": round(training.estimate["peak"] / 1e9, 3) if training is not None else None,
        "mem_kind": mem_kind,
        "weights_mem_gb": round(weights_mem / 1e9, 3) if weights_mem is not None else None,
        "tokens_per_s": round(args.batch * args.seq / step_s, 1),
        "kernels_per_step": kernels,
        "step_s_median": round(step_s, 4),
        "steps_timed": args.steps,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "trainable_params": sum(p.numel() for p in trainable),
        "gradient_checkpointing": getattr(training, "gradient_checkpointing", None),
        "liger": any(str(n).startswith("applied liger-kernel") for n in notes),
        "fused": any(str(n).startswith("fused LoRA:") and "nothing fused" not in str(n) for n in notes),
        "micro_batch": getattr(training, "micro_batch", None),
        "micro_batch_run": micro,
        "lora_grad_gb": round(sum(p.numel() * 4 for p in trainable) / 1e9, 3),
        "notes": [str(n) for n in notes],
        "graphs_rope": graphs.rope.note if (graphs := getattr(model, "xpukit_layer_graphs", None)) else None,
        "versions": h.versions(),
        "date": h.today(),
        **({"profile": profile} if profile is not None else {}),
    }


CHECKS: dict[str, Any] = {}  # the fused path's load-time check: its first run's seconds, a rerun


def check_seconds(device: str) -> dict[str, Any] | None:
    """The load-time check's wall time in the load (its first run: the fused kernels compile there)
    and run again on the same model right after (kernels warm: the check's own work)."""
    if "again" not in CHECKS:
        return None
    h.synchronize(device)
    start = time.perf_counter()
    checks = CHECKS["again"]()
    h.synchronize(device)
    return {
        "in_load_s": round(CHECKS["first_s"], 3),
        "again_s": round(time.perf_counter() - start, 3),
        "again_per_type_s": [round(c.seconds, 3) for c in checks],
    }


def load_xpukit(
    args: argparse.Namespace, variant: str, device: str, dtype: str
) -> tuple[Any, list[str], Any]:
    """xpukit's one call; the forced variants pin the savers (and the fused path) through lora=.

    Where the plan does not know ``lora={"fused": ...}`` yet, the key is dropped and the fused
    variants call :func:`xpukit.loading.training.fused_lora.apply_fused_lora` on the loaded model.
    """
    from xpukit import load_for_xpu
    from xpukit.errors import InvalidRequestError

    lora: Any = FORCED.get(variant, True)
    max_memory = {0 if device != "cpu" else "cpu": args.max_memory} if args.max_memory else None

    def load(lora: Any) -> Any:
        return load_for_xpu(
            args.model_dir,
            device=device,
            dtype=dtype,
            quantize="4bit",
            lora=lora,
            seed=0,
            batch_size=args.batch,
            seq_len=args.seq,
            max_memory=max_memory,
        )

    from xpukit.loading.training import fused_lora

    if args.liger_chunk_mem_const:
        liger_chunks(args.liger_chunk_mem_const)
    rope_note = liger_rope(args.shape) if args.liger_rope else None
    if variant == "xpukit-nocheck":  # the check's own cost: the same load with a check of nothing
        fused_lora.check_blocks = lambda model, groups, dtype: []  # type: ignore[assignment]
    else:
        original = fused_lora.check_blocks

        def timed(model: Any, groups: Any, dtype: Any) -> Any:  # the check, timed; kept to run again
            h.synchronize(device)
            start = time.perf_counter()
            checks = original(model, groups, dtype)
            h.synchronize(device)
            CHECKS.update(first_s=time.perf_counter() - start, again=lambda: original(model, groups, dtype))
            return checks

        fused_lora.check_blocks = timed  # type: ignore[assignment]
    late_fuse = False
    try:
        model = load(lora)
    except InvalidRequestError as exc:
        if not (isinstance(lora, dict) and "fused" in lora and "fused" in str(exc)):
            raise
        late_fuse = lora["fused"]
        lora = {k: v for k, v in lora.items() if k != "fused"} or True
        model = load(lora)
    plan = model.xpukit_plan
    notes = [e.actual for e in plan.events if e.what == "lora"]
    if late_fuse:
        from xpukit.loading.training.fused_lora import apply_fused_lora

        liger = isinstance(lora, dict) and lora.get("liger") is False
        notes += apply_fused_lora(model, insist=True, liger=False if liger else None)
        notes.append("(fused by the bench: the plan does not know lora={'fused': ...} yet)")
    if args.chunked_loss_tokens:
        notes.append(chunked_loss_instead(model, args.chunked_loss_tokens))
    if rope_note:
        notes.append(rope_note)
    return model, notes, plan


if __name__ == "__main__":
    sys.exit(main())
