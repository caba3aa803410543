"""Other libraries' import-time messages, kept behind ``verbose`` (docs/troubleshooting.md "Quiet
imports").

Importing bitsandbytes, torchao, kernels, peft or deepspeed prints things that are not the user's
concern: bitsandbytes tries to fetch an optional CPU kernel from the Hub through ``kernels`` and logs
"Skipping publisher trust check …" and "Failed to load CPU gemm_4bit_forward …" when it cannot,
torchao logs "Failed to load …/_C_mxfp8….so" for CUDA-only extensions and makes torch log a
``register_constant()`` deprecation per enum, deepspeed announces the accelerator it picked. xpukit
imports these libraries itself, inside its own calls (transformers imports torchao and kernels with
its modeling code, peft imports bitsandbytes).

:func:`quiet_imports` wraps xpukit's public calls (``plan_load``, ``load_for_xpu``, ``training_args``,
the merge, the command line). While one runs, and only while the module of one of
:data:`NOISY_LIBRARIES` is being imported for the first time, what that import says is collected,
not shown: its log records (any logger but xpukit's, whatever handlers they would reach), its Python
warnings, and what it prints through ``sys.stdout``/``sys.stderr``. After the import, logging, the
warnings filters and ``sys.stdout``/``sys.stderr`` are as they were: the user's own code, and every
message these libraries log later (while loading or training), is untouched. C-level writes to file
descriptors 1 and 2 are not captured (none of these libraries makes one at import today).

With ``XPUKIT_VERBOSE=1``, ``xpukit --verbose`` or :func:`verbose` everything passes through. What was
collected stays readable (:func:`collected`); one record changes what a plan costs, and xpukit says
that once, in its own words (:data:`KNOWN`, :func:`notes_for`).
"""

from __future__ import annotations

import importlib.abc
import io
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Protocol, TextIO

from xpukit import _environ

__all__ = [
    "KNOWN",
    "NOISY_LIBRARIES",
    "KnownRecord",
    "collected",
    "is_verbose",
    "notes_for",
    "quiet_imports",
    "quiet_load",
    "quiet_transformers",
    "say_once",
    "verbose",
]

# Top-level modules whose first import is quieted (what each says: the module docstring).
NOISY_LIBRARIES = frozenset({"bitsandbytes", "torchao", "kernels", "peft", "deepspeed"})

_LOCK = threading.RLock()
_ACTIVE = 0  # quiet_imports() scopes open
_VERBOSE: list[bool] = []  # verbose() scopes, innermost last
_COLLECTED: list[logging.LogRecord] = []  # what the quieted imports said, in this process
_MAX_COLLECTED = 200
_SAID: set[str] = set()


def is_verbose() -> bool:
    """Whether other libraries' messages pass through: :func:`verbose`, else ``XPUKIT_VERBOSE``."""
    return _VERBOSE[-1] if _VERBOSE else _environ.flag("XPUKIT_VERBOSE")


@contextmanager
def verbose(on: bool) -> Iterator[None]:
    """Inside, other libraries' import messages pass through (``on``) or are collected (not ``on``)."""
    _VERBOSE.append(bool(on))
    try:
        yield
    finally:
        _VERBOSE.pop()


def say_once(note: str) -> bool:
    """True the first time ``note`` is asked about in this process (to log a note once)."""
    with _LOCK:
        if note in _SAID:
            return False
        _SAID.add(note)
        return True


def collected() -> list[logging.LogRecord]:
    """The records the quieted imports of this process logged (a copy; the last 200)."""
    with _LOCK:
        return list(_COLLECTED)


@contextmanager
def quiet_imports() -> Iterator[None]:
    """While inside, the first import of a :data:`NOISY_LIBRARIES` module says nothing (module
    docstring). Re-entrant; a no-op when :func:`is_verbose`."""
    global _ACTIVE
    if is_verbose():
        yield
        return
    with _LOCK:
        _ACTIVE += 1
        if _ACTIVE == 1:
            sys.meta_path.insert(0, _FINDER)
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE -= 1
            if _ACTIVE == 0 and _FINDER in sys.meta_path:
                sys.meta_path.remove(_FINDER)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it, and wraps the noisy modules' execution."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in NOISY_LIBRARIES or _CAPTURING.depth:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            with _capturing():
                run(module)
            with suppress(AttributeError):  # the loader is this spec's own: back to its class's method
                del loader.exec_module

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _Finder()


class _Capturing(threading.local):
    depth = 0


_CAPTURING = _Capturing()


class _Held(io.TextIOBase):
    """Stands in for ``sys.stdout``/``sys.stderr`` during a quieted import: collects what is written
    then; afterwards (a library may keep a reference, as a logging handler does) it writes through to
    the stream it replaced."""

    def __init__(self, stream: TextIO, name: str) -> None:
        super().__init__()
        self._stream = stream
        self._name = name
        self.holding = True

    def write(self, text: str) -> int:
        if not self.holding:
            return int(self._stream.write(text))
        for line in text.splitlines():
            if line.strip():
                _keep(
                    logging.makeLogRecord(
                        {
                            "name": f"<{self._name}>",
                            "levelno": logging.WARNING,
                            "levelname": "WARNING",
                            "msg": line,
                        }
                    )
                )
        return len(text)

    def flush(self) -> None:
        if not self.holding:
            self._stream.flush()

    def __getattr__(self, name: str) -> object:  # encoding, fileno, isatty …: the real stream's
        return getattr(self._stream, name)


def _keep(record: logging.LogRecord) -> None:
    with _LOCK:
        _COLLECTED.append(record)
        del _COLLECTED[:-_MAX_COLLECTED]


@contextmanager
def _capturing() -> Iterator[None]:
    """Collect every record, warning and print until the import ends; then restore all three."""
    _CAPTURING.depth += 1
    original_call = logging.Logger.callHandlers

    def call_handlers(logger: logging.Logger, record: logging.LogRecord) -> None:
        if record.name == "xpukit" or record.name.startswith("xpukit."):
            original_call(logger, record)
        elif record.levelno >= logging.WARNING:
            _keep(record)

    def show_warning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        _keep_warning(message, category, filename, lineno, line)

    streams = (sys.stdout, sys.stderr)
    held = (_Held(streams[0], "stdout"), _Held(streams[1], "stderr"))
    logging.Logger.callHandlers = call_handlers  # type: ignore[method-assign,assignment]
    sys.stdout, sys.stderr = held
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            yield
    finally:
        if sys.stdout is held[0]:
            sys.stdout = streams[0]
        if sys.stderr is held[1]:
            sys.stderr = streams[1]
        for stream in held:
            stream.holding = False
        logging.Logger.callHandlers = original_call  # type: ignore[method-assign]
        _CAPTURING.depth -= 1


@contextmanager
def quiet_load() -> Iterator[None]:
    """While a load runs (not :func:`is_verbose`): transformers' progress bars off, and the deprecation
    warnings one library raises about another's API (peft calling a deprecated transformers method)
    collected, not shown; every other warning shows. Both restored after. Imports transformers."""
    if is_verbose():
        yield
        return
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            shown = warnings.showwarning

            def show_warning(
                message: Warning | str,
                category: type[Warning],
                filename: str,
                lineno: int,
                file: TextIO | None = None,
                line: str | None = None,
            ) -> None:
                if not issubclass(category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning)):
                    shown(message, category, filename, lineno, file, line)
                    return
                _keep_warning(message, category, filename, lineno, line)

            warnings.showwarning = show_warning
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """While inside (not :func:`is_verbose`), transformers logs errors only: for a step whose outcome
    xpukit states itself (a merge's dequantisation, which transformers announces as a warning)."""
    if is_verbose():
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _keep_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None
) -> None:
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    _keep(
        logging.makeLogRecord(
            {"name": "py.warnings", "levelno": logging.WARNING, "levelname": "WARNING", "msg": text}
        )
    )


# --- what a collected record costs, in xpukit's words --------------------------------------------


class _Device(Protocol):
    @property
    def backend(self) -> str: ...


class PlanFacts(Protocol):
    """What a note's rule reads of a ``LoadPlan`` (this base module does not import planning)."""

    @property
    def device(self) -> _Device: ...

    @property
    def quantization(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class KnownRecord:
    """A third-party log record that can matter to a plan, and the note xpukit says for it."""

    logger: str  # the logger name's prefix
    contains: str  # a piece of the message
    note: str
    matters: Callable[[PlanFacts], bool]  # given the LoadPlan: does this record change what it means?


def _bnb_4bit_on_cpu(plan: PlanFacts) -> bool:
    return bool(plan.device.backend == "cpu" and plan.quantization == "4bit")


# bitsandbytes 0.50 tries to load an optimised CPU 4-bit kernel from the Hub when it is imported (on
# avx512_bf16 CPUs); it logs a warning when the kernel is not cached and the Hub is offline, and uses
# its built-in CPU path instead (docs/known-issues.md "bitsandbytes: import reaches the Hub on
# avx512_bf16 CPUs"). That only matters where 4-bit layers run on the CPU. The `kernels` package's
# "Skipping publisher trust check" in offline mode is not about the plan at all, and stays quiet.
KNOWN: tuple[KnownRecord, ...] = (
    KnownRecord(
        logger="bitsandbytes",
        contains="gemm_4bit_forward",
        note="bitsandbytes could not load its optimised CPU 4-bit kernel from the Hub (not cached, or "
        "the Hub is offline): the 4-bit layers on this CPU run on bitsandbytes' built-in path, which "
        "is slower. Online once (or with the kernel cached) it is used.",
        matters=_bnb_4bit_on_cpu,
    ),
)


def notes_for(records: list[logging.LogRecord], plan: PlanFacts) -> list[str]:
    """xpukit's notes for the records that matter to ``plan`` (each note once)."""
    notes: list[str] = []
    for known in KNOWN:
        hit = any(r.name.startswith(known.logger) and known.contains in r.getMessage() for r in records)
        if hit and known.matters(plan) and known.note not in notes:
            notes.append(known.note)
    return notes
