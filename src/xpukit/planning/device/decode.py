"""``fast_decode``: a static KV cache and compiled decoding, decided from the plan's facts.

Pure: the device, dtype, quantization, placement and the headroom's KV budget decide; nothing is read.
The rules and the measurements behind them are in docs/decode.md "Rules"; transformers' own
mechanism (``generation_config.cache_implementation="static"``, ``max_cache_len`` and
``compile_config``) does the work, :mod:`xpukit.loading.decode.fast_decode` sets it on the loaded model.

* ``fast_decode="auto"`` (the default): taken for quantized inference on a GPU, where plain
  ``generate`` over torchao weights measured slower than bf16 (docs/decode.md "Fast by default");
  every other load is left as ``fast_decode=False`` leaves it. ``True`` asks for it anywhere;
  ``"unfused"`` is ``True`` without the fused projections (docs/decode-kernels.md "Fused projections");
  ``"regional"`` is ``True`` with one decoder layer compiled for all of them instead of the whole
  step, compiled in the first call that needs it (docs/decode-kernels.md "Regional compilation"; never
  the default).
* Tiered (docs/decode.md "Tiered decoding"): the whole step's compile does not hold up the first
  ``generate()``: the uncompiled step serves (captured as one device graph on CUDA) while a thread
  compiles the step ahead of time, which then takes over between two tokens.
* The static cache holds ``max_cache_len`` tokens per sequence: the KV part of the headroom
  (headroom minus its weight share and runtime reserve, docs/planning.md) divided by the KV bytes of
  one token, capped by the model's context length, rounded down to a multiple of 256.
* Compiled decoding on CUDA and XPU (``mode="default"``), one device. On CUDA xpukit's loop captures
  the compiled step as one CUDA graph itself (docs/decode-internals.md "Own step graphs"); transformers' own
  ``generate`` (calls the loop does not serve) compiles with ``mode="reduce-overhead"``. On XPU
  nothing is captured (inductor's graph trees are CUDA-only, docs/decode.md "XPU").
* Quantized weights (docs/decode.md "Quantized models"): bitsandbytes — nothing changes (transformers
  does not compile it, and the static cache alone measured slower than plain ``generate``); torchao
  int4/int8 — compiled static-cache decoding on CUDA and XPU.
* CPU and MPS: nothing changes, and the decision says why (docs/decode.md "CPU measurements").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.budgets import HEADROOM_FIXED, HEADROOM_WEIGHT_FRACTION, DeviceMap, format_bytes
from xpukit.planning.device.decode_plan import DecodePlan, compile_settings
from xpukit.planning.device.decode_reasons import compiled_reason, sized_reason
from xpukit.planning.device.decode_weights import fusable, int8_patterns_off, weight_kernel, weights_label
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.machine.facts import DeviceFacts
    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.vocabulary import MemoryEstimate

__all__ = [
    "CACHE_LENGTH_STEP",
    "FAST_DECODE_VALUES",
    "GRAPH_BATCH_SIZES",
    "DecodePlan",
    "check_fast_decode",
    "compile_settings",
    "decide_decode",
    "plan_decode",
]

CACHE_LENGTH_STEP = 256  # max_cache_len is a multiple of this (docs/decode.md "Cache length")
# Batch sizes the warm-up compiles: each costs one compile (docs/decode-internals.md "Batch sizes").
GRAPH_BATCH_SIZES = (1,)
FAST_DECODE_VALUES = (True, False, "auto", "unfused", "regional")
# bitsandbytes' quantizers report is_compileable False in transformers 5.22 (docs/decode.md
# "Quantized models"): generate() skips compilation for them.
_NOT_COMPILED_QUANT = {"4bit", "8bit"}
_GPU = {"cuda", "xpu"}
# Measured on the H200, Qwen3-8B shape, batch 1 (docs/benchmarks.md "Quantized weights", docs/decode.md
# "Fast by default"): what "auto" is decided on, and what the first compile costs.
_AUTO_EVIDENCE = (
    "on the H200 (Qwen3-8B shape, batch 1) torchao int4 ran 13 tokens/s with plain generate() against "
    "253 with fast_decode, int8 13.3 against 190 (xpukit's int8 kernel), bf16 plain 23"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Ask:
    """How ``fast_decode`` was asked: the reasons' first words, the decision's source when had."""

    lead: str
    source: str
    fuse: bool
    regional: bool = False


def check_fast_decode(value: object) -> bool | str:
    """``fast_decode`` is ``True``, ``False``, ``"auto"``, ``"unfused"`` or ``"regional"``; anything
    else is refused before anything is read.

    Raises:
        InvalidRequestError: another value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"auto", "unfused", "regional"}:
        return value.strip().lower()
    raise InvalidRequestError(
        f"fast_decode={value!r}: expected True, False, 'auto' (the default: taken for quantized inference "
        "on a GPU), 'unfused' (True without fused projections) or 'regional' (True with one decoder "
        "layer compiled for all of them). Fix: fast_decode=True."
    )


def decide_decode(
    fast_decode: bool | str,
    *,
    serving: bool,
    chosen_format: bool,
    device: DeviceFacts,
    dtype: str,
    memory: MemoryEstimate,
    facts: ModelFacts,
    quantization: str | None,
    device_map: DeviceMap | None,
    quantization_config: dict[str, Any] | None = None,
) -> tuple[DecodePlan | None, Decision | None]:
    """``fast_decode`` as asked: ``False`` and an ``"auto"`` that does not apply give ``(None, None)``.

    Args:
        fast_decode: the checked argument (:func:`check_fast_decode`).
        serving: loaded to run (no adapters, no distributed strategy).
        chosen_format: the quantization is the format xpukit chose for ``quantize="4bit"``/``"8bit"``/
            ``"auto"`` (or recorded in the checkpoint), not a config the user gave.
        device, dtype, memory, facts, quantization, device_map, quantization_config: as
            :func:`plan_decode`.
    """
    if fast_decode is False:
        return None, None
    if fast_decode == "auto":
        if not _auto_applies(serving, chosen_format, device.backend, quantization):
            return None, None
        ask = _Ask(
            lead=f"quantized weights to run on {device.backend}, so fast_decode by default "
            f"({_AUTO_EVIDENCE}; fast_decode=False opts out)",
            source="auto",
            fuse=True,
        )
    else:
        ask = _Ask(
            lead=f"fast_decode={fast_decode!r} given",
            source="user",
            fuse=fast_decode in (True, "regional"),
            regional=fast_decode == "regional",
        )
    return _plan(
        ask,
        device=device,
        dtype=dtype,
        memory=memory,
        facts=facts,
        quantization=quantization,
        device_map=device_map,
        quantization_config=quantization_config,
    )


def plan_decode(
    *,
    device: DeviceFacts,
    dtype: str,
    memory: MemoryEstimate,
    facts: ModelFacts,
    quantization: str | None,
    device_map: DeviceMap | None,
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
    return _plan(
        _Ask(lead="fast_decode=True given", source="user", fuse=True),
        device=device,
        dtype=dtype,
        memory=memory,
        facts=facts,
        quantization=quantization,
        device_map=device_map,
        quantization_config=quantization_config,
    )


def _auto_applies(serving: bool, chosen_format: bool, backend: str, quantization: str | None) -> bool:
    """``"auto"`` takes the fast path for xpukit's torchao formats loaded to run on a GPU only."""
    return serving and chosen_format and backend in _GPU and quantization == "torchao"


def _plan(
    ask: _Ask,
    *,
    device: DeviceFacts,
    dtype: str,
    memory: MemoryEstimate,
    facts: ModelFacts,
    quantization: str | None,
    device_map: DeviceMap | None,
    quantization_config: dict[str, Any] | None,
) -> tuple[DecodePlan, Decision]:
    """The rules in order: the device, the weights, the cache's size, the placement, then compiled."""
    backend = device.backend
    refused = _device_refuses(backend) or _quantized_not_faster(quantization)
    if refused is not None:  # what happens first: the short explain and the load's log show that
        return _off(f"{refused} ({ask.lead})")
    length, why_none = _cache_length(dtype, memory, facts)
    if length == 0:
        return _off(f"{ask.lead}, but {why_none}")
    per_token = (facts.kv_bytes_per_token or 0) * (2 if dtype == "float32" else 1)
    kv_bytes = length * per_token
    sized = sized_reason(length, kv_bytes, why_none, memory.weights)
    no_compile = _why_not_compiled(device_map)
    if no_compile is not None:
        plan = DecodePlan(
            static_cache=True, max_cache_len=length, compile=False, compile_mode=None, kv_bytes=kv_bytes
        )
        return plan, Decision(
            name="fast_decode",
            value=plan.describe(),
            reason=f"{ask.lead}: {sized}; not compiled: {no_compile}",
            rejected=(("compiled decoding", no_compile),),
            source="fallback",
        )
    plan = DecodePlan(
        static_cache=True,
        max_cache_len=length,
        compile=True,
        compile_mode="reduce-overhead" if backend == "cuda" else "default",
        kv_bytes=kv_bytes,
        graph_batch_sizes=GRAPH_BATCH_SIZES,
        grouped_attention=backend == "cuda",
        step_graph=backend == "cuda",
        inductor_patterns=not int8_patterns_off(backend, quantization_config),
        fused_projections=ask.fuse and fusable(quantization, quantization_config),
        weights=weights_label(dtype, quantization_config),
        regional=ask.regional,
        weight_kernel=weight_kernel(backend, quantization, quantization_config),
        tiered=not ask.regional,
    )
    return plan, Decision(
        name="fast_decode",
        value=plan.describe(),
        reason=f"{ask.lead}: {sized}; {compiled_reason(plan, backend)}",
        source=ask.source,  # type: ignore[arg-type]
    )


def _device_refuses(backend: str) -> str | None:
    if backend == "cpu":
        return (
            "nothing changes on the CPU: compiling the decoding step took 53-352 s and was not reliably "
            'faster, nor was a static cache alone (docs/decode.md "CPU measurements")'
        )
    if backend == "mps":
        return (
            "nothing changes on MPS: transformers' generate() compiles only on cuda/xpu, and a static "
            'cache was not measured on MPS (docs/decode.md "Rules")'
        )
    return None


def _quantized_not_faster(quantization: str | None) -> str | None:
    """Why fast decoding over these quantized weights would not beat plain ``generate``, else ``None``."""
    if quantization in _NOT_COMPILED_QUANT:
        return (
            f"nothing changes with bitsandbytes {quantization} weights: transformers' generate() "
            "does not compile them, and a static cache without compiling measured slower than plain "
            "and larger (4-bit Qwen3-8B shape on an H200: 12.7 tokens/s in 10.32 GB against 19.0 in 6.12 GB, "
            'docs/decode.md "Quantized models")'
        )
    return None


def _cache_length(dtype: str, memory: MemoryEstimate, facts: ModelFacts) -> tuple[int, str]:
    """The static cache's tokens per sequence (0: none) and, with it, the KV budget it came from or
    why there is none."""
    per_token = facts.kv_bytes_per_token
    if not per_token:
        return 0, "the config lacks the attention shape, so a static cache cannot be sized"
    per_token *= 2 if dtype == "float32" else 1
    budget = memory.headroom - int(memory.weights * HEADROOM_WEIGHT_FRACTION) - HEADROOM_FIXED
    tokens = max(budget, 0) // per_token
    if facts.max_positions:
        tokens = min(tokens, facts.max_positions)
    length = tokens // CACHE_LENGTH_STEP * CACHE_LENGTH_STEP
    if length == 0:
        return 0, (
            f"the headroom leaves {format_bytes(max(budget, 0))} for the KV cache, under "
            f"{CACHE_LENGTH_STEP} tokens ({format_bytes(per_token)} each). Fix: a larger headroom=."
        )
    return length, format_bytes(budget)


def _why_not_compiled(device_map: DeviceMap | None) -> str | None:
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
