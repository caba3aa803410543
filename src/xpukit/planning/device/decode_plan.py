"""What ``fast_decode`` sets: the :class:`DecodePlan` the decision holds (:mod:`.decode` decides it),
and the ``torch.compile`` settings xpukit compiles the decoding step with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DecodePlan", "compile_settings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodePlan:
    """What ``fast_decode`` sets on the model's ``generation_config`` and loop.

    Attributes:
        static_cache: set ``cache_implementation="static"``.
        max_cache_len: tokens per sequence the static cache holds (``None`` without a static cache).
        compile: set ``compile_config`` (else ``disable_compile=True``, so nothing compiles behind
            the plan's back).
        compile_mode: the ``torch.compile`` mode (``reduce-overhead`` or ``default``), or ``None``.
        kv_bytes: KV-cache bytes of ``max_cache_len`` tokens at batch 1 (0 without a static cache).
        graph_batch_sizes: batch sizes whose decode step the warm-up compiles (CUDA: captures as
            CUDA graphs); any other batch size compiles on its first call (docs/decode-internals.md
            "Batch sizes").
        grouped_attention: a model that runs SDPA with fewer key/value heads than query heads gets
            xpukit's grouped decode attention (docs/decode-internals.md "Grouped decode attention").
        step_graph: xpukit's loop compiles its step without graphs and captures it as one device
            graph itself (docs/decode-internals.md "Own step graphs").
        inductor_patterns: ``False`` compiles the loop's step with inductor's pattern matcher off
            (torchao int8 on CUDA: docs/decode.md "Quantized models").
        fused_projections: q/k/v and gate/up become one product each at load (docs/decode-kernels.md
            "Fused projections").
        weights: the weights' format as the compile cache keys it (``bfloat16``, the torchao label).
        regional: xpukit's loop compiles one decoder layer and runs its code for every layer, the
            rest of the step eager, all of it captured as one step graph on CUDA (docs/decode-kernels.md
            "Regional compilation").
        weight_kernel: xpukit's weight-only product serves the decode step's quantized products
            (``int8``), or ``""`` (docs/decode-kernels.md "Weight-only products").
        tiered: the first ``generate()`` decodes at once with the uncompiled step (captured as one
            device graph with ``step_graph``, else eager) while a thread compiles the step, which
            takes over between two tokens (docs/decode.md "Tiered decoding").
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
    fused_projections: bool = False
    weights: str = ""
    regional: bool = False
    weight_kernel: str = ""
    tiered: bool = False

    def generation_compile_options(self) -> dict[str, Any] | None:
        """The ``CompileConfig`` keyword arguments for the generation config (``None``: nothing
        compiles, ``disable_compile=True``)."""
        if not self.compile or self.compile_mode is None:
            return None
        return compile_settings(self.compile_mode)

    def loop_compile_options(self) -> dict[str, Any] | None:
        """The ``torch.compile`` keyword arguments of xpukit's loop (``None``: eager). Its own step
        graph needs inductor's graphs off (mode ``default``), and so do regional layers (one set of
        graphs per layer's weights)."""
        if not self.compile or self.compile_mode is None:
            return None
        mode = "default" if self.step_graph or self.regional else self.compile_mode
        return compile_settings(mode, patterns=self.inductor_patterns)

    def describe(self) -> dict[str, Any]:
        """The decision's value: what changes in the generation config."""
        if not self.static_cache:
            return {"static_cache": False, "compile": False}
        value: dict[str, Any] = {
            "static_cache": True,
            "max_cache_len": self.max_cache_len,
            "compile": self.compile_mode if self.compile else False,
        }
        if self.regional and self.compile:
            value["regional"] = True
        if self.tiered and self.compile:
            value["tiers"] = ["graph" if self.step_graph else "eager", "compiled"]
        if self.weight_kernel:
            value["weight_kernel"] = self.weight_kernel
        return value


def compile_settings(mode: str, *, patterns: bool = True) -> dict[str, Any]:
    """The ``CompileConfig`` keyword arguments xpukit uses (docs/decode-internals.md "Compile settings");
    ``patterns=False`` (mode ``default`` only) turns inductor's pattern matcher off."""
    if patterns:
        return {"fullgraph": True, "dynamic": False, "mode": mode}
    if mode != "default":
        raise ValueError(
            f"inductor options cannot go with mode {mode!r} (torch.compile takes one of the two)"
        )
    return {"fullgraph": True, "dynamic": False, "options": {"pattern_matcher": False}}
