"""Carrying out ``fast_decode=True``: the generation config of the loaded model, and the warm-up.

What :func:`xpukit.planning.device.decode.plan_decode` decided is set on ``model.generation_config``, so
every later ``generate()`` — and ``pipeline()``, which copies that config — uses transformers' own
static cache and compiled decoding (docs/decode.md "How it works"):

* ``cache_implementation="static"`` and ``max_cache_len`` (the cache is allocated once at that
  length, so the compiled decoding step keeps its shapes whatever the prompt length);
* ``compile_config=CompileConfig(fullgraph=True, dynamic=False, mode=...)`` when compiled, else
  ``disable_compile=True`` so that generate() does not compile with its own defaults;
* ``warmup=True``: one short greedy generation at load, twice (the first compiles, the second shows
  the steady cost), recorded as a ``LoadEvent``. A compile failure there turns compilation off for
  this model and is recorded as a fallback.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.vocabulary import LoadEvent

__all__ = ["WARMUP_NEW_TOKENS", "WARMUP_PROMPT_TOKENS", "apply_fast_decode", "generation_model", "warm_up"]

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 8
WARMUP_NEW_TOKENS = 8


def generation_model(model: Any) -> Any:
    """The model that owns ``generation_config`` (the base model under a ``PeftModel``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def apply_fast_decode(model: Any, plan: LoadPlan) -> list[LoadEvent]:
    """Set the plan's static cache and compile settings on the model's generation config.

    Args:
        model: the loaded model (a ``PeftModel`` is unwrapped to its base model).
        plan: the plan being carried out; its ``decode`` says what to set.

    Returns:
        The load events: ``applied fast_decode`` with the settings, or a fallback when the model
        has no generation config (not a generative model class).
    """
    decode = plan.decode
    if decode is None:
        return []
    target = generation_model(model)
    config = getattr(target, "generation_config", None)
    if config is None or not hasattr(target, "generate"):
        cause = f"{type(target).__name__} has no generation_config: it does not generate"
        logger.warning("fast_decode not applied: %s", cause)
        return [
            LoadEvent(
                kind="fallback", what="fast_decode", planned=decode.describe(), actual=None, cause=cause
            )
        ]
    if not decode.static_cache:
        return [LoadEvent(kind="note", what="fast_decode", actual="generation config unchanged")]
    from transformers import CompileConfig

    from xpukit.planning.device.decode import compile_settings

    config.cache_implementation = "static"
    config.max_cache_len = decode.max_cache_len
    settings: dict[str, Any] = {
        "cache_implementation": "static",
        "max_cache_len": decode.max_cache_len,
    }
    if decode.compile and decode.compile_mode is not None:
        kwargs = compile_settings(decode.compile_mode)
        config.compile_config = CompileConfig(**kwargs)
        config.disable_compile = False
        settings["compile_config"] = kwargs
    else:
        config.disable_compile = True
        settings["disable_compile"] = True
    return [LoadEvent(kind="applied", what="fast_decode", actual=settings)]


def warm_up(model: Any, plan: LoadPlan) -> list[LoadEvent]:
    """Run one short greedy generation twice, at batch 1, and record how long each took.

    The first call compiles the decoding step when the plan compiles; later calls of the same batch
    size and a prompt that fits ``max_cache_len`` reuse it (docs/decode.md "Recompilation").

    Args:
        model: the loaded model, after :func:`apply_fast_decode`.
        plan: the plan being carried out.

    Returns:
        ``applied warmup`` with the two durations in seconds and whether a compiled step exists, or
        a ``fallback`` when compiling failed (compilation is then disabled for this model).
    """
    import torch

    target = generation_model(model)
    config = getattr(target, "generation_config", None)
    if config is None:
        return []
    vocab = int(getattr(target.config.get_text_config(), "vocab_size", 0) or 2)
    token = config.bos_token_id if isinstance(config.bos_token_id, int) else 0
    ids = torch.full((1, WARMUP_PROMPT_TOKENS), min(token, vocab - 1), dtype=torch.long, device=target.device)
    kwargs: dict[str, Any] = {
        "max_new_tokens": WARMUP_NEW_TOKENS,
        "min_new_tokens": WARMUP_NEW_TOKENS,
        "do_sample": False,
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": config.pad_token_id if config.pad_token_id is not None else config.eos_token_id,
    }
    durations: list[float] = []
    try:
        for _ in range(2):
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, **kwargs)
            _synchronize(target.device)
            durations.append(round(time.perf_counter() - start, 3))
    except Exception as exc:
        if plan.decode is None or not plan.decode.compile or config.disable_compile:
            raise
        cause = f"{type(exc).__name__}: {exc}"
        logger.warning("Compiled decoding failed in the warm-up (%s); decoding uncompiled", cause)
        config.disable_compile = True
        config.compile_config = None
        return [
            LoadEvent(
                kind="fallback",
                what="fast_decode",
                planned=plan.decode.describe(),
                actual={"cache_implementation": "static", "disable_compile": True},
                cause=cause,
            )
        ]
    compiled = not config.disable_compile and hasattr(target, "_compiled_call")  # set by get_compiled_call
    return [
        LoadEvent(
            kind="applied",
            what="warmup",
            actual={"first_call_s": durations[0], "second_call_s": durations[1], "compiled": compiled},
            cause=f"{WARMUP_NEW_TOKENS} new tokens, {WARMUP_PROMPT_TOKENS}-token prompt, batch 1, greedy",
        )
    ]


def _synchronize(device: Any) -> None:
    import torch

    kind = getattr(device, "type", str(device))
    module = getattr(torch, kind, None)
    sync = getattr(module, "synchronize", None) if kind in {"cuda", "xpu", "mps"} else None
    if callable(sync):
        sync()
