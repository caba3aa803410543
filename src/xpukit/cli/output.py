"""Machine-readable output: with ``--json``, standard output carries xpukit's JSON and nothing else.

Libraries a command imports write to standard output on their own: DeepSpeed's logger has a handler on
``sys.stdout`` ("Setting accelerator to CPU …", logged when accelerate or peft import it), and C
extensions write to file descriptor 1 directly. While a ``--json`` command runs
(:func:`reserved_stdout`), ``sys.stdout``, every logging handler bound to it and file descriptor 1 all
point at standard error; :func:`emit_json` alone writes to the real standard output. Without
``--json`` nothing changes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["emit_json", "reserved_stdout"]

_RESERVED: list[TextIO] = []  # the real standard output while a --json command runs


def emit_json(data: object) -> None:
    """Print ``data`` as indented JSON on the command's standard output."""
    stream = _RESERVED[-1] if _RESERVED else sys.stdout
    stream.write(json.dumps(data, indent=2) + "\n")
    stream.flush()


@contextmanager
def reserved_stdout(active: bool) -> Iterator[None]:
    """While ``active``, everything but :func:`emit_json` that writes to standard output goes to
    standard error (module docstring). Restored afterwards, errors included."""
    if not active:
        yield
        return
    original = sys.stdout
    original.flush()
    try:
        own: int | None = original.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        own = None  # a stream without a descriptor (a notebook, a test's capture)
    # The JSON's stream: a copy of stdout's descriptor, made before it is pointed at stderr.
    real = os.fdopen(os.dup(own), "w", encoding="utf-8") if own is not None else original
    saved = {fd: os.dup(fd) for fd in {1, own} if fd is not None}
    handlers = [h for h in _stream_handlers() if h.stream in (original, sys.__stdout__)]
    for handler in handlers:
        handler.setStream(sys.stderr)
    sys.stderr.flush()
    for fd in saved:
        os.dup2(2, fd)
    sys.stdout = sys.stderr
    _RESERVED.append(real)
    try:
        yield
    finally:
        _RESERVED.pop()
        sys.stdout = original
        for handler in handlers:
            handler.setStream(original)
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        if real is not original:
            real.close()


def _stream_handlers() -> list[logging.StreamHandler[Any]]:
    loggers = [logging.getLogger()] + [
        log for log in logging.Logger.manager.loggerDict.values() if isinstance(log, logging.Logger)
    ]
    return [h for log in loggers for h in log.handlers if isinstance(h, logging.StreamHandler)]
