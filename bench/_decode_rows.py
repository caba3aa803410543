"""``bench_decode.py``'s row parts beyond the harness: the bytes a model stores, the fast path a load
took (or why it has none), the variant's summary line, and the second process that measures a fresh
process's first call with the compile cache the first process filled (docs/decode-internals.md
"Compile cache").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h

# --second-process-quantize: the child's load (docs/decode.md "Fast by default"); "none" is bf16,
# which the default leaves plain, so that child asks for fast_decode=True (no warm-up either).
# "4bit-saved"/"8bit-saved": the child loads the checkpoint `xpukit export --quantize` wrote from the
# same weights (written by this process first, timed), so nothing is quantized at its load.
CHILD_LOADS: dict[str, dict[str, Any]] = {
    "none": {"fast_decode": True},
    "4bit": {"quantize": "4bit"},
    "8bit": {"quantize": "8bit"},
    "4bit-saved": {},
    "8bit-saved": {},
}
# The variants whose run fills the compile cache a child reads (the same weights, fused the same
# way, same cache length); the child runs right after the first of them in --variants.
CHILD_SOURCES = {"none": ("fast",), "4bit": ("int4", "int4-fast"), "8bit": ("int8", "int8-fast")}
CHILD_SOURCES |= {"4bit-saved": CHILD_SOURCES["4bit"], "8bit-saved": CHILD_SOURCES["8bit"]}
NO_PLAN = (
    "no fast_decode decision: fast_decode=False, or 'auto' where the plan does not take it "
    "(bf16, bitsandbytes, the CPU, MPS)"
)


def cache_len(args: argparse.Namespace, path: Path) -> int:
    """The static cache length of the 'static', 'compiled' and 'loop' variants."""
    from xpukit.planning.device.decode import CACHE_LENGTH_STEP
    from xpukit.planning.plan import plan_load

    if args.cache_len:
        return int(args.cache_len)
    decode = plan_load(path, device=args.device, fast_decode=True).decode
    if decode is not None and decode.max_cache_len:
        return decode.max_cache_len
    return -(-(args.prompt_len + args.new_tokens) // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP


def wait_compiled(model: Any, limit_s: float) -> float | None:
    """Tiered: wait (at most ``limit_s``) until the compiled steps being built are ready, so that the
    timed calls measure the compiled tier; the seconds waited, or ``None`` for an untiered load."""
    loop = getattr(model, "xpukit_decode_loop", None)
    if loop is None or not loop.tiered:
        return None
    start = time.perf_counter()
    loop.tiers.wait(limit_s)
    return round(time.perf_counter() - start, 2)


def stored_bytes(tensor: Any) -> int:
    """Bytes a tensor stores: a tensor subclass (torchao's quantized weights) counts its inner tensors."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return int(tensor.numel() * tensor.element_size())


def prompt(batch: int, length: int, vocab: int) -> Any:
    import torch

    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def step_graph_stats(model: Any) -> dict[str, int] | None:
    """xpukit's own decode-step graphs: captures, replays, dropped (None where the loop has none)."""
    graphs = getattr(getattr(model, "xpukit_decode_loop", None), "step_graphs", None)
    return dict(graphs.stats) if graphs is not None else None


def fast_path(model: Any) -> str:
    """Which decoding the load set up, in words: xpukit's compiled loop (fused or not), transformers'
    compiled ``generate``, or none and why (on the CPU the plan's decision says nothing changes)."""
    plan = getattr(model, "xpukit_plan", None)
    events = {e.what: e for e in (plan.events if plan else [])}
    loop = getattr(model, "xpukit_decode_loop", None)
    if loop is not None and loop.enabled and loop.compile_options:
        fused = events.get("fused_projections")
        how = "fused q/k/v and gate/up" if fused is not None and fused.kind == "applied" else "unfused"
        return f"xpukit's compiled decode loop, {how}"
    config = model.generation_config
    if getattr(config, "compile_config", None) is not None and not getattr(config, "disable_compile", False):
        return "transformers' compiled generate (static cache)"
    decision = [d for d in plan.decisions if d.name == "fast_decode"] if plan else []
    return "none: " + (decision[0].reason if decision else NO_PLAN)


def cache_records(model: Any, batch: int | None = None) -> list[dict[str, Any]] | None:
    """What xpukit's compile cache did for the loop's graphs (of ``batch``): loaded, saved, errors."""
    loop = getattr(model, "xpukit_decode_loop", None)
    if loop is None or not loop.compile_options:
        return None
    return [r for r in loop.cache_records if batch is None or r.get("batch") == batch]


def peak_gb(device: str) -> float | None:
    """The peak since the last :func:`_harness.reset_peak`: allocated on a GPU, resident on the CPU."""
    peak, _ = h.peak_memory(device)
    return round(peak / 1e9, 3)


def summary_row(variant: str, rows: list[dict[str, Any]], skipped: list[int]) -> dict[str, Any]:
    """One line per variant: tok/s and first-call seconds by batch size, peak memory, the fast path."""
    by_batch = lambda key: {str(r["batch"]): r[key] for r in rows}  # noqa: E731
    last = rows[-1] if rows else {}
    ramp = (rows[0].get("speed_ramp") if rows else None) or {}
    return {
        "summary": variant,
        **{k: ramp.get(k) for k in ("first_token_s", "first_tokens_tok_s", "full_speed_s", "prefill_tok_s")},
        "tok_s": by_batch("tok_s"),
        "tok_s_median": by_batch("tok_s_median"),
        "first_call_s": by_batch("first_call_s"),
        "first_call_over_timed_s": by_batch("first_call_over_timed_s"),
        "peak_memory_gb": max((r["peak_memory_gb"] for r in rows if r["peak_memory_gb"]), default=None),
        "load_s": last.get("load_s"),
        "quantization": last.get("quantization"),
        "fast_path": last.get("fast_path"),
        "batches_skipped": skipped,
    }


def second_process(
    args: argparse.Namespace, script: str, path: Path, root: Path, quantize: str | None
) -> dict[str, Any]:
    """Run ``script`` as a fresh process on ``path``: its own empty inductor and Triton caches, the
    same ``XPUKIT_CACHE_DIR`` (so only xpukit's compile cache can make it warm). ``quantize``: a
    ``--second-process-quantize`` choice (no warm-up, the first ``generate`` timed), or ``None`` for
    ``--second-process`` (bf16, ``fast_decode=True, warmup=True``)."""
    name = f"second-process-{quantize}" if quantize else "fast-second-process"
    caches = root / name
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=str(caches / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
    )
    saved: dict[str, Any] = {}
    if quantize is not None and quantize.endswith("-saved"):
        path, saved = write_saved(path, caches / "saved", quantize.removesuffix("-saved"))
    command = [sys.executable, script, "--child", str(path), "--device", args.device]
    command += [f"--new-tokens={args.new_tokens}", f"--prompt-len={args.prompt_len}"]
    command += [f"--batch={b}" for b in args.batch or [1, 8]]
    command += [f"--child-quantize={quantize}"] if quantize else []
    command += [f"--threads={args.threads}"] if args.threads else []
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    row: dict[str, Any] = {"variant": name, "process_s": round(time.perf_counter() - start, 2)} | saved
    row["xpukit_cache_dir"] = os.environ.get("XPUKIT_CACHE_DIR", "xpukit's default (docs/env.md)")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        row["error"] = (done.stderr or done.stdout)[-2000:]
        return row
    child = json.loads(lines[-1])
    return row | {k: v for k, v in child.items() if k not in {"bench", "date", "machine", "versions"}}


def write_saved(path: Path, out: Path, kind: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``xpukit export --quantize`` writes from ``path`` for this machine's family."""
    from xpukit.loading.save_quantized import save_quantized

    start = time.perf_counter()
    result = save_quantized(path, out, quantize=kind)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return out, {
        "saved_write_s": round(time.perf_counter() - start, 2),
        "saved_gb": round(size / 1e9, 3),
        "saved_format": (result.quantized or {}).get("format"),
    }


def child_row(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """The second process: load (``--child-quantize``'s load without warm-up, else bf16 with
    ``fast_decode=True, warmup=True``), then per batch size a first call and one more call."""
    from xpukit.loading.load import load_for_xpu

    quantize = args.child_quantize
    kwargs = CHILD_LOADS[quantize] if quantize else {"fast_decode": True, "warmup": True}
    h.reset_peak(args.device)
    start = time.perf_counter()
    model = load_for_xpu(args.child, device=args.device, **kwargs)
    loaded = time.perf_counter() - start
    warmup = next((e.actual for e in model.xpukit_plan.events if e.what == "warmup"), None)
    first_calls, tok_s, tiers = {}, {}, {}
    loop = getattr(model, "xpukit_decode_loop", None)
    vocab = model.config.get_text_config().vocab_size
    first_token = round(
        h.timed_generate(model, prompt(1, args.prompt_len, vocab).to(args.device), 1, args.device)[0], 3
    )
    for batch in args.batch or [1, 8]:
        ids = prompt(batch, args.prompt_len, vocab).to(args.device)
        first_calls[str(batch)] = round(h.timed_generate(model, ids, args.new_tokens, args.device)[0], 3)
        tiers[str(batch)] = (getattr(model, "xpukit_last_decode", None) or {}).get("tiers")
        waiting = time.perf_counter()
        if loop is not None and loop.tiered:  # the saved step loads on a thread: wait, then time it
            loop.tiers.wait(600)
        tiers[f"{batch}_ready_after_s"] = round(time.perf_counter() - waiting, 2)
        again = h.timed_generate(model, ids, args.new_tokens, args.device)[0]
        tok_s[str(batch)] = round(batch * args.new_tokens / again, 2)
    return {
        "load_kwargs": kwargs,
        "startup_s": round(start - started, 2),
        "load_s" if quantize else "load_and_warmup_s": round(loaded, 2),
        "warmup": warmup,
        "first_token_s": first_token,  # a one-token call right after the load
        "start_to_first_token_s": round(start - started + loaded + first_token, 2),
        "first_call_s": first_calls,
        "first_call_tiers": tiers,
        "tok_s": tok_s,
        "fast_path": fast_path(model),
        "quantization": model.xpukit_plan.decision("quantization").value,
        "compile_cache": cache_records(model),
        "peak_memory_gb": peak_gb(args.device),
        "counters": h.dynamo_counters(),
    }


def time_to_speed(model: Any, vocab: int, args: argparse.Namespace, loaded_at: float) -> dict[str, Any]:
    """A fresh load's first calls at batch 1 (docs/decode.md "Tiered decoding"): the first token
    (a one-token call), the first ``--new-tokens`` tokens, then calls of that length until one is
    served by the compiled step alone twice in a row (or ``--full-speed-s`` passes): each call's start
    after the load, tok/s and tokens per tier; ``full_speed_s`` is when the second of those two began
    (the first may still warm up and capture the compiled step, or compile it, untiered).
    Then the prefill of a ``--prefill-len``-token prompt (a one-token call, best of 2)."""
    ids = prompt(1, args.prompt_len, vocab).to(args.device)
    first_token_s, _ = h.timed_generate(model, ids, 1, args.device)
    calls: list[dict[str, Any]] = []
    full_speed_s = None
    while True:
        began = time.perf_counter() - loaded_at
        seconds, _ = h.timed_generate(model, ids, args.new_tokens, args.device)
        tiers = (getattr(model, "xpukit_last_decode", None) or {}).get("tiers")
        compiled = not tiers or set(tiers) <= {"prefill", "compiled"}
        calls.append({"at_s": round(began, 2), "tok_s": round(args.new_tokens / seconds, 2), "tiers": tiers})
        calls[-1]["compiled"] = compiled
        if compiled and len(calls) > 1 and calls[-2]["compiled"]:
            full_speed_s = calls[-1]["at_s"]
            break
        if began > args.full_speed_s:
            break
    row = {
        "first_token_s": round(first_token_s, 3),
        "first_tokens_tok_s": calls[0]["tok_s"],
        "first_tokens_tiers": calls[0]["tiers"],
        "full_speed_s": full_speed_s,
        "calls": calls,
    }
    length = min(args.prefill_len, int(getattr(model.config, "max_position_embeddings", 0) or 0) - 8)
    cache = getattr(model.generation_config, "max_cache_len", None)
    if cache:
        length = min(length, int(cache) - 8)
    if length > 0:
        long = prompt(1, length, vocab).to(args.device)
        best = min(h.timed_generate(model, long, 1, args.device)[0] for _ in range(2))
        row.update(prefill_tokens=length, prefill_s=round(best, 4), prefill_tok_s=round(length / best, 1))
    return row
