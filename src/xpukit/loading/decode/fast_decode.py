"""Carrying out ``fast_decode=True``: xpukit's decode loop, the generation config, and the warm-up.

With a static cache planned, the model's ``generate`` is served by xpukit's decode loop
(:mod:`xpukit.loading.decode.loop`) for the common cases; every other call goes to transformers'
``generate``, which gets what :func:`xpukit.planning.device.decode.plan_decode` decided through
``model.generation_config`` (``pipeline()`` copies that config) (docs/decode-internals.md "How it works"):

* ``cache_implementation="static"`` and ``max_cache_len`` (the cache is allocated once at that
  length, so the compiled decoding step keeps its shapes whatever the prompt length);
* ``compile_config=CompileConfig(fullgraph=True, dynamic=False, mode=...)`` when compiled, else
  ``disable_compile=True`` so that generate() does not compile with its own defaults;
* tiered (the plan's ``tiers``): the loop serves with the uncompiled step while a thread builds the
  compiled one (docs/decode.md "Tiered decoding"); a failed build after the load goes onto the
  model's plan as a ``decode_tiers`` fallback;
* ``warmup=True``: one short greedy generation at load, twice, at each of the plan's
  ``graph_batch_sizes`` (the first compiles, or tiered runs on the first tier while the warm-up
  then waits for the build; the second shows the steady cost), recorded as a ``LoadEvent`` with what
  the compile cache did. A compile failure there turns compilation off for this model and is
  recorded as a fallback.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.vocabulary import LoadEvent

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from xpukit.loading.decode.interfaces import LastDecode
    from xpukit.loading.decode.loop import DecodeLoop

__all__ = ["WARMUP_NEW_TOKENS", "WARMUP_PROMPT_TOKENS", "apply_fast_decode", "generation_model", "warm_up"]

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 8
WARMUP_NEW_TOKENS = 8


def generation_model(model: torch.nn.Module) -> PreTrainedModel:
    """The model that owns ``generation_config`` (the base model under a ``PeftModel``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def apply_fast_decode(model: torch.nn.Module, plan: LoadPlan) -> list[LoadEvent]:
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
    if not decode.static_cache:  # asked for, but nothing changes here (the CPU, MPS, bitsandbytes)
        decision = next((d for d in plan.decisions if d.name == "fast_decode"), None)
        why = decision.reason if decision is not None else "the plan keeps plain generate()"
        logger.warning("fast_decode changes nothing for this load: %s", why)
        return [LoadEvent(kind="note", what="fast_decode", actual=f"generation config unchanged: {why}")]
    from transformers import CompileConfig

    config.cache_implementation = "static"
    config.max_cache_len = decode.max_cache_len
    settings: dict[str, object] = {
        "cache_implementation": "static",
        "max_cache_len": decode.max_cache_len,
    }
    kwargs = decode.generation_compile_options()  # the plan's, as it says (no call back into planning)
    if kwargs is not None:
        config.compile_config = CompileConfig(**kwargs)
        config.disable_compile = False
        settings["compile_config"] = kwargs
    else:
        config.disable_compile = True
        settings["disable_compile"] = True
    from xpukit.loading.decode.install import install_decode_loop

    events: list[LoadEvent] = [LoadEvent(kind="applied", what="fast_decode", actual=settings)]
    fused = _fused_projections(target) if decode.fused_projections else None
    events += [fused] if fused is not None else []
    products = _weight_only_products(target, decode.weight_kernel) if decode.weight_kernel else None
    events += [products] if products is not None else []
    kernel = decode.weight_kernel if products is not None and products.kind == "applied" else ""
    options = decode.loop_compile_options()
    regional = _regional(target, decode.regional and options is not None)
    events += regional[1]
    loop = install_decode_loop(
        target,
        max_cache_len=int(decode.max_cache_len or 0),
        compile_options=options,
        step_graphs=decode.step_graph,
        cache_fields={
            "weights": decode.weights,
            "fused": fused is not None and fused.kind == "applied",
            "weight_kernel": kernel,
        },
        regional=regional[0],
        tiered=decode.tiered and options is not None and not regional[0],
    )
    loop.tiers.on_event = lambda event: _add_event(model, event)
    events += loop.tiers.events  # said while installing (a torch that cannot build the step ahead of time)
    loop_event = LoadEvent(
        kind="applied",
        what="decode_loop",
        actual={
            "compile": options,
            "step_graph": decode.step_graph,
            "graph_batch_sizes": list(decode.graph_batch_sizes),
            **({"regional": True} if regional[0] else {}),
            **({"tiers": [loop.first_tier, "compiled"]} if loop.tiered else {}),
        },
        cause="generate() runs xpukit's decode loop for greedy and plain sampling, transformers' "
        "for everything else; model.xpukit_last_decode says which ran",
    )
    events.append(loop_event)
    if decode.grouped_attention:
        events.append(_grouped_attention(target))
    return events


def _add_event(model: torch.nn.Module, event: LoadEvent) -> None:
    """An event of the loop after the load (the compiled tier's failure) onto ``model``'s plan."""
    plan = getattr(model, "xpukit_plan", None)
    if plan is not None:
        model.xpukit_plan = plan.with_events((event,))


def _regional(model: PreTrainedModel, asked: bool) -> tuple[bool, list[LoadEvent]]:
    """Whether the loop compiles per decoder layer, and a fallback event when asked but the model
    has no repeated decoder layers where xpukit looks (the whole step compiles instead)."""
    if not asked:
        return False, []
    from xpukit.loading.decode.regional import decoder_layers

    layers = decoder_layers(model)
    if layers:
        return True, []
    cause = (
        f"{type(model).__name__} has no list of decoder layers of one class with a self_attn.layer_idx "
        'under model.layers: the whole decode step compiles (docs/decode-kernels.md "Regional compilation")'
    )
    logger.warning("regional compilation not applied: %s", cause)
    event = LoadEvent(kind="fallback", what="regional_compile", planned=True, actual=False, cause=cause)
    return False, [event]


def _fused_projections(model: PreTrainedModel) -> LoadEvent:
    """q/k/v and gate/up fused into one product each (docs/decode-kernels.md "Fused projections")."""
    from xpukit.loading.decode.fused_proj import fuse_projections

    done = fuse_projections(model)
    fused = done["attention"] + done["mlp"]
    cause = "one product over one weight per group at each decode step"
    if "kept" in done:
        cause += "; kept apart: " + "; ".join(f"{n}x {why}" for why, n in done["kept"].items())
        logger.info("fused projections: %s", cause)
    if not fused:  # planned, not had: the weights allow no fusion (bitsandbytes, a packed format)
        return LoadEvent(kind="fallback", what="fused_projections", planned=True, actual=done, cause=cause)
    return LoadEvent(kind="applied", what="fused_projections", actual=done, cause=cause)


def _weight_only_products(model: PreTrainedModel, kernel: str) -> LoadEvent:
    """xpukit's weight-only products for the decode step (docs/decode-kernels.md "Weight-only products")."""
    from xpukit.loading.decode.woq_products import install_weight_only_products

    done = install_weight_only_products(model, kernel)
    if "kept" in done:
        logger.warning("xpukit's %s weight-only products not applied: %s", kernel, done["kept"])
        return LoadEvent(
            kind="fallback",
            what="weight_only_products",
            planned=kernel,
            actual=None,
            cause=f"{done['kept']}; torchao's own product serves every layer",
        )
    return LoadEvent(
        kind="applied",
        what="weight_only_products",
        actual={"kernel": kernel, **done},
        cause="a decode step's products of up to 16 rows read the quantized weights once, as stored",
    )


def _grouped_attention(model: PreTrainedModel) -> LoadEvent:
    """xpukit's grouped decode attention on ``model``, or the reason it keeps its own."""
    from xpukit.loading.decode.attention import NAME, use_grouped_decode_attention

    note = use_grouped_decode_attention(model)
    if note is not None:
        return LoadEvent(kind="applied", what="decode_attention", actual=NAME, cause=note)
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    return LoadEvent(
        kind="note",
        what="decode_attention",
        actual=current,
        cause=f"kept {current!r}: grouped decode attention applies to SDPA with fewer key/value heads "
        "than query heads",
    )


def warm_up(model: torch.nn.Module, plan: LoadPlan) -> list[LoadEvent]:
    """Run one short greedy generation twice, at batch 1, and record how long each took.

    The first call compiles the decoding step when the plan compiles; later calls of the same batch
    size and a prompt that fits ``max_cache_len`` reuse it (docs/decode-internals.md "Recompilation"). Tiered,
    the first call is the first tier's and the warm-up waits for the compiled step before the second
    (docs/decode.md "Tiered decoding").

    Args:
        model: the loaded model, after :func:`apply_fast_decode`.
        plan: the plan being carried out.

    Returns:
        ``applied warmup`` with the two durations in seconds and whether a compiled step exists, or
        a ``fallback`` when compiling failed (compilation is then disabled for this model).
    """
    target = generation_model(model)
    config = getattr(target, "generation_config", None)
    if config is None:
        return []
    loop: DecodeLoop | None = getattr(target, "xpukit_decode_loop", None)
    sizes = tuple(plan.decode.graph_batch_sizes) if plan.decode is not None else ()
    durations: dict[int, list[float]] = {}
    waited: dict[int, float] = {}  # tiered: seconds the warm-up waited for the compiled step
    seen = len(loop.tiers.events) if loop is not None else 0
    try:
        for batch in sizes or (1,):
            _warm_calls(model, target, batch, durations.setdefault(batch, []), waited)
    except Exception as exc:
        if plan.decode is None or not plan.decode.compile or config.disable_compile:
            raise
        cause = f"{type(exc).__name__}: {exc}"
        logger.warning("Compiled decoding failed in the warm-up (%s); decoding uncompiled", cause)
        config.disable_compile = True
        config.compile_config = None
        if loop is not None:
            loop.disable_compile()
        return [
            LoadEvent(
                kind="fallback",
                what="fast_decode",
                planned=plan.decode.describe(),
                actual={"cache_implementation": "static", "disable_compile": True},
                cause=cause,
            )
        ]
    if loop is not None:
        compiled = bool(loop.graphs) or (loop.tiered and loop.tiers.wait(0))
    else:
        compiled = not config.disable_compile and hasattr(target, "_compiled_call")  # get_compiled_call
    first = next(iter(durations.values()))
    actual: dict[str, object] = {"first_call_s": first[0], "second_call_s": first[1], "compiled": compiled}
    if len(durations) > 1:
        actual["per_batch"] = {str(b): d for b, d in durations.items()}
    if loop is not None:
        last: LastDecode | None = getattr(target, "xpukit_last_decode", None)
        actual["loop"] = last.get("loop") if last else None
        actual["compile_cache"] = list(loop.cache_records)
        if waited:
            tiers = last.get("tiers") if last else None
            actual.update(waited_for_compiled_s=next(iter(waited.values())), tiers=tiers)
    batches = ", ".join(str(b) for b in durations)
    done = LoadEvent(
        kind="applied",
        what="warmup",
        actual=actual,
        cause=f"{WARMUP_NEW_TOKENS} new tokens, {WARMUP_PROMPT_TOKENS}-token prompt, batch {batches}, greedy",
    )
    return [*(loop.tiers.events[seen:] if loop is not None else []), done]


def _warm_calls(
    model: torch.nn.Module,
    target: PreTrainedModel,
    batch: int,
    durations: list[float],
    waited: dict[int, float],
) -> None:
    """The warm-up's two greedy calls at ``batch``, timed into ``durations``; tiered, the wait for the
    compiled step between them into ``waited``."""
    import torch

    config = target.generation_config
    loop: DecodeLoop | None = getattr(target, "xpukit_decode_loop", None)
    vocab = int(getattr(target.config.get_text_config(), "vocab_size", 0) or 2)
    token = config.bos_token_id if isinstance(config.bos_token_id, int) else 0
    shape = (batch, WARMUP_PROMPT_TOKENS)
    ids = torch.full(shape, min(token, vocab - 1), dtype=torch.long, device=target.device)
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    kwargs: dict[str, object] = {
        "max_new_tokens": WARMUP_NEW_TOKENS,
        "min_new_tokens": WARMUP_NEW_TOKENS,
        "do_sample": False,
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": pad,
    }
    for call in range(2):
        if call == 1 and loop is not None and loop.tiered:  # the compiled tier serves the second
            start = time.perf_counter()
            loop.tiers.wait()
            waited[batch] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, **kwargs)
        _synchronize(target.device)
        durations.append(round(time.perf_counter() - start, 3))


def _synchronize(device: torch.device) -> None:
    import torch

    kind = getattr(device, "type", str(device))
    module = getattr(torch, kind, None)
    sync = getattr(module, "synchronize", None) if kind in {"cuda", "xpu", "mps"} else None
    if callable(sync):
        sync()
