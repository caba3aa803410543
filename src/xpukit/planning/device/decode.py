"""``fast_decode=True``: a static KV cache and compiled decoding, decided from the plan's facts.

Pure: the device, dtype, quantization, placement and the headroom's KV budget decide; nothing is read.
The rules and the measurements behind them are in docs/decode.md "Rules"; transformers' own
mechanism (``generation_config.cache_implementation="static"``, ``max_cache_len`` and
``compile_config``) does the work, :mod:`xpukit.loading.decode.fast_decode` sets it on the loaded model.

* The static cache holds ``max_cache_len`` tokens per sequence: the KV part of the headroom
  (headroom minus its weight share and runtime reserve, docs/planning.md) divided by the KV bytes of
  one token, capped by the model's context length, rounded down to a multiple of 256.
* Compiled decoding on CUDA and XPU (``mode="default"``), one device. On CUDA xpukit's loop captures
  the compiled step as one CUDA graph itself (docs/decode.md "Own step graphs"); transformers' own
  ``generate`` (calls the loop does not serve) compiles with ``mode="reduce-overhead"``. On XPU
  nothing is captured (inductor's graph trees are CUDA-only, docs/decode.md "XPU").
* Quantized weights (docs/decode.md "Quantized models"): bitsandbytes — nothing changes (transformers
  does not compile it, and the static cache alone measured slower than plain ``generate``); torchao
  int4/int8 — compiled static-cache decoding on CUDA only, where it is the path torchao's own figures
  are measured on; elsewhere nothing changes until it is measured.
* CPU and MPS: nothing changes, and the decision says why (docs/decode.md "CPU measurements").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.budgets import HEADROOM_FIXED, HEADROOM_WEIGHT_FRACTION, format_bytes
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.machine.facts import DeviceFacts
    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.vocabulary import MemoryEstimate

__all__ = [
    "CACHE_LENGTH_STEP",
    "GRAPH_BATCH_SIZES",
    "DecodePlan",
    "check_fast_decode",
    "compile_settings",
    "plan_decode",
]

CACHE_LENGTH_STEP = 256  # max_cache_len is a multiple of this (docs/decode.md "Cache length")
# Batch sizes the warm-up compiles: each costs one compile (docs/decode.md "Batch sizes").
GRAPH_BATCH_SIZES = (1,)
# bitsandbytes' quantizers report is_compileable False in transformers 5.22 (docs/decode.md
# "Quantized models"): generate() skips compilation for them.
_NOT_COMPILED_QUANT = {"4bit", "8bit"}
# Where compiled static-cache decoding over torchao weights is taken (docs/decode.md "Quantized models").
_TORCHAO_FAST_BACKENDS = {"cuda"}


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodePlan:
    """What ``fast_decode=True`` sets on the model's ``generation_config``.

    Attributes:
        static_cache: set ``cache_implementation="static"``.
        max_cache_len: tokens per sequence the static cache holds (``None`` without a static cache).
        compile: set ``compile_config`` (else ``disable_compile=True``, so nothing compiles behind
            the plan's back).
        compile_mode: the ``torch.compile`` mode (``reduce-overhead`` or ``default``), or ``None``.
        kv_bytes: KV-cache bytes of ``max_cache_len`` tokens at batch 1 (0 without a static cache).
        graph_batch_sizes: batch sizes whose decode step the warm-up compiles (CUDA: captures as
            CUDA graphs); any other batch size compiles on its first call (docs/decode.md
            "Batch sizes").
        grouped_attention: a model that runs SDPA with fewer key/value heads than query heads gets
            xpukit's grouped decode attention (docs/decode.md "Grouped decode attention").
        step_graph: xpukit's loop compiles its step without graphs and captures it as one device
            graph itself (docs/decode.md "Own step graphs").
        inductor_patterns: ``False`` compiles the loop's step with inductor's pattern matcher off
            (torchao int8 on CUDA: docs/decode.md "Quantized models").
    """

    static_cache: bool
    max_cache_len: int | None
    compile: bool
    compile_mode: str | None
    kv_bytes: int = 0
    graph_batch_sizes: tuple[int, ...] = ()
    grouped_attention: bool = False
    step_graph: bool = False
    inductor_patterns: bool = True

    def loop_compile_options(self) -> dict[str, Any] | None:
        """The ``torch.compile`` keyword arguments of xpukit's loop (``None``: eager). Its own step
        graph needs inductor's graphs off (mode ``default``)."""
        if not self.compile or self.compile_mode is None:
            return None
        mode = "default" if self.step_graph else self.compile_mode
        return compile_settings(mode, patterns=self.inductor_patterns)

    def describe(self) -> dict[str, Any]:
        """The decision's value: what changes in the generation config."""
        if not self.static_cache:
            return {"static_cache": False, "compile": False}
        return {
            "static_cache": True,
            "max_cache_len": self.max_cache_len,
            "compile": self.compile_mode if self.compile else False,
        }


def check_fast_decode(value: Any) -> bool:
    """``fast_decode`` is a bool; anything else is refused before anything is read.

    Raises:
        InvalidRequestError: not ``True`` / ``False``.
    """
    if isinstance(value, bool):
        return value
    raise InvalidRequestError(
        f"fast_decode={value!r}: expected True or False (there is no 'auto': the compile warm-up "
        "costs tens of seconds, so it is asked for). Fix: fast_decode=True."
    )


def compile_settings(mode: str, *, patterns: bool = True) -> dict[str, Any]:
    """The ``CompileConfig`` keyword arguments xpukit uses (docs/decode.md "Compile settings");
    ``patterns=False`` (mode ``default`` only) turns inductor's pattern matcher off."""
    if patterns:
        return {"fullgraph": True, "dynamic": False, "mode": mode}
    if mode != "default":
        raise ValueError(
            f"inductor options cannot go with mode {mode!r} (torch.compile takes one of the two)"
        )
    return {"fullgraph": True, "dynamic": False, "options": {"pattern_matcher": False}}


def plan_decode(
    *,
    device: DeviceFacts,
    dtype: str,
    memory: MemoryEstimate,
    facts: ModelFacts,
    quantization: str | None,
    device_map: Any,
    quantization_config: dict[str, Any] | None = None,
) -> tuple[DecodePlan, Decision]:
    """Decide the static cache length and whether decoding is compiled (``fast_decode=True``).

    Args:
        device: the plan's main device.
        dtype: the plan's dtype (the KV cache's dtype).
        memory: the plan's memory estimate (its headroom sizes the cache).
        facts: the model's facts (KV bytes per token, context length).
        quantization: the plan's quantization (``4bit``, ``8bit``, another method, or ``None``).
        device_map: the plan's device_map (compiled decoding needs the whole model on one device).
        quantization_config: the torchao config xpukit chose, if any (its int8 weights on CUDA
            compile with inductor's pattern matcher off).

    Returns:
        The :class:`DecodePlan` and its ``fast_decode`` :class:`Decision` (``source="user"`` when
        everything asked for is had, ``"fallback"`` when part is not, with the reason).
    """
    backend = device.backend
    if backend == "cpu":
        return _off(
            "asked, but nothing changes on the CPU: compiling the decoding step took 53-352 s and was "
            'not reliably faster, nor was a static cache alone (docs/decode.md "CPU measurements")'
        )
    if backend == "mps":
        return _off(
            "asked, but nothing changes on MPS: transformers' generate() compiles only on cuda/xpu, and "
            'a static cache was not measured on MPS (docs/decode.md "Rules")'
        )
    not_faster = _quantized_not_faster(backend, quantization)
    if not_faster is not None:
        return _off(not_faster)
    per_token = facts.kv_bytes_per_token
    if not per_token:
        return _off("asked, but the config lacks the attention shape, so a static cache cannot be sized")
    per_token *= 2 if dtype == "float32" else 1
    budget = memory.headroom - int(memory.weights * HEADROOM_WEIGHT_FRACTION) - HEADROOM_FIXED
    tokens = max(budget, 0) // per_token
    if facts.max_positions:
        tokens = min(tokens, facts.max_positions)
    length = tokens // CACHE_LENGTH_STEP * CACHE_LENGTH_STEP
    if length == 0:
        return _off(
            f"asked, but the headroom leaves {format_bytes(max(budget, 0))} for the KV cache, under "
            f"{CACHE_LENGTH_STEP} tokens ({format_bytes(per_token)} each). Fix: a larger headroom=."
        )
    kv_bytes = length * per_token
    sized = (
        f"static KV cache of {length} tokens per sequence ({format_bytes(kv_bytes)} at batch 1, "
        f"b times that at batch b; from the headroom's KV budget {format_bytes(budget)}); every step "
        f"attends over all of it, {kv_bytes / max(memory.weights, 1):.0%} of the weights' bytes at "
        'batch 1 (a shorter cache: docs/decode.md "Cache length")'
    )
    no_compile = _why_not_compiled(device_map)
    if no_compile is not None:
        plan = DecodePlan(
            static_cache=True, max_cache_len=length, compile=False, compile_mode=None, kv_bytes=kv_bytes
        )
        rejected = (("compiled decoding", no_compile),)
        return plan, Decision(
            name="fast_decode",
            value=plan.describe(),
            reason=f"fast_decode=True given: {sized}; not compiled: {no_compile}",
            rejected=rejected,
            source="fallback",
        )
    mode = "reduce-overhead" if backend == "cuda" else "default"
    graphs = (
        "xpukit's loop captures the step as one CUDA graph itself, one per attention window, and the "
        "prompt's prefill, one per prompt-length bucket (its compile mode default; "
        'transformers\' generate, where it runs, mode reduce-overhead: docs/decode.md "Own step graphs")'
        if backend == "cuda"
        else 'mode default (inductor\'s graph capture is CUDA-only: docs/decode.md "XPU")'
    )
    plan = DecodePlan(
        static_cache=True,
        max_cache_len=length,
        compile=True,
        compile_mode=mode,
        kv_bytes=kv_bytes,
        graph_batch_sizes=GRAPH_BATCH_SIZES,
        grouped_attention=backend == "cuda",
        step_graph=backend == "cuda",
        inductor_patterns=not _int8_patterns_off(backend, quantization_config),
    )
    extra = (
        "; a decode step's attention over grouped key/value heads without transformers' repeat_kv copy "
        '(docs/decode.md "Grouped decode attention")'
        if backend == "cuda"
        else ""
    )
    if not plan.inductor_patterns:
        extra += (
            "; inductor's pattern matcher off for the step: it rewrites torchao's int8 weight-only "
            "product into aten._weight_int8pack_mm, which read the weights at 0.15 TB/s on an H200 "
            '(15.9 against 81.3 tokens/s without it: docs/decode.md "Quantized models")'
        )
    sizes = ", ".join(str(b) for b in GRAPH_BATCH_SIZES)
    return plan, Decision(
        name="fast_decode",
        value=plan.describe(),
        reason=f"fast_decode=True given: {sized}; decoding step compiled (fullgraph, static shapes "
        "but the attention window's length, "
        f"{graphs}), by the warm-up at batch {sizes}, other batch sizes on first use{extra}",
        source="user",
    )


def _quantized_not_faster(backend: str, quantization: str | None) -> str | None:
    """Why fast decoding over these quantized weights would not beat plain ``generate``, else ``None``."""
    if quantization in _NOT_COMPILED_QUANT:
        return (
            f"asked, but nothing changes with bitsandbytes {quantization} weights: transformers' generate() "
            "does not compile them, and a static cache without compiling measured slower than plain "
            "and larger (4-bit Qwen3-8B shape on an H200: 12.7 tokens/s in 10.32 GB against 19.0 in 6.12 GB, "
            'docs/decode.md "Quantized models")'
        )
    if quantization == "torchao" and backend not in _TORCHAO_FAST_BACKENDS:
        return (
            f"asked, but nothing changes with torchao weights on {backend}: compiled decoding over them has "
            "figures only for CUDA (torchao's), so it is not taken where it was never measured to beat plain "
            'generate() (docs/decode.md "Quantized models")'
        )
    return None


def _int8_patterns_off(backend: str, config: dict[str, Any] | None) -> bool:
    """torchao int8 weight-only on CUDA: the pattern matcher's int8 rewrite is the slow kernel."""
    return backend == "cuda" and (config or {}).get("quant_type") == "Int8WeightOnlyConfig"


def _why_not_compiled(device_map: Any) -> str | None:
    devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
    devices = {str(d) for d in devices}
    if device_map is None or len(devices) > 1 or devices & {"cpu", "disk", "auto"}:  # None: FSDP sharding
        return (
            "the model is split over several devices or offloaded; generate() does not compile an "
            'offloaded model and graph capture needs one device (docs/decode.md "Rules")'
        )
    return None


def _off(reason: str) -> tuple[DecodePlan, Decision]:
    plan = DecodePlan(static_cache=False, max_cache_len=None, compile=False, compile_mode=None)
    return plan, Decision(name="fast_decode", value=plan.describe(), reason=reason, source="fallback")
