"""What the command line prints of log records: only xpukit's words under xpukit's name.

* xpukit's own records (loggers ``xpukit.*``) print as ``xpukit: LEVEL: message``: warnings always,
  its decisions (INFO) with ``--verbose``.
* Other libraries' records (bitsandbytes, kernels, transformers, peft …) are not printed under
  xpukit's name. Without ``--verbose`` they are collected, not shown; one that matters to what the
  command shows becomes a note in xpukit's own words (:data:`KNOWN`, :func:`notes_for`). With
  ``--verbose`` they print under their own logger names (``bitsandbytes.backends.cpu.ops: WARNING:
  …``), so nothing is hidden from someone who asks.

torch and transformers print through handlers of their own (and transformers shows progress bars),
and Python warnings (peft's) go straight to stderr, so none of them reaches the handlers above. A
command that runs them and prints a summary of its own (``xpukit merge``) wraps that work in
:func:`library_output`, which routes all three into the same records: collected without
``--verbose``, printed under their own names with it (progress bars too).

Everything is installed for one command and taken down after it (:func:`command_logging`), so calling
``xpukit.cli.main.main()`` twice in one process, or from a notebook, leaves logging as it was.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from xpukit import _quiet
from xpukit._quiet import KNOWN, KnownRecord

if TYPE_CHECKING:
    from xpukit.planning.loadplan import LoadPlan

__all__ = ["KNOWN", "Collected", "KnownRecord", "command_logging", "library_output", "notes_for"]

XPUKIT_FORMAT = "xpukit: %(levelname)s: %(message)s"
OTHER_FORMAT = "%(name)s: %(levelname)s: %(message)s"


class Collected(logging.Handler):
    """Other libraries' warnings during one command, kept for :func:`notes_for` (never printed)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith("xpukit"):
            self.records.append(record)


def notes_for(records: list[logging.LogRecord], plan: LoadPlan) -> list[str]:
    """xpukit's notes for ``records`` and what the quieted imports logged (xpukit/_quiet.py) that
    matter to ``plan`` (each note once)."""
    return _quiet.notes_for([*records, *_quiet.collected()], plan)


@contextmanager
def command_logging(verbose: bool) -> Iterator[Collected]:
    """Log handlers for one command: xpukit's records under its name, others per ``verbose``."""
    root = logging.getLogger()
    ours = logging.getLogger("xpukit")
    saved = (root.level, list(root.handlers), ours.level, ours.propagate, list(ours.handlers))
    xpukit_handler = logging.StreamHandler(sys.stderr)
    xpukit_handler.setFormatter(logging.Formatter(XPUKIT_FORMAT))
    ours.handlers = [xpukit_handler]
    ours.setLevel(logging.INFO if verbose else logging.WARNING)
    ours.propagate = False
    collected = Collected()
    # A handler on the root logger also keeps Python's last-resort handler from printing other
    # libraries' warnings bare on stderr.
    handlers: list[logging.Handler] = [collected]
    if verbose:
        other = logging.StreamHandler(sys.stderr)
        other.setFormatter(logging.Formatter(OTHER_FORMAT))
        other.setLevel(logging.WARNING)
        handlers.append(other)
    root.handlers = handlers
    root.setLevel(logging.WARNING)
    try:
        yield collected
    finally:
        root.setLevel(saved[0])
        root.handlers = saved[1]
        ours.setLevel(saved[2])
        ours.propagate = saved[3]
        ours.handlers = saved[4]


# The libraries whose loggers print through their own handler (never reaching the root logger).
_OWN_HANDLERS = ("torch", "transformers")


@contextmanager
def plan_warnings_printed(verbose: bool) -> Iterator[None]:
    """While a command prints the plan, whose warnings are part of it, the planner does not also log
    them (unless ``--verbose``)."""
    planner_log = logging.getLogger("xpukit.planning.plan")
    level = planner_log.level
    if not verbose:
        planner_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        planner_log.setLevel(level)


@contextmanager
def library_output(verbose: bool) -> Iterator[None]:
    """torch's and transformers' log records, transformers' progress bars and Python warnings, routed
    like other libraries' records for the work inside (module docstring); nothing changes with
    ``verbose``. Imports torch and transformers (their handlers exist once they are imported)."""
    if verbose:
        yield
        return
    import torch  # noqa: F401  (installs the handler replaced below)
    from transformers.utils import logging as hf_logging

    saved = [(log, list(log.handlers), log.propagate) for log in map(logging.getLogger, _OWN_HANDLERS)]
    for log, _, _ in saved:
        log.handlers, log.propagate = [], True
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # huggingface_hub's bars too
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_to_record
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        for log, handlers, propagate in saved:
            log.handlers, log.propagate = handlers, propagate


def _warning_to_record(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    """A Python warning as a record of the ``py.warnings`` logger (as ``logging.captureWarnings`` does)."""
    text = warnings.formatwarning(message, category, filename, lineno, line)
    logging.getLogger("py.warnings").warning("%s", text.rstrip())
