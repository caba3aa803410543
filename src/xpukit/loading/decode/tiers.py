"""Tiered decoding: the uncompiled step serves at once, the compiled step takes over when it is built.

docs/decode.md "Tiered decoding". A load that takes the fast path does not make its first
``generate()`` wait for a compile. The loop's first tier is its decode step uncompiled (captured as a
device graph by :class:`~xpukit.loading.decode.step_graph.StepGraphs` where the plan captures, else
run eagerly); meanwhile a daemon thread builds the compiled step (:class:`CompileJob`), and the loop
switches to it between two tokens once it is ready. Both tiers read and write the same static cache
and buffers, so a switch in the middle of a call loses no token.

The thread builds the step ahead of time: ``torch.compile(...).aot_compile`` (torch's ahead-of-time
compile of a whole-graph function, traced with fake tensors). Inductor's compile still runs kernels
(it benchmarks padded matrix products on random inputs), on the device's default stream, which would
invalidate a capture under way on another stream (seen on an H200): so the build starts when the
first call that needs it ends (that call's graph tier captures freely), and while it runs no capture
starts (:func:`xpukit.loading.device_graph.background_device_work`): a step with no graph yet runs
uncaptured. Before the build starts, the loop captures the first tier's step for every attention
window of the batch, so that the calls meanwhile replay graphs. While it runs, Python's lock is handed
to a waiting thread within 0.1 ms instead of 5 (:func:`quick_handoff`): each replay gives the lock up
and waits to get it back, and at the default interval a token would wait for the compiling thread
several times. Its first real run is the next tier's warm-up, on the main thread. The compiled function
keeps no dynamo guards (:func:`no_guards`): every input it may see is a buffer of the loop, and what
changes the code is in the compile cache's key. It is written beside the compile cache
(``<key>.step``, torch's
``save_compiled_function``) and a later process loads it instead of tracing and compiling
(``torch.compiler.load_compiled_function``; docs/decode-internals.md "Compile cache"). A torch without
``aot_compile`` compiles the step at its first call instead (the rule before tiers), and says so.

An error in the thread (a failed compile, a load that torch refuses) leaves the first tier serving;
the loop records it as a ``fallback`` event on the plan.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, cast

from xpukit._partial import write_file
from xpukit.loading.device_graph import background_device_work

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from xpukit.loading.decode.compile_cache import CompileRecord
    from xpukit.loading.decode.interfaces import StepFn
    from xpukit.planning.vocabulary import LoadEvent

__all__ = [
    "HANDOFF_S",
    "CompileJob",
    "Tiers",
    "aot_available",
    "build_step",
    "load_step",
    "no_guards",
    "quick_handoff",
    "step_job",
]

logger = logging.getLogger(__name__)

# Python's switch interval while a build runs (docs/decode.md "Tiered decoding"): how long a thread
# that wants the lock waits for the compiling thread to give it up (the default is 5 ms).
HANDOFF_S = 1e-4
_HANDOFF = threading.Lock()
_HANDOFF_USERS: list[tuple[float, float]] = []  # per build under way: (the interval found, the one set)


@contextlib.contextmanager
def quick_handoff() -> Iterator[None]:
    """Python's switch interval at most :data:`HANDOFF_S` inside (nested and concurrent builds share
    it); the interval found before is restored when the last one ends, unless it was changed since."""
    with _HANDOFF:
        if not _HANDOFF_USERS:
            found = sys.getswitchinterval()
            if found > HANDOFF_S:
                sys.setswitchinterval(HANDOFF_S)
            _HANDOFF_USERS.append((found, sys.getswitchinterval()))
        else:
            _HANDOFF_USERS.append(_HANDOFF_USERS[0])
    try:
        yield
    finally:
        with _HANDOFF:
            found, ours = _HANDOFF_USERS.pop()
            if not _HANDOFF_USERS and sys.getswitchinterval() == ours:
                sys.setswitchinterval(found)


def no_guards(entries: Sequence[object]) -> list[bool]:
    """A dynamo guard filter that keeps no guard: the loop calls the step with its own buffers only,
    and the compile cache's key holds everything that changes the traced code."""
    return [False] * len(entries)


def _aot_enabled(torch: ModuleType) -> contextlib.AbstractContextManager[None]:
    """torch hands ``torch.compile``'s result an ``aot_compile`` only with
    ``torch._dynamo.config.enable_aot_compile`` (off by default in some releases, on in 2.13): set
    for the one call that makes it, never left changed."""
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        patch: contextlib.AbstractContextManager[None] = torch._dynamo.config.patch(enable_aot_compile=True)
        return patch
    return contextlib.nullcontext()


def aot_available(torch: ModuleType) -> str | None:
    """``None`` where this torch compiles ahead of time and loads a saved compiled function, else why
    not (the compiled tier then compiles at its first call)."""
    with _aot_enabled(torch):
        probe = torch.compile(lambda x: x, fullgraph=True, backend="eager")
    if not hasattr(probe, "aot_compile"):
        return f"torch {torch.__version__} has no torch.compile(...).aot_compile"
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function"
    return None


def _compile_kwargs(options: Mapping[str, object]) -> dict[str, object]:
    """``torch.compile`` keyword arguments with the guard filter (torch takes it in ``options``,
    which excludes ``mode``: mode ``default`` is the same as none)."""
    kwargs = dict(options)
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        raise ValueError(f"an ahead-of-time step is built without inductor's graphs, not mode {mode!r}")
    inductor = cast("Mapping[str, object]", kwargs.get("options") or {})  # torch.compile's options dict
    kwargs["options"] = {**inductor, "guard_filter_fn": no_guards}
    return kwargs


def build_step(
    torch: ModuleType, step: StepFn, options: Mapping[str, object], args: tuple[object, ...]
) -> AOTCompiledFunction:
    """``step`` compiled ahead of time for ``args`` (traced with fake tensors: nothing runs)."""
    with _aot_enabled(torch):
        compiled = torch.compile(step, **_compile_kwargs(options))
    with torch.inference_mode(False), torch.no_grad():
        built: AOTCompiledFunction = compiled.aot_compile((args, {}))
    _no_guard_check(built)
    return built


def _no_guard_check(built: AOTCompiledFunction) -> None:
    """Skip the (empty) guard check per call, where this torch's compiled function offers it."""
    skip = getattr(built, "disable_guard_check", None)
    if callable(skip):
        skip()


def load_step(torch: ModuleType, path: Path, step: StepFn) -> AOTCompiledFunction:
    """The compiled step saved at ``path`` (``FileNotFoundError`` when there is none)."""
    with path.open("rb") as file:
        built: AOTCompiledFunction = torch.compiler.load_compiled_function(file, f_globals=step.__globals__)
    _no_guard_check(built)
    return built


class CompileJob:
    """The compiled step of one (batch size, step kind), built on a daemon thread.

    Attributes:
        record: what happened, for ``loop.cache_records``: ``how`` (``loaded`` from the compile cache,
            ``compiled``), ``seconds``, ``saved`` / ``error``.
        error: why the compiled tier will not come (``None`` while building or when built).
    """

    def __init__(
        self,
        build: Callable[[], tuple[StepFn, CompileRecord]],
        *,
        record: CompileRecord,
        background: bool,
    ) -> None:
        self.record: CompileRecord = record.copy()
        self.error: str | None = None
        self.reported = False
        self._step: StepFn | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            name = f"xpukit-compile-b{record.get('batch')}-{record.get('step')}"
            self._thread = threading.Thread(target=self._run, args=(build,), name=name, daemon=True)
            self._thread.start()
        else:
            self._run(build)

    def _run(self, build: Callable[[], tuple[StepFn, CompileRecord]]) -> None:
        """Build (the example inputs live in ``build``: nothing here keeps them once it returns)."""
        start = time.perf_counter()
        try:
            # inductor's compile runs kernels: no capture meanwhile; the main thread's calls get
            # Python's lock back quickly
            with background_device_work(), quick_handoff():
                self._step, record = build()
            self.record.update(record)
        except BaseException as exc:  # a thread's failure is recorded; the first tier serves on
            self.error = self.record["error"] = f"{type(exc).__name__}: {exc}"
            logger.warning("xpukit: compiled decode step not built (%s); the first tier serves", self.error)
        self.record["seconds"] = round(time.perf_counter() - start, 2)
        self._done.set()

    def ready(self) -> StepFn | None:
        """The compiled step when built, else ``None`` (never waits)."""
        return self._step if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> StepFn | None:
        """Wait for the build (warm-up at load); the compiled step, or ``None`` after an error."""
        self._done.wait(timeout)
        return self._step

    @property
    def done(self) -> bool:
        return self._done.is_set()


def step_job(
    torch: ModuleType,
    args: tuple[object, ...],
    options: Mapping[str, object],
    path: Path,
    *,
    record: CompileRecord,
    background: bool,
) -> CompileJob:
    """Build xpukit's decode step for ``args`` (the loop's buffers of one batch size and step kind):
    loaded from ``path`` when a process saved it there, else compiled ahead of time and saved there
    (atomically; a directory that cannot be written is recorded, never raised)."""
    from xpukit.loading.decode.step import decode_step

    def build() -> tuple[StepFn, CompileRecord]:
        done: CompileRecord = {**record, "path": str(path)}
        try:
            return load_step(torch, path, decode_step), done | {"how": "loaded"}
        except FileNotFoundError:
            pass
        except Exception as exc:  # a file of another torch: compile again
            done["load_error"] = f"{type(exc).__name__}: {exc}"
        lock = getattr(torch._dynamo.convert_frame, "compile_lock", None)  # one dynamo compile at a time
        with lock if lock is not None else contextlib.nullcontext():
            built = build_step(torch, decode_step, options, args)
        done["how"] = "compiled"
        try:
            blob = type(built).serialize(built).serialized_data
            write_file(path, blob)
            done.update({"saved": True, "bytes": len(blob)})
        except Exception as exc:  # a cache dir that cannot be written, a step torch cannot save
            done["save_error"] = f"{type(exc).__name__}: {exc}"
        return built, done

    return CompileJob(build, record=record, background=background)


class Tiers:
    """The compiled steps a loop is building or has built, and what went wrong.

    Attributes:
        jobs: one :class:`CompileJob` per (batch size, step kind).
        background: build on a daemon thread (``False``: in the call that first needs the step).
        events: ``decode_tiers`` fallbacks after the load, each also handed to ``on_event`` (the load
            puts them on the model's plan).
    """

    def __init__(self) -> None:
        self.jobs: dict[tuple[int, str], CompileJob] = {}
        self.background = True
        self.events: list[LoadEvent] = []
        self.on_event: Callable[[LoadEvent], None] | None = None

    def start(
        self, key: tuple[int, str], args: tuple[object, ...], options: Mapping[str, object], path: Path
    ) -> CompileJob:
        """The job of ``key`` (batch size, step kind), started on first need."""
        import torch

        if key not in self.jobs:
            record: CompileRecord = {"batch": key[0], "step": key[1]}
            self.jobs[key] = step_job(torch, args, options, path, record=record, background=self.background)
        return self.jobs[key]

    def event(self, *, planned: object, actual: object, cause: str) -> None:
        """A ``decode_tiers`` fallback: recorded, and handed to ``on_event``."""
        from xpukit.planning.vocabulary import LoadEvent

        event = LoadEvent(kind="fallback", what="decode_tiers", planned=planned, actual=actual, cause=cause)
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def report(self, job: CompileJob, first_tier: str) -> None:
        """Say once that ``job`` failed and the first tier serves on."""
        if job.error and not job.reported:
            job.reported = True
            what = f"batch {job.record.get('batch')} ({job.record.get('step')})"
            self.event(
                planned="compiled tier",
                actual=f"{first_tier} tier",
                cause=f"the compiled step for {what} was not built: {job.error}",
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every step being built (the warm-up); whether all were built."""
        for job in list(self.jobs.values()):
            job.wait(timeout)
        return all(job.ready() is not None for job in self.jobs.values())
