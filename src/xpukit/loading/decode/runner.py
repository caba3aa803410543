"""The steps of xpukit's decode loop for one model: which step runs, with what, and how it is called.

:class:`StepRunner` is what :class:`xpukit.loading.decode.loop.DecodeLoop` builds on: the step a
call runs (:func:`~xpukit.loading.decode.step.decode_step` eager, compiled whole with
``torch.compile``, or per decoder layer: docs/decode-kernels.md "Regional compilation"), with the
compile cache's record of each compiled graph (:mod:`xpukit.loading.decode.compile_cache`); the
arguments of the prefill and of a step (a batch state's buffers, the attention window, the call's
constants); and the call itself, replayed from xpukit's own capture
(:class:`~xpukit.loading.decode.step_graph.StepGraphs`), marked for inductor's CUDA graphs, or run.
The loop's tiers (:mod:`xpukit.loading.decode.tiers`) hand their steps to the same call.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError
from xpukit.loading.decode import compile_cache
from xpukit.loading.decode.attention import NAME as GROUPED_ATTENTION
from xpukit.loading.decode.buckets import WINDOW_SMALLEST, window_length
from xpukit.loading.decode.regional import compile_layers, regional_step
from xpukit.loading.decode.step import decode_step, prefill_step
from xpukit.loading.decode.step_graph import StepGraphs
from xpukit.loading.device_graph import GraphBackend

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from xpukit.loading.decode.compile_cache import CompileRecord
    from xpukit.loading.decode.interfaces import DecodeModel, StepFn
    from xpukit.loading.decode.request import DecodeRequest
    from xpukit.loading.decode.state import DecodeState

__all__ = ["StepRunner", "step_name"]


def step_name(request: DecodeRequest) -> str:
    """The step kind a call runs (``greedy``, ``sample-k50-p``: the sampling settings that shape it)."""
    if not request.do_sample:
        return "greedy"
    return f"sample-k{request.top_k}" + ("-p" if request.top_p < 1.0 else "")


class StepRunner:
    """The steps of one model's decode loop.

    Attributes:
        compile_options: ``torch.compile`` keyword arguments of the step, or ``None`` (eager).
        cache_records: what the compile cache did, one record per compiled graph.
        graphs: the ``(batch, step)`` pairs compiled so far in this process.
        step_graphs: xpukit's own capture of the compiled step and the prefill
            (:class:`~xpukit.loading.decode.step_graph.StepGraphs`), or ``None``.
        window_smallest: cache slots of the smallest attention window (docs/decode-internals.md
            "Attention window"; a value at least the cache's length attends over the whole cache, for
            comparison).
        regional: compile one decoder layer and run its code for every layer, the rest of the step
            eager, instead of compiling the whole step (docs/decode-kernels.md "Regional compilation").
    """

    def __init__(
        self,
        model: DecodeModel,
        *,
        max_cache_len: int,
        compile_options: dict[str, object] | None = None,
        cache_dir: Path | None = None,
        cache_fields: Mapping[str, object] | None = None,
    ) -> None:
        self.model = model
        self.step_graphs: StepGraphs | None = None  # set_compile(..., step_graphs=True)
        self.regional = False  # set_compile(..., regional=True)
        self.max_cache_len = max_cache_len
        self.compile_options = compile_options
        self.cache_dir = cache_dir
        self.cache_fields = dict(cache_fields or {})  # what the model's load changed (fused weights)
        self.cache_records: list[CompileRecord] = []
        self.graphs: set[tuple[int, str]] = set()
        self.window_smallest = WINDOW_SMALLEST
        self._compiled: dict[bool, StepFn] = {}
        self._consts: dict[str, torch.Tensor] = {}
        self._keep_one = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def cudagraphs(self) -> bool:
        """Whether the step is captured as CUDA graphs (``mode="reduce-overhead"``)."""
        options = self.compile_options or {}
        return options.get("mode") == "reduce-overhead"

    def set_compile(
        self, options: dict[str, object] | None, *, step_graphs: bool = False, regional: bool = False
    ) -> None:
        """Compile the step with ``options`` from the next call on (``None``: eager); ``step_graphs``
        captures the step as one device graph (``options`` must then make no graphs); ``regional``
        compiles one decoder layer for all of them instead of the whole step."""
        if step_graphs and options and options.get("mode") == "reduce-overhead":
            raise InvalidRequestError(
                "step_graphs=True captures the compiled step itself: compile it without inductor's "
                'CUDA graphs (mode "default", not "reduce-overhead"; '
                'docs/decode-internals.md "Own step graphs")'
            )
        self.compile_options = options
        self.regional = regional and bool(options)
        self._compiled.clear()
        self.graphs.clear()
        device = self.model.device.type
        self.step_graphs = StepGraphs(GraphBackend(device)) if step_graphs and options else None

    def disable_compile(self) -> None:
        """Run the step eagerly from now on (a compile failure)."""
        self.compile_options = None
        self.step_graphs = None
        self.regional = False
        self._compiled.clear()

    def _compiles_now(self, request: DecodeRequest, batch: int) -> bool:
        return bool(self.compile_options) and (batch, step_name(request)) not in self.graphs

    def _compiling(self, request: DecodeRequest, batch: int) -> str:
        record = self.cache_records[-1] if self.cache_records else {}
        cached = "from the compile cache" if record.get("loaded") else "nothing in the compile cache"
        return f"compiling the decode step for batch {batch} ({step_name(request)}, {cached})"

    def _window(self, state: DecodeState, needed: int) -> torch.Tensor | None:
        """The attention window of a step or prefill when ``needed`` cache slots hold tokens, or
        ``None`` where the model's attention is not xpukit's (it would not read it)."""
        if getattr(self.model.config, "_attn_implementation", None) != GROUPED_ATTENTION:
            return None
        return state.window(window_length(needed, state.mask.shape[1], self.window_smallest))

    def _prefill(self, request: DecodeRequest, state: DecodeState, length: int, *, captured: bool) -> None:
        consts = self._consts
        window = self._window(state, length)

        def prefill() -> None:
            prefill_step(
                self.model,
                state.cache,
                state.prompt(length),
                state.mask,
                window,
                state.tokens,
                state.positions,
                state.unfinished,
                state.out,
                state.index,
                consts["is_eos"],
                consts["min_new"],
                consts["temperature"],
                self._top_p(request),
                request.do_sample,
                request.top_k,
                self._keep_one,
            )

        if self.step_graphs is None or not captured:  # (captured only with step graphs)
            prefill()
        else:
            self.step_graphs.run((state.owner, "prefill-" + step_name(request), length), prefill)

    def _call(
        self, step: StepFn, request: DecodeRequest, state: DecodeState, needed: int, tier: str = ""
    ) -> None:
        """One decode step whose token goes to cache slot ``needed - 1`` (``tier``: the first tier's
        captures are kept apart from the compiled step's)."""
        window = self._window(state, needed)
        if self.step_graphs is not None:
            kind = step_name(request) if tier in ("", "compiled") else f"{tier}-{step_name(request)}"
            key = (state.owner, kind, None if window is None else window.shape[1])
            self.step_graphs.run(key, lambda: self._step_once(step, request, state, window))
            return
        if self.cudagraphs:
            import torch

            torch.compiler.cudagraph_mark_step_begin()
        self._step_once(step, request, state, window)

    def _step_once(
        self, step: StepFn, request: DecodeRequest, state: DecodeState, window: torch.Tensor | None
    ) -> None:
        step(*self._step_args(request, state, window))

    def _step_args(
        self, request: DecodeRequest, state: DecodeState, window: torch.Tensor | None
    ) -> tuple[object, ...]:
        """The decode step's arguments: the loop's buffers of ``state``, the attention ``window``, the
        call's constants (the same for the step run, captured, or built ahead of time)."""
        consts = self._consts
        return (
            self.model,
            state.cache,
            state.tokens,
            state.positions,
            state.mask,
            window,
            state.unfinished,
            state.out,
            state.index,
            consts["is_eos"],
            consts["pad"],
            consts["min_new"],
            consts["temperature"],
            self._top_p(request),
            request.do_sample,
            request.top_k,
            self._keep_one,
        )

    def _top_p(self, request: DecodeRequest) -> torch.Tensor | None:
        return self._consts["top_p"] if request.top_p < 1.0 else None

    def _cache_len(self) -> int:
        configured = getattr(self.model.generation_config, "max_cache_len", None)
        return int(configured or self.max_cache_len)

    def _step(self, torch: ModuleType, request: DecodeRequest, batch: int) -> StepFn:
        if not self.compile_options:
            return decode_step
        kind = step_name(request)
        if (batch, kind) not in self.graphs:
            self.cache_records.append(
                {
                    "batch": batch,
                    "step": kind,
                    **compile_cache.load_artifacts(self._key(batch, kind), self.cache_dir),
                }
            )
        if self.regional:
            if not self._compiled:
                self._compiled[True] = self._compiled[False] = regional_step
                compile_layers(self.model, self.compile_options)
            return regional_step
        if request.do_sample not in self._compiled:
            self._compiled[request.do_sample] = torch.compile(decode_step, **self.compile_options)
        return self._compiled[request.do_sample]

    def _after_compile(self, request: DecodeRequest, batch: int) -> None:
        kind = step_name(request)
        if (batch, kind) in self.graphs:
            return
        self.graphs.add((batch, kind))
        record = self.cache_records[-1] if self.cache_records else {}
        if not record.get("loaded"):
            record.update(compile_cache.save_artifacts(self._key(batch, kind), self.cache_dir))

    def _key(self, batch: int, kind: str) -> str:
        options = {**(self.compile_options or {}), **({"regional": True} if self.regional else {})}
        return compile_cache.model_key(
            self.model,
            batch=batch,
            step=kind,
            cache_len=self._cache_len(),
            compile_options=options,
            weights=self.cache_fields,
        )
