"""xpukit's decode loop: static cache, one prefill, then one (compiled) step per token, no host sync.

Reached through the model's own ``generate()`` (:func:`install_decode_loop` wraps it on the
instance); :func:`xpukit.loading.decode.request.triage` decides per call whether this loop serves
it, else transformers' ``generate`` runs unchanged. Which one ran is ``model.xpukit_last_decode``
(docs/decode-internals.md "How the loop works").

Per batch size the loop keeps a ``StaticCache`` of ``max_cache_len`` tokens and fixed buffers
(:mod:`xpukit.loading.decode.state`). A decode step reads and writes only those buffers, on the
device: forward of one token, EOS suppression for ``min_new_tokens``, argmax or sampling (temperature
→ top-k → top-p, then the exponential-race draw, exact for the categorical distribution), pad after
EOS, and the write of the token into the output. Compiled with CUDA graphs the step is one graph
replay per token; the host reads the "all finished" flag once every ``check_every`` tokens. With
xpukit's grouped decode attention a step reads only the attention window of the cache; with its own
step graphs the prompt is left-padded to a bucket and its prefill is one replay too
(:mod:`xpukit.loading.decode.buckets`). Tiered (docs/decode.md "Tiered decoding"), the step runs
uncompiled until the compiled step, built on a thread (:mod:`xpukit.loading.decode.tiers`), takes
over between two tokens. Which step runs, with which arguments, and how one step is called is
:class:`~xpukit.loading.decode.runner.StepRunner`'s.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from xpukit.errors import InvalidRequestError
from xpukit.loading.decode import compile_cache
from xpukit.loading.decode.buckets import left_pad, prompt_length, window_lengths
from xpukit.loading.decode.progress import compile_progress
from xpukit.loading.decode.request import DecodeRequest, triage
from xpukit.loading.decode.runner import StepRunner, step_name
from xpukit.loading.decode.state import DecodeState, fill_constants, new_state
from xpukit.loading.decode.step import decode_step
from xpukit.loading.decode.tiers import CompileJob, Tiers, aot_available
from xpukit.loading.device_graph import background_busy

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from xpukit.loading.decode.interfaces import DecodeModel, LastDecode, StepFn

__all__ = ["CHECK_EVERY", "DecodeLoop"]

logger = logging.getLogger(__name__)

CHECK_EVERY = 16  # tokens between two reads of the "all sequences finished" flag (one host sync)
_KEEP_BATCH_SIZES = 4  # caches kept per model (each is batch × the plan's KV bytes)


def _fill_mask(cache_mask: torch.Tensor, mask: torch.Tensor) -> None:
    """The mask over the whole cache: the prompt's, then ones (causality hides the future)."""
    cache_mask[:, : mask.shape[1]].copy_(mask)
    cache_mask[:, mask.shape[1] :].fill_(1)


class DecodeLoop(StepRunner):
    """The decode loop of one model (its steps: :class:`~xpukit.loading.decode.runner.StepRunner`).

    Attributes:
        enabled: ``False`` sends every call to transformers' ``generate`` (a switch for comparison).
        check_every: tokens between two reads of the finished flags.
        capture_prefill: with step graphs, pad the prompt to its bucket and capture its prefill
            (``False``: the prefill runs uncaptured, for comparison).
        tiered: the uncompiled step serves until the compiled one is built (docs/decode.md
            "Tiered decoding"); ``tiers`` holds the builds (:class:`~xpukit.loading.decode.tiers.Tiers`).
    """

    def __init__(
        self,
        model: DecodeModel,
        *,
        max_cache_len: int,
        compile_options: dict[str, object] | None = None,
        check_every: int = CHECK_EVERY,
        cache_dir: Path | None = None,
        cache_fields: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(
            model,
            max_cache_len=max_cache_len,
            compile_options=compile_options,
            cache_dir=cache_dir,
            cache_fields=cache_fields,
        )
        self.tiered = False  # set_compile(..., tiered=True)
        self.tiers = Tiers()
        self._tokens: dict[str, int] = {}  # tokens per tier in the last call
        self.enabled = True
        self.check_every = check_every
        self.capture_prefill = True
        self._states: OrderedDict[tuple[int, int], DecodeState] = OrderedDict()
        self._last: tuple[DecodeRequest, DecodeState] | None = None

    def set_compile(
        self,
        options: dict[str, object] | None,
        *,
        step_graphs: bool = False,
        regional: bool = False,
        tiered: bool = False,
    ) -> None:
        """Compile the step with ``options`` from the next call on (``None``: eager); ``step_graphs``
        captures the step as one device graph (``options`` must then make no graphs); ``regional``
        compiles one decoder layer for all of them instead of the whole step; ``tiered`` serves the
        uncompiled step until the compiled one is built (not with ``regional``, whose compile is the
        short one)."""
        if regional and tiered:
            raise InvalidRequestError(
                "tiered=True builds the whole compiled step ahead of time on a thread; regional=True "
                "compiles one decoder layer in the call that first needs it. Fix: one of the two "
                '(docs/decode.md "Tiered decoding")'
            )
        super().set_compile(options, step_graphs=step_graphs, regional=regional)
        self.tiered = tiered and bool(options)
        self.tiers.jobs.clear()
        if self.tiered:
            import torch

            why = aot_available(torch)
            if why is not None:  # the compiled step then compiles in its first call, as without tiers
                self.tiered = False
                self.tiers.event(planned="tiered", actual="compiled at the first call", cause=why)

    def disable_compile(self) -> None:
        """Run the step eagerly from now on (a compile failure)."""
        super().disable_compile()
        self.tiered = False
        self.tiers.jobs.clear()

    def dispatch(
        self, original: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        """Serve a ``generate()`` call with this loop or with transformers' (``original``)."""
        request: DecodeRequest | str
        if not self.enabled:
            request = "xpukit's loop is switched off (model.xpukit_decode_loop.enabled)"
        else:
            request = triage(self.model, args, kwargs)
        if isinstance(request, DecodeRequest):
            length = self._cache_len()
            needed = request.input_ids.shape[1] + request.new_tokens
            if needed > length:
                request = f"prompt + new tokens = {needed} exceed the static cache ({length})"
        if isinstance(request, str):
            self._record("transformers", request, None)
            return original(*args, **kwargs)
        out = self.run(request)
        self._record("xpukit", "greedy" if not request.do_sample else "sampling", request)
        return out

    def run(self, request: DecodeRequest) -> torch.Tensor:
        """Generate for ``request``; returns prompts + new tokens, as transformers' ``generate``."""
        import torch

        # Never inference mode: the kept buffers and the cache are mutated by later calls, which may
        # run outside it (an inference tensor cannot be updated there); no_grad in every call, so the
        # compiled step's grad-mode guard always holds.
        with torch.inference_mode(False), torch.no_grad():
            return self._run(torch, request)

    def _run(self, torch: ModuleType, request: DecodeRequest) -> torch.Tensor:
        model = self.model
        given = request.input_ids.to(model.device)
        batch = given.shape[0]
        mask = request.attention_mask
        mask = torch.ones_like(given) if mask is None else mask.to(device=model.device, dtype=torch.long)
        length = self._cache_len()
        state = self._state(batch, length)
        fill_constants(model, self._consts, request)
        ids, bucket = given, None
        if self.step_graphs is not None:
            self.step_graphs.check_weights(model)
            if self.capture_prefill:  # a prefill of a few shapes, each captured once; else uncaptured
                bucket = prompt_length(ids.shape[1], length - request.new_tokens)
        if bucket is not None:
            ids, mask = left_pad(ids, mask, bucket)
        state.cache.reset()
        _fill_mask(state.mask, mask)
        state.prompt(ids.shape[1]).copy_(ids)
        self._prefill(request, state, ids.shape[1], captured=bucket is not None)
        self._tokens = {"prefill": 1}
        self._last = (request, state)
        done = self._decode(torch, request, state, ids.shape[1])
        new = state.out[:, :done]
        if request.eos_ids and not bool(state.unfinished.any()):
            hit = self._consts["is_eos"][new]
            first_eos = torch.where(hit.any(-1), hit.int().argmax(-1), done - 1)
            new = new[:, : int(first_eos.max()) + 1]
        result = torch.cat([given, new.clone()], dim=1)
        if self.tiered:  # the build starts when the first call that needs it ends (loading/decode/tiers.py)
            self._job(torch, request, state, ids.shape[1] + done, prefill=bucket)
        return result

    def _decode(self, torch: ModuleType, request: DecodeRequest, state: DecodeState, prompt: int) -> int:
        """The steps after the prefill; returns how many tokens of ``out`` are made."""
        batch = int(state.tokens.shape[0])
        job = self.tiers.jobs.get((batch, step_name(request))) if self.tiered else None
        return self._decode_steps(torch, request, state, prompt, job)

    def _decode_steps(
        self,
        torch: ModuleType,
        request: DecodeRequest,
        state: DecodeState,
        prompt: int,
        job: CompileJob | None,
    ) -> int:
        batch = int(state.tokens.shape[0])
        step: StepFn | None
        step, tier = (decode_step, self.first_tier) if self.tiered else (None, "")
        step = step or self._step(torch, request, batch)
        for i in range(1, request.new_tokens):
            if job is not None and tier != "compiled":
                built = job.ready()
                if built is not None:
                    if self.step_graphs is not None:  # the first tier's captures of this kind are done with
                        self.step_graphs.forget(state.owner, f"{tier}-{step_name(request)}")
                    step, tier = built, "compiled"
                else:
                    self.tiers.report(job, self.first_tier)
            if not tier and i == 1 and self._compiles_now(request, batch):
                with compile_progress(self._compiling(request, batch)):  # the step compiles here
                    self._call(step, request, state, prompt + i)
                self._after_compile(request, batch)
            else:
                self._call(step, request, state, prompt + i, tier=tier)
            self._tokens[tier or "step"] = self._tokens.get(tier or "step", 0) + 1
            if request.eos_ids and (i + 1) % self.check_every == 0 and not bool(state.unfinished.any()):
                return i + 1
        return request.new_tokens

    @property
    def first_tier(self) -> str:
        """The tier that serves while the compiled step is built: ``graph`` (the uncompiled step
        captured as a device graph) or ``eager``."""
        return "graph" if self.step_graphs is not None else "eager"

    def _job(
        self,
        torch: ModuleType,
        request: DecodeRequest,
        state: DecodeState,
        filled: int,
        prefill: int | None = None,
    ) -> CompileJob:
        """The build of the compiled step for this call's batch and step kind (started on first need,
        after the call's tokens are taken: ``filled`` cache slots hold them; ``prefill``: the call's
        captured prompt bucket)."""
        batch, kind = int(state.tokens.shape[0]), step_name(request)
        if (batch, kind) in self.tiers.jobs:
            return self.tiers.jobs[(batch, kind)]
        self._capture_first_tier(request, state, filled, prefill)
        args = self._step_args(request, state, self._window(state, filled))
        root = compile_cache.compile_cache_dir() if self.cache_dir is None else Path(self.cache_dir)
        path = root / f"{self._key(batch, kind)}.step"
        job = self.tiers.start((batch, kind), args, dict(self.compile_options or {}), path)
        self.cache_records.append(job.record)
        return job

    def _capture_first_tier(
        self, request: DecodeRequest, state: DecodeState, filled: int, prefill: int | None
    ) -> None:
        """Before the build starts, the first tier's step captured for every attention window of this
        batch, and the call's prefill bucket: no capture starts while the build runs, and a step run
        uncaptured beside it waits for Python's lock at each operation (docs/decode.md "Tiered
        decoding"), while a replay needs it a few times a token. The warm-up runs and the replays that
        follow each capture run for real: their tokens go to the cache's next free slots and the output
        buffer from slot 1, after this call's tokens were taken (the next call resets both). Skipped
        when the cache has too little room left."""
        if self.step_graphs is None or background_busy():
            return
        length = int(state.mask.shape[1])
        windows = window_lengths(length, self.window_smallest) if self._window(state, 1) is not None else [1]
        if filled + 2 * len(windows) > length:
            return
        if prefill is not None:  # warmed by the call: this run captures it
            self._prefill(request, state, prefill, captured=True)
        state.index.fill_(1)
        for window in windows:
            for _ in range(2):  # StepGraphs.run: a warm-up run, then the capture and its replay
                self._call(decode_step, request, state, window, tier=self.first_tier)

    def replay(self, count: int) -> None:
        """Run ``count`` more decode steps of the last call's batch, with no host sync (measurement:
        ``bench/bench_decode.py --breakdown`` times the step alone). The output buffer is not touched
        past the cache; the next ``generate()`` resets everything."""
        import torch

        if self._last is None:
            raise InvalidRequestError("replay() runs the last generate() call's step: call generate() first")
        request, state = self._last
        if int(state.cache.get_seq_length()) + count > state.mask.shape[1]:
            raise InvalidRequestError(
                f"replay({count}): the static cache has no room for {count} more tokens"
            )
        batch = int(state.tokens.shape[0])
        step: StepFn | None
        step, tier = None, ""
        if self.tiered:  # the tier the next call would start with
            step = self.tiers.jobs[(batch, step_name(request))].ready()
            tier = "compiled" if step is not None else self.first_tier
        step = step or (decode_step if tier else self._step(torch, request, batch))
        filled = int(state.cache.get_seq_length())
        with torch.inference_mode(False), torch.no_grad():
            state.index.fill_(1)
            for _ in range(count):
                self._call(step, request, state, filled + count, tier=tier)

    def _state(self, batch: int, length: int) -> DecodeState:
        key = (batch, length)
        if key in self._states:
            self._states.move_to_end(key)
            return self._states[key]
        self._states[key] = new_state(self.model, batch, length)
        while len(self._states) > _KEEP_BATCH_SIZES:
            dropped, _ = self._states.popitem(last=False)
            if self.step_graphs is not None:
                self.step_graphs.forget(dropped)
        return self._states[key]

    def _record(
        self, loop: Literal["xpukit", "transformers"], reason: str, request: DecodeRequest | None
    ) -> None:
        record: LastDecode = {"loop": loop, "reason": reason}
        if request is not None:
            record.update(
                {
                    "batch": int(request.input_ids.shape[0]),
                    "new_tokens": request.new_tokens,
                    "compiled": bool(self.compile_options),
                    "cudagraphs": self.cudagraphs,
                    "step_graphs": self.step_graphs is not None,
                }
            )
            if self.regional:
                record["regional"] = True
            if self.tiered or self.tiers.jobs:
                record["tiers"] = dict(self._tokens)
        self.model.xpukit_last_decode = record
        logger.debug("generate(): %s loop (%s)", loop, reason)
