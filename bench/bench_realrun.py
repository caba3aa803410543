"""QLoRA as users run it: ``Trainer`` / TRL's ``SFTTrainer`` over examples of different lengths.

The headline benchmark (docs/benchmarks.md "Real runs"). A Qwen3-8B-shaped model (``--shape`` for
bench_qlora's other families) with random weights (built once from a config, nothing downloaded),
nf4 + LoRA r=16 on every linear layer, bf16; a dataset of random token ids whose lengths follow a
chat-like distribution:

    chat       log-normal, median 256 tokens, clipped to [32, 1024]
    longtail   log-normal, median 384 tokens, wider, clipped to [32, 2048]
    uniform    uniform in [64, 512] tokens
    fixed      every example 512 tokens (the fixed-shape step, for reference)

Each variant trains ``--steps`` optimizer steps of ``--batch`` examples in its own process (so peak
memory is its own and unsloth's patches cannot leak), with the collator its trainer uses: an ordinary
padding collator for ``Trainer`` (``DataCollatorForLanguageModeling``: pads to the longest example,
``attention_mask``, labels -100 on padding) and TRL's own for ``SFTTrainer``. Variants:

    xpukit             load_for_xpu(quantize="4bit", lora=True, batch_size=, seq_len=) +
                       training_args(model, ...) + transformers.Trainer
    xpukit-sft         the same through TRL's SFTTrainer (training_args(config_class=SFTConfig))
    xpukit-nopack      xpukit with lora={"packing": False}: the padded batches as the collator made them
    xpukit-mask        xpukit with attn="sdpa" given: packed rows through SDPA's mask instead of varlen_attn
    xpukit-eager       xpukit with lora={"graphs": False}: what the graphs of the layers give
    xpukit-liger       xpukit with lora={"liger": True}: liger's fused loss (memory) instead of the plain one
    xpukit-adamw       xpukit with optim="adamw_torch_fused" instead of the plan's paged 8-bit AdamW
    xpukit-gc-graphs   lora={"gradient_checkpointing": True, "graphs": True}: checkpointed inside the graphs
    xpukit-offload-graphs  lora={"gradient_checkpointing": "offload", "graphs": True}: inputs in host slots
    xpukit-lean        xpukit, a bucket captured only once it recurs (capture_on_recurrence)
    xpukit-b512        xpukit with the packed row padded to a multiple of 512 tokens (fewer shapes)
    xpukit-nosync      xpukit, captures after the first not waiting for the device (settle = False)
    xpukit-paged       xpukit with optim="paged_adamw_8bit" (the plan's optimizer under a budget to 12-04)
    xpukit-filter      xpukit with transformers' logging_nan_inf_filter=True (Trainer waits for each loss)
    xpukit-warm1       xpukit with a warm-up pass before every capture (as before 2026-12-04)
    xpukit-nonblocking xpukit with accelerator_config={"non_blocking": True} (batches copied without a wait)
    xpukit-ordinary    xpukit with PYTORCH_ALLOC_CONF=expandable_segments:False (which the plan keeps)
    xpukit-expandable  the same with :True from the process's start, as unsloth sets it at its import
    unsloth            unsloth's FastLanguageModel (its checkpointing, "unsloth") + TRL's SFTTrainer,
                       unsloth's recommended set-up (it turns padding-free batches on for text SFT)
    unsloth-nogc       the same with unsloth's checkpointing off (its fastest setting, more memory)
    unsloth-trainer    unsloth + transformers.Trainer with the padding collator
    unsloth-trainer-nogc  the same with unsloth's checkpointing off

With a budget list the unsloth set-ups run once each (they take no budget) and every xpukit row is
compared with the fastest unsloth set-up whose reserved peak fits its budget: a ``versus`` line per
xpukit row with the ratio of the interleaved rounds (median and range), the first-20-steps ratio, the
peer chosen and every peer's tokens/s (bench/_peers.py ``against_fastest_peer``). ``--data`` takes a
comma-separated list too (``uniform,longtail``): each data set is its own run of the whole thing.

Reported per variant and round (one JSON line): non-padding tokens/s over the steps after ``--warmup``,
the step time's median and spread (each step's end is an event on the device's timeline,
``_clock.StepClock``: the benchmark never makes the host wait for the device mid-run), peak memory from
the first step on (on a GPU ``max_memory_reserved``, what the process held: a replay of the layer graphs
writes its activations into their pool unseen by ``max_memory_allocated``, which is reported beside it),
the loss per step, and for xpukit the packing and graph counters (``model.xpukit_packing.stats``,
``model.xpukit_layer_graphs.stats``). Rounds interleave the variants (``--repeat``); the summary gives
medians and ranges. ``--max-memory 8GB`` gives xpukit that budget (unsloth has none: its checkpointing
is its memory setting); a list (``--max-memory 8GB,10GB,12GB,none``) runs every variant at every budget,
the rows named ``variant@budget``. ``tokens_per_s_first20`` is a short run's figure: every non-padding
token of the first 20 steps over the time from the start of training to the end of step 20 (captures,
warm-up and all), as a notebook run of 20 steps sees it.

Usage::

    python bench/bench_realrun.py --tiny --steps 6            # any device, a tiny shape (CPU check)
    python bench/bench_realrun.py --data chat --repeat 3      # CUDA / XPU, Qwen3-8B shape
    python bench/bench_realrun.py --data chat --max-memory 8GB --variants xpukit,unsloth
    python bench/bench_realrun.py --shape gemma-3-4b --variants xpukit,unsloth-nogc
    python bench/bench_realrun.py --data uniform --variants xpukit --profile-captures 25  # capture host time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h  # bench/_harness.py, beside this script: devices, memory, rounds, rows
from _capture_profile import CaptureProfile
from _clock import StepClock
from _data import DATA, as_dataset, dataset, summarize_files, summary, with_data
from _peers import UNSLOTH_SETUPS, against_fastest_peer, budget_bytes, load_unsloth
from _shapes import SHAPES, build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = (
    "xpukit",
    "xpukit-sft",
    "xpukit-nopack",
    "xpukit-mask",
    "xpukit-eager",
    "xpukit-liger",
    "xpukit-adamw",
    "xpukit-gc-graphs",
    "xpukit-offload-graphs",
    "xpukit-lean",
    "xpukit-b512",
    "xpukit-warm1",
    "xpukit-nosync",
    "xpukit-paged",
    "xpukit-filter",
    "xpukit-expandable",
    "xpukit-ordinary",
    "xpukit-nonblocking",
    *UNSLOTH_SETUPS,
)
# load_for_xpu keywords of the xpukit variants beside the one call (lora=True by default).
XPUKIT_LOAD: dict[str, dict[str, Any]] = {
    "xpukit-nopack": {"lora": {"packing": False}},
    "xpukit-mask": {"attn": "sdpa"},  # the plan's packed_attention is then "mask"
    "xpukit-eager": {"lora": {"graphs": False}},
    "xpukit-liger": {"lora": {"liger": True}},
    "xpukit-gc-graphs": {"lora": {"gradient_checkpointing": True, "graphs": True}},
    "xpukit-offload-graphs": {"lora": {"gradient_checkpointing": "offload", "graphs": True}},
}
# Attributes the graph variants set on the loaded model: (model attribute, name) -> value.
XPUKIT_GRAPHS: dict[str, dict[tuple[str, str], Any]] = {
    "xpukit-warm1": {("xpukit_layer_graphs", "warmups"): 1},
    "xpukit-lean": {("xpukit_layer_graphs", "warmups"): 0, ("xpukit_packing", "capture_on_recurrence"): True},
    "xpukit-b512": {("xpukit_layer_graphs", "warmups"): 0, ("xpukit_packing", "bucket"): 512},
    "xpukit-nosync": {("xpukit_layer_graphs", "settle"): False},
}
# The child's environment before torch's allocator starts (read at the device's first allocation).
XPUKIT_ENV = {
    "xpukit-expandable": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
    "xpukit-ordinary": {"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
}
PLAN_SHOWN = "gradient_checkpointing loss fused_lora layer_graphs packing packed_attention input_embedding "
PLAN_SHOWN += "expandable_segments"
XPUKIT_ARGS: dict[str, dict[str, Any]] = {
    "xpukit-adamw": {"optim": "adamw_torch_fused"},
    "xpukit-paged": {"optim": "paged_adamw_8bit"},
    "xpukit-filter": {"logging_nan_inf_filter": True},
    "xpukit-nonblocking": {"accelerator_config": {"non_blocking": True}},
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny shape that runs on CPU in seconds")
    parser.add_argument(
        "--shape", default="qwen3-8b", choices=sorted(SHAPES), help="the model family and size"
    )
    parser.add_argument("--layers", type=int, help="override num_hidden_layers (keeps the widths)")
    parser.add_argument("--data", default="chat", help=f"one of {sorted(DATA)}, or a comma-separated list")
    parser.add_argument("--batch", type=int, default=4, help="examples per optimizer step")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per variant and round")
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed")
    parser.add_argument("--log-every", type=int, default=5, help="logging_steps (each log syncs the device)")
    h.add_variant_arguments(parser, VARIANTS)
    parser.add_argument(
        "--max-memory",
        help="xpukit's device budget, e.g. 8GB; a comma-separated list runs each (none: no budget)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile the last N steps (torch.profiler): the device's busy share, kernels, device ms a step",
    )
    parser.add_argument("--profile-captures", type=int, default=0, help="cProfile the captures: top N")
    parser.add_argument(
        "--trace",
        help="with --profile-steps: write each profiled run's trace here (VARIANT.json.gz, chrome://tracing)",
    )
    parser.add_argument("--device", help="cuda, xpu or cpu (default: the first available)")
    parser.add_argument("--first-round", type=int, default=0, help="the first round's number (runs split up)")
    parser.add_argument(
        "--summarize",
        nargs="+",
        metavar="ROWS",
        help="only the summaries and versus lines of the JSON rows in these files (rounds run apart)",
    )
    parser.add_argument("--workdir", help="where the random model is written (default: a temp dir)")
    parser.add_argument("--model-cache", help="reuse (or build once into) this model directory")
    parser.add_argument("--tokenizer", help="a small local tokenizer (default: the demo model's)")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the timed steps start after it)")
    if not set(args.data.split(",")) <= set(DATA):
        parser.error(f"--data {args.data!r}: choose from {', '.join(sorted(DATA))}")
    if args.variant_child:
        h.emit(run_variant(args))
        return 0
    if args.summarize:
        return summarize_files(args.summarize)
    variants = h.chosen_variants(parser, args.variants, VARIANTS)
    budgets = [b for b in (args.max_memory or "").split(",") if b]
    if budgets:  # every xpukit variant at every budget, interleaved: rows named variant@budget
        peers = [v for v in variants if v.startswith("unsloth")]  # no budget: each runs once
        variants = [f"{v}@{b}" for b in budgets for v in variants if v not in peers] + peers
    compare = lambda rows: against_fastest_peer(rows, "realrun")  # noqa: E731
    status = 0
    argv = list(sys.argv)
    for data in args.data.split(","):
        args.data, sys.argv = data, with_data(argv, data)  # the children read sys.argv
        status |= h.rounds_of_children(
            args,
            variants,
            script=__file__,
            bench="realrun",
            summarize=summary,
            build=build_model,
            compare=compare,
        )
    return status


def write_trace(prof: Any, path: Path) -> None:
    """The profiler's chrome trace of the profiled steps, gzipped (the host's ops and the device's kernels
    on one timeline: where the device waits and what the host does meanwhile)."""
    import gzip
    import shutil

    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_suffix("")
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()


class Counting:
    """A data collator wrapper that counts each batch's real (non-padding) tokens."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.tokens: list[int] = []

    def __call__(self, features: Any) -> Any:
        batch = self.collate(features)
        mask = batch.get("attention_mask")
        self.tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    args.variant_child, _, budget = args.variant_child.partition("@")
    if budget or "," in (args.max_memory or ""):  # a peer among several budgets runs once, unbudgeted
        args.max_memory = None if budget in ("none", "") else budget
    os.environ.update(XPUKIT_ENV.get(args.variant_child, {}))
    if args.variant_child.startswith("unsloth"):
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
        import unsloth  # noqa: F401  (before transformers, as unsloth requires)
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, TrainerCallback

    device = h.pick_device(args.device)
    variant = args.variant_child
    dtype = "bfloat16" if device != "cpu" else "float32"
    tok_dir = args.tokenizer
    if tok_dir is None:
        from xpukit.demo.tiny import demo_model_dir

        tok_dir = str(demo_model_dir())
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    scale = 0.25 if args.tiny else 1.0
    n = args.batch * args.steps
    data = dataset(args.data, n, config["vocab_size"], seed=0, scale=scale)
    longest = max(len(d["input_ids"]) for d in data)
    out_dir = tempfile.mkdtemp(prefix="realrun-")
    common = dict(
        output_dir=out_dir,
        max_steps=args.steps,
        logging_steps=args.log_every,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        learning_rate=2e-4,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    plan: Any = None
    host_profile: CaptureProfile | None = None
    if variant.startswith("xpukit"):
        from xpukit import load_for_xpu, training_args

        budget = {0 if device != "cpu" else "cpu": args.max_memory} if args.max_memory else None
        load = {"batch_size": args.batch, "seq_len": longest, "max_memory": budget, "lora": True}
        load |= XPUKIT_LOAD.get(variant, {})
        model = load_for_xpu(args.model_dir, device=device, dtype=dtype, quantize="4bit", seed=0, **load)
        plan = model.xpukit_plan
        host_profile = CaptureProfile.installed(args.profile_captures) if args.profile_captures else None
        if getattr(model, "xpukit_layer_graphs", None) is not None:  # the graph switches of the variant
            for (attribute, name), value in XPUKIT_GRAPHS.get(variant, {}).items():
                setattr(getattr(model, attribute), name, value)
        if variant == "xpukit-sft":
            from trl import SFTConfig

            targs = training_args(model, config_class=SFTConfig, max_length=None, **common)
        else:
            targs = training_args(model, **common, **XPUKIT_ARGS.get(variant, {}))
    else:
        args.seq = longest  # unsloth's max_seq_length
        trainer_kind, checkpointing = UNSLOTH_SETUPS[variant]
        model = load_unsloth(args, "unsloth" if checkpointing else "unsloth-nogc", dtype)[0]
        if trainer_kind == "sft":
            from trl import SFTConfig

            targs = SFTConfig(
                per_device_train_batch_size=args.batch, bf16=dtype == "bfloat16", max_length=None, **common
            )
        else:
            from transformers import TrainingArguments

            targs = TrainingArguments(
                per_device_train_batch_size=args.batch, bf16=dtype == "bfloat16", **common
            )
    micro = targs.per_device_train_batch_size
    accumulate = targs.gradient_accumulation_steps
    clock: Any = None  # a StepClock, made just before training starts
    captures: list[int] = []  # graphs captured so far, at each step's end
    graphs = getattr(model, "xpukit_layer_graphs", None)

    profiled: dict[str, Any] = {}
    profile_from = args.steps - args.profile_steps if args.profile_steps and device != "cpu" else None

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if profile_from is not None and len(clock) == profile_from:
                from torch.profiler import ProfilerActivity, profile

                kind = ProfilerActivity.XPU if device == "xpu" else ProfilerActivity.CUDA
                h.synchronize(device)  # the window starts on an idle device (its steps are not timed)
                profiled["prof"] = profile(activities=[ProfilerActivity.CPU, kind])
                profiled["prof"].start()
                profiled["start"] = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.mark()  # no wait for the device: the host runs ahead as in a user's run
            captures.append(graphs.stats["captures"] if graphs is not None else 0)
            if "prof" in profiled and len(clock) == args.steps:
                from _kernels import profile_summary

                h.synchronize(device)
                wall = time.perf_counter() - profiled["start"]
                profiled["prof"].stop()
                if args.trace:
                    write_trace(profiled["prof"], Path(args.trace) / f"{variant.replace('@', '-')}.json.gz")
                profiled["summary"] = profile_summary(profiled.pop("prof"), wall, args.profile_steps, device)

    if variant == "xpukit-sft" or UNSLOTH_SETUPS.get(variant, ("",))[0] == "sft":
        from trl import SFTTrainer

        trainer = SFTTrainer(model=model, args=targs, train_dataset=as_dataset(data), processing_class=tok)
    else:
        from transformers import Trainer

        collator = DataCollatorForLanguageModeling(tok, mlm=False)
        trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collator)
    counting = Counting(trainer.data_collator)
    trainer.data_collator = counting
    trainer.add_callback(Clock())
    h.synchronize(device)
    h.reset_peak(device)
    clock = StepClock(device)
    started = clock.started
    trainer.train()
    times = clock.times()
    if profile_from is not None:  # the profiled steps run slower: the timed figures leave them out
        times, captures = times[:profile_from], captures[:profile_from]
    first = min(20, len(times))  # a short run's view: the first 20 steps, captures and warm-up included
    per_step = [sum(counting.tokens[i * accumulate : (i + 1) * accumulate]) for i in range(len(times))]
    timed = slice(args.warmup, len(times))
    steps = [b - a for a, b in zip(times[args.warmup - 1 : -1], times[args.warmup :], strict=True)]
    # Steady state: the timed steps that captured no new graph (a capture is paid once per shape).
    steady = [k for k in range(args.warmup, len(times)) if captures[k] == captures[k - 1]]
    steady_time = sum(times[k] - times[k - 1] for k in steady)
    # On a GPU the peak is what the process held from the allocator (reserved): a replay of the layer
    # graphs writes its activations into the graphs' pool unseen by the allocated count, and the
    # pool stays reserved. Allocated and the pool's unallocated part are reported beside it.
    allocated, _ = h.peak_memory(device)
    reserved = h.peak_reserved(device)
    peak = reserved if reserved is not None else allocated
    pools = h.memory_pools(device)
    slack = h.graph_pool_slack(device, pools)
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    row: dict[str, Any] = {
        "bench": "realrun",
        "variant": variant,
        "data": args.data,
        "device": device,
        "tokens_per_s": round(sum(per_step[timed]) / sum(steps), 1) if steps else None,
        "tokens_per_s_steady": round(sum(per_step[k] for k in steady) / steady_time, 1) if steady else None,
        "tokens_per_s_first20": round(sum(per_step[:first]) / (times[first - 1] - started), 1)
        if first
        else None,
        "captures": captures[-1] if captures else 0,
        "captures_timed": captures[-1] - captures[args.warmup - 1] if captures else 0,
        "step_ms_median": round(1000 * statistics.median(steps), 1) if steps else None,
        "step_ms_range": [round(1000 * min(steps), 1), round(1000 * max(steps), 1)] if steps else None,
        "real_tokens_per_step": round(statistics.mean(per_step), 1),
        "real_tokens_max_micro_batch": max(counting.tokens) if counting.tokens else None,
        "memory_pools_gb": pools,
        "peak_mem_gb": round(peak / 1e9, 2),
        "peak_allocated_gb": round(allocated / 1e9, 2),
        "graph_pool_slack_gb": round(slack / 1e9, 2),
        "seconds": round(time.perf_counter() - started, 1),
        "micro_batch": micro,
        "accumulation": accumulate,
        "losses": losses,
        "loss_last": losses[-1] if losses else None,
        "max_memory": args.max_memory,
        "budget_kept": reserved <= (budget_bytes(args.max_memory) or reserved)
        if reserved is not None and args.max_memory
        else None,
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "versions": h.versions(),
        "date": h.today(),
    }
    if "summary" in profiled:
        row["profile"] = profiled["summary"]
    row["capture_profile"] = host_profile.summary() if host_profile is not None else None
    if plan is not None and plan.training is not None:
        row["pass_tokens"] = plan.training.pass_tokens
        row["split_by_tokens"] = plan.training.split_by_tokens
    if plan is not None:
        row["plan"] = {d.name: str(d.value) for d in plan.decisions if d.name in PLAN_SHOWN.split()}
    for attr, key in (("xpukit_packing", "packing"), ("xpukit_layer_graphs", "graphs")):
        counters = getattr(model, attr, None)
        if counters is not None:
            row[key] = dict(counters.stats)
            extra = getattr(counters, "eager_reasons", None) or getattr(counters, "passed", None)
            row[f"{key}_other"] = dict(extra or {})
    if graphs is not None and hasattr(graphs, "record"):  # captures, their cost, the pool per shape
        row["graph_captures"] = graphs.record()
    rope = getattr(getattr(model, "xpukit_layer_graphs", None), "rope", None)
    if rope is not None:
        row["graphs_rope"] = rope.note
    del trainer, model
    return row


if __name__ == "__main__":
    sys.exit(main())
