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
                      ``--cold-caches``: otherwise a child finds the kernels an earlier one compiled)

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
(``peak_allocated_gb``) misses them (rows before 2026-12-02's second H200 session did).
On CPU it is the child's peak RSS over the timed steps, which also counts the Python libraries.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _kernels import ms_per_step_by_category  # bench/_kernels.py, beside this script

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
# More families' shapes (``--shape``), from their config.json files; RoPE scaling is left out (it
# changes no step's arithmetic cost) so the configs build under transformers 5.17 and 5.22 alike.
LLAMA31_8B = {  # meta-llama/Llama-3.1-8B
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
PHI4_MINI = {  # microsoft/Phi-4-mini-instruct: stored qkv_proj and gate_up_proj, partial RoPE
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "pad_token_id": 199999,
}
GEMMA3_4B = {  # google/gemma-3-4b-pt's text model: GeGLU (tanh), 5 sliding-window layers to 1 global
    "vocab_size": 262208,
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b": ("Qwen3Config", QWEN3_8B),
    "llama-3.1-8b": ("LlamaConfig", LLAMA31_8B),
    "phi-4-mini": ("Phi3Config", PHI4_MINI),
    "gemma-3-4b": ("Gemma3TextConfig", GEMMA3_4B),
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
    parser.add_argument("--repeat", type=int, default=3, help="rounds of all variants, interleaved")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
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
    parser.add_argument(
        "--cold-caches",
        action="store_true",
        help="each child starts with empty Triton and inductor caches (load_s, first_step_s: a first run)",
    )
    parser.add_argument("--variant-child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (128 if args.tiny else 512)
    if args.variant_child:
        print(json.dumps(run_variant(args)), flush=True)
        return 0
    if args.finetune:
        return finetune(args)

    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model_dir = Path(args.model_cache) if args.model_cache else Path(tmp) / "model"
        ensure_model(args, model_dir, "qlora")
        if not variants:  # --variants '': only build the model (into --model-cache)
            return 0
        failed = interleaved_rounds(args, variants, lambda v: run_child(args, v, model_dir), summary, "qlora")
    return 1 if failed else 0


def ensure_model(args: argparse.Namespace, model_dir: Path, bench: str) -> None:
    """Build the random-weight model into ``model_dir`` unless its weights are there (config.json
    is written first, so it alone does not mean a finished build)."""
    if any((model_dir / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return
    started = time.perf_counter()
    shape = build_model(model_dir, args)
    print(json.dumps({"bench": bench, "event": "built", "shape": shape,
                      "seconds": round(time.perf_counter() - started, 1)}), flush=True)  # fmt: skip


def interleaved_rounds(
    args: argparse.Namespace, variants: list[str], run: Any, summarize: Any, bench: str
) -> int:
    """``--repeat`` rounds of every variant (each round starts one variant later), a JSON line per run
    (its ``profile`` on a line of its own), then a summary line per variant; returns the failures."""
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    failed = 0
    for round_ in range(args.repeat):
        for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
            row = run(variant)
            row["round"] = round_
            profile = row.pop("profile", None)
            print(json.dumps(row), flush=True)
            if profile is not None:
                print(json.dumps({"bench": bench, "profile": variant, "round": round_, **profile}))
            if "error" in row:
                failed += 1
            elif "skipped" not in row:
                rows[variant].append(row)
    for variant, done in rows.items():
        if done:
            print(json.dumps(summarize(variant, done)), flush=True)
    return failed


def run_child(
    args: argparse.Namespace, variant: str, model_dir: Path, *, script: str = __file__, bench: str = "qlora"
) -> dict[str, Any]:
    """Run one variant of ``script`` (this bench, or another that reuses it) in its own process."""
    if variant.startswith("unsloth") and importlib.util.find_spec("unsloth") is None:
        return {"bench": bench, "variant": variant, "skipped": "unsloth is not installed"}
    child = [
        sys.executable,
        script,
        *sys.argv[1:],
        "--variant-child",
        variant,
        "--model-dir",
        str(model_dir),
    ]
    env = None
    if getattr(args, "cold_caches", False):  # a first run's compile: no kernel cached by an earlier child
        fresh = Path(tempfile.mkdtemp(prefix="xpukit-bench-caches-"))
        env = dict(
            os.environ,
            TRITON_CACHE_DIR=str(fresh / "triton"),
            TORCHINDUCTOR_CACHE_DIR=str(fresh / "inductor"),
        )
    proc = subprocess.run(child, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {"bench": bench, "variant": variant, "error": " | ".join(tail)}
    return dict(json.loads(lines[-1]))


SUMMED = ("tokens_per_s", "peak_mem_gb", "activation_gb", "loss_first", "kernels_per_step")
KEPT = ("estimate_gb", "gradient_checkpointing", "liger", "fused", "micro_batch", "device", "mem_kind")


def summary(
    variant: str,
    rows: list[dict[str, Any]],
    *,
    bench: str = "qlora",
    summed: tuple[str, ...] = SUMMED,
    kept: tuple[str, ...] = KEPT,
) -> dict[str, Any]:
    """Median and spread over the rounds of one variant (``summed``), and the last round's ``kept``."""
    out: dict[str, Any] = {"bench": bench, "summary": variant, "rounds": len(rows)}
    for key in summed:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_range"] = [min(values), max(values)]
    for key in kept:
        out[key] = rows[-1].get(key)
    return out


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
    """Random bf16 weights of the chosen shape, saved with transformers (built on the device: fast).
    ``--tiny`` keeps the family of ``--shape`` at the tiny widths."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, full = SHAPES[args.shape]
    shape = {**full, **TINY} if args.tiny else dict(full)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.tiny and "pad_token_id" in shape:
        shape["pad_token_id"] = 0
    device = pick_device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        config = getattr(transformers, config_class)(**shape)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    return {"shape": args.shape, **shape}


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    variant = args.variant_child
    device = pick_device(args.device)
    facts = device_facts(device)
    dtype = "bfloat16" if device != "cpu" or facts.native_bf16 else "float32"
    load_started = time.perf_counter()
    if variant.startswith("unsloth"):
        model, notes, plan = load_unsloth(args, variant, dtype)
    elif variant == "recipe":
        model, notes, plan = load_recipe(args, facts, dtype)
    else:
        model, notes, plan = load_xpukit(args, variant, device, dtype)
    synchronize(device)
    load_s = time.perf_counter() - load_started  # the fused path's load-time check included
    check = check_seconds(device)
    weights_mem = memory_allocated(device)
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

    times, losses = [], []
    base = None
    first_step_s = None
    for step in range(args.warmup + args.steps):
        synchronize(device)
        if step == args.warmup:  # gradients and AdamW state exist: the peak above this is the step's
            reset_peak(device)
            base = current_memory(device)
        start = time.perf_counter()
        loss = train_step()
        synchronize(device)
        losses.append(loss)
        if step == 0:
            first_step_s = time.perf_counter() - start
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak, mem_kind = peak_memory(device)  # before the profiled steps, which hold the profiler's buffers
    # The graphs' pools are written by replays the allocator does not see (graph_pool_slack).
    slack = graph_pool_slack(device)
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
        "peak_reserved_gb": round(reserved / 1e9, 3) if (reserved := peak_reserved(device)) else None,
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
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
        **({"profile": profile} if profile is not None else {}),
    }


def profile_steps(train_step: Any, device: str, steps: int) -> dict[str, Any]:
    """Run ``steps`` training steps under torch.profiler; per-step kernel count and time by category."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.XPU if device == "xpu" else ProfilerActivity.CUDA
    device_type = torch.autograd.DeviceType.XPU if device == "xpu" else torch.autograd.DeviceType.CUDA
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, activity]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            train_step()
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == device_type]
    by_name: dict[str, float] = {}
    intervals = []
    for event in kernels:
        us = event.time_range.elapsed_us()
        by_name[event.name] = by_name.get(event.name, 0.0) + us
        intervals.append((event.time_range.start, event.time_range.end))
    busy, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):  # the union of kernel intervals
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:30]
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall * 1e3 / steps, 2),
        "device_ms_per_step": round(sum(by_name.values()) / 1e3 / steps, 2),
        "gpu_busy_pct": round(100 * busy / 1e6 / wall, 1) if wall else None,
        "kernels_per_step": round(len(kernels) / steps),
        "ms_per_step_by_category": ms_per_step_by_category(by_name, steps),
        "top_kernels_ms_per_step": [[name[:120], round(us / 1e3 / steps, 2)] for name, us in top],
    }


def host_profile(train_step: Any, device: str, steps: int) -> list[list[Any]]:
    """cProfile over ``steps`` steps: the host's top functions, ``[name, own ms/step, calls/step,
    cumulative ms/step]``."""
    import cProfile
    import pstats

    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        train_step()
    synchronize(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}:{name}"
        per_step = [round(own * 1e3 / steps, 2), round(calls / steps), round(cum * 1e3 / steps, 2)]
        rows.append([where[-110:], *per_step])
    return sorted(rows, key=lambda r: -r[1])[:25]


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
        args.model_dir, dtype=getattr(torch, dtype), device_map=facts.torch_device,
        quantization_config=bnb_config(dtype),
    )  # fmt: skip
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    torch.manual_seed(0)  # the same LoRA initialisation in every variant
    model = get_peft_model(model, LoraConfig(**DEFAULT_LORA))
    return model, ["peft.prepare_model_for_kbit_training: non-4-bit weights upcast to float32"], None


def liger_chunks(chunk_mem_const: int) -> None:
    """liger-kernel's fused linear cross-entropy with a larger logits chunk, in this process.

    liger sizes its chunk of tokens so that the chunk's logits (chunk × vocab) are about ``c`` × the
    hidden states (tokens × hidden): ``next_pow2(tokens / ceil(vocab / (c · hidden)))``. With c = 1
    and a large vocabulary the chunk is small (Gemma-3-4B at 2 048 tokens: 32 tokens, 64 chunks),
    and each chunk's two products read the whole ``lm_head`` weight (docs/benchmarks.md "Other
    families"). xpukit now passes its own per call (docs/training.md "liger's loss chunk"); this
    fixed value replaces it, to try other chunk sizes."""
    import functools

    from liger_kernel.transformers import functional

    original = functional.liger_fused_linear_cross_entropy

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "chunk_mem_const": chunk_mem_const})

    functional.liger_fused_linear_cross_entropy = wrapped


CHECKS: dict[str, Any] = {}  # the fused path's load-time check: its first run's seconds, a rerun


def check_seconds(device: str) -> dict[str, Any] | None:
    """The load-time check's wall time in the load (its first run: the fused kernels compile there)
    and run again on the same model right after (kernels warm: the check's own work)."""
    if "again" not in CHECKS:
        return None
    synchronize(device)
    start = time.perf_counter()
    checks = CHECKS["again"]()
    synchronize(device)
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
            args.model_dir, device=device, dtype=dtype, quantize="4bit", lora=lora, seed=0,
            batch_size=args.batch, seq_len=args.seq, max_memory=max_memory,
        )  # fmt: skip

    from xpukit.loading.training import fused_lora

    if args.liger_chunk_mem_const:
        liger_chunks(args.liger_chunk_mem_const)
    rope_note = liger_rope(args.shape) if args.liger_rope else None
    if variant == "xpukit-nocheck":  # the check's own cost: the same load with a check of nothing
        fused_lora.check_blocks = lambda model, groups, dtype: []  # type: ignore[assignment]
    else:
        original = fused_lora.check_blocks

        def timed(model: Any, groups: Any, dtype: Any) -> Any:  # the check, timed; kept to run again
            synchronize(device)
            start = time.perf_counter()
            checks = original(model, groups, dtype)
            synchronize(device)
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


def liger_rope(shape: str) -> str:
    """liger-kernel's RoPE kernel in place of transformers' ``apply_rotary_pos_emb`` of the shape's
    modeling module, for this process (the bench loads one model a process). transformers' RoPE is
    a handful of elementwise kernels each way (``rotate_half``'s slice, neg and cat, two products and
    a sum), part of the elementwise time that separates xpukit's device time from unsloth's
    (docs/benchmarks.md "Other families"). liger's kernel infers a partial rotary width (Phi-3) from
    ``cos``."""
    import importlib

    import transformers
    from liger_kernel.transformers import liger_rotary_pos_emb

    config_class = getattr(transformers, SHAPES[shape][0])
    module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    module.apply_rotary_pos_emb = liger_rotary_pos_emb  # type: ignore[attr-defined]
    return f"(bench) liger-kernel's RoPE as {module.__name__}.apply_rotary_pos_emb in this process"


def chunked_loss_instead(model: Any, tokens: int) -> str:
    """xpukit's chunked cross-entropy at ``tokens`` a chunk in place of the plan's loss (a bench
    switch: liger's fused loss is an instance ``forward``, removed here; the chunk size is set
    through the module constant it is computed from)."""
    from xpukit.loading.training.chunked_loss import apply_chunked_loss
    from xpukit.planning.training import activation_memory

    base = model.get_base_model()
    base.__dict__.pop("forward", None)
    activation_memory.CHUNK_BYTES = tokens * 4 * int(base.lm_head.weight.shape[0])
    return "(bench) " + apply_chunked_loss(base)


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
        args.model_dir, max_seq_length=args.seq, dtype=getattr(torch, dtype), load_in_4bit=True,
        tokenizer_name=tokenizer,
    )  # fmt: skip
    torch.manual_seed(0)
    gc: Any = "unsloth" if variant == "unsloth" else False
    model = FastLanguageModel.get_peft_model(
        model, r=DEFAULT_LORA["r"], lora_alpha=DEFAULT_LORA["lora_alpha"],
        lora_dropout=DEFAULT_LORA["lora_dropout"], use_gradient_checkpointing=gc,
        target_modules=unsloth_targets(model),
    )  # fmt: skip
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
            print(json.dumps({
                "bench": "qlora-finetune", "round": round_, "lora_dropout": dropout, "fused": fused,
                "loss": loss_kind,
                "steps": steps,
                "loss_first": losses[0], "loss_last10_mean": round(statistics.mean(losses[-10:]), 4),
                "held_out_loss": round(held, 4), "tokens_per_s": round(tokens / seconds, 1),
                "seconds": round(seconds, 2), "losses": losses, "versions": versions(),
                "date": time.strftime("%Y-%m-%d"),
            }), flush=True)  # fmt: skip
    return 0


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


def reset_peak(device: str) -> None:
    """Start a new high-water mark (on the CPU: the process's VmHWM, via /proc/self/clear_refs)."""
    import torch

    if device == "cpu":
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return
    getattr(torch, device).reset_peak_memory_stats()


def current_memory(device: str) -> int | None:
    if device != "cpu":
        return memory_allocated(device)
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def peak_reserved(device: str) -> int | None:
    """``max_memory_reserved`` of a GPU since the last reset (``None`` on the CPU)."""
    if device == "cpu":
        return None
    import torch

    return int(getattr(torch, device).max_memory_reserved())


def peak_memory(device: str) -> tuple[int, str]:
    if device == "cpu":
        with contextlib.suppress(OSError), open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "cpu_rss_high_water_since_reset"
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_peak_rss"
    import torch

    return int(getattr(torch, device).max_memory_allocated()), f"{device}_max_memory_allocated"


def memory_pools(device: str) -> dict[str, dict[str, float]] | None:
    """CUDA: memory reserved and in use at the run's end, by allocator pool (the graphs' private
    pools apart from the default one), from ``torch.cuda.memory_snapshot``."""
    if device != "cuda":
        return None
    import torch

    pools: dict[str, dict[str, float]] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = segment.get("segment_pool_id", (0, 0))
        name = "default" if tuple(pool) == (0, 0) else f"graphs {tuple(pool)}"
        row = pools.setdefault(name, {"reserved": 0.0, "allocated": 0.0, "segments": 0})
        row["reserved"] += segment["total_size"] / 1e9
        row["allocated"] += segment["allocated_size"] / 1e9
        row["segments"] += 1
    return {k: {a: round(b, 3) for a, b in v.items()} for k, v in pools.items()}


def graph_pool_slack(device: str, pools: dict[str, dict[str, float]] | None = None) -> int:
    """Bytes the device graphs' private pools hold but the allocator counts as free: a replay writes
    its activations there without allocating, so ``max_memory_allocated`` after a capture misses
    them (0 without graphs, and off CUDA). ``pools``: :func:`memory_pools`' answer, if taken already."""
    pools = (pools if pools is not None else memory_pools(device)) or {}
    return int(sum(1e9 * (v["reserved"] - v["allocated"]) for k, v in pools.items() if k != "default"))


def versions() -> dict[str, str | None]:
    from xpukit._compat import installed_version

    names = ("torch", "transformers", "peft", "bitsandbytes", "liger-kernel", "triton", "unsloth", "trl")
    return {name: installed_version(name) for name in names}


if __name__ == "__main__":
    sys.exit(main())
