"""Writing into place: nothing xpukit writes is left half-written, interrupted or killed.

Everything xpukit writes for someone to read later (a merged checkpoint, the demo model in the
cache, an adapter's base record, a compile-cache blob) is written under a temporary name beside its
final one and renamed into place when complete (:func:`writing`, :func:`write_file`). The temporary
name is xpukit's own, and says which process wrote it::

    .<final name>.xpukit-<host>-<pid>-<random>.partial

- **Stopped** (SIGTERM, SIGINT / Ctrl-C; Ctrl-Break on Windows) while writing: a handler installed
  only around the writing removes the partial file or folder, puts the previous handlers back and
  passes the signal on to the one that was there: Python's SIGINT handler raises
  ``KeyboardInterrupt`` (``xpukit`` exits 130), and a signal left at its default ends the process by
  that signal, as it would have without xpukit (exit status 143 for SIGTERM in a shell). A signal
  that was ignored stays ignored. Only the main thread can install handlers; elsewhere the writing
  relies on the next point.
- **Killed** (SIGKILL, the out-of-memory killer, a power cut), when no handler runs: the next write
  into the same folder finds the partials of processes of this machine that no longer run, removes
  them and logs a warning saying so. A partial of a live process, or of another machine (a shared
  file system), is left alone; so is one whose dead process's id is in use again.

docs/troubleshooting.md "A hidden .partial folder beside the output" says the same for users.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TypeAlias

from xpukit import _platform

__all__ = [
    "PARTIAL_SUFFIX",
    "into_place",
    "partial_path",
    "stale_partials",
    "sweep_stale",
    "write_file",
    "writing",
]

logger = logging.getLogger(__name__)

# What ``signal.signal`` installs and returns: a function, SIG_DFL / SIG_IGN, or None (not from Python).
_Handler: TypeAlias = "Callable[[int, FrameType | None], object] | int | signal.Handlers | None"

PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^\.(?P<final>.+)\.xpukit-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.partial$")


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def partial_path(final: Path) -> Path:
    """A new name for a partial of ``final`` (nothing is created): this process's, beside it."""
    token = secrets.token_hex(4)
    return final.with_name(f".{final.name}.xpukit-{_host()}-{os.getpid()}-{token}{PARTIAL_SUFFIX}")


def stale_partials(parent: Path) -> list[Path]:
    """The partials in ``parent`` left by processes of this machine that no longer run."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    host, stale = _host(), []
    for entry in entries:
        found = _NAME.match(entry.name)
        if found is None or found["host"] != host or int(found["pid"]) == os.getpid():
            continue
        if not _platform.process_alive(int(found["pid"])):
            stale.append(entry)
    return sorted(stale)


def sweep_stale(parent: Path) -> list[Path]:
    """Remove :func:`stale_partials` of ``parent``, with a warning naming them; returns them."""
    removed = []
    for entry in stale_partials(parent):
        _remove(entry)
        if not entry.exists():
            removed.append(entry)
    if removed:
        pids = sorted({int(m["pid"]) for e in removed if (m := _NAME.match(e.name))})
        logger.warning(
            "removed %d half-written %s left in %s by an interrupted xpukit write (process %s, no "
            "longer running): %s",
            len(removed),
            "copy" if len(removed) == 1 else "copies",
            parent,
            ", ".join(map(str, pids)),
            ", ".join(e.name for e in removed),
        )
    return removed


@contextlib.contextmanager
def writing(final: str | os.PathLike[str], *, directory: bool = True) -> Iterator[Path]:
    """A new partial of ``final`` to write into; the caller renames it into place when complete.

    ``directory=True``: an empty folder (mode from the umask, as ``mkdir`` makes it); ``False``: a
    file path not yet created. Before it, stale partials in the same folder are swept
    (:func:`sweep_stale`). The partial is removed at the end if it is still there (an error, or a
    signal: module docstring).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(final.parent)
    path = partial_path(final)
    if directory:
        path.mkdir()
    try:
        with _removed_on_signal(path):
            yield path
    finally:
        _remove(path)


def into_place(partial: Path, final: Path) -> None:
    """Rename a complete partial folder to ``final``, which may be an empty folder (callers refuse a
    non-empty one before writing)."""
    if final.exists():
        final.rmdir()
    partial.rename(final)


def write_file(final: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``final`` through a partial file renamed into place."""
    final = Path(final)
    with writing(final, directory=False) as partial:
        with partial.open("xb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(partial, final)
    return final


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            path.unlink()


@contextlib.contextmanager
def _removed_on_signal(path: Path) -> Iterator[None]:
    """While inside: SIGTERM / SIGINT (Ctrl-Break) remove ``path``, then go to the handler before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, _Handler] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        _remove(path)
        _restore(previous)
        _pass_on(signum, frame, previous.get(signum, signal.SIG_DFL))

    for signum in _platform.forwarded_signals():
        before = signal.getsignal(signum)
        if before is signal.SIG_IGN or before is None:  # ignored, or not set from Python: left as is
            continue
        previous[signum] = signal.signal(signum, on_signal)
    try:
        yield
    finally:
        _restore(previous)


def _restore(previous: dict[int, _Handler]) -> None:
    for signum, before in previous.items():
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signum, before)


def _pass_on(signum: int, frame: FrameType | None, before: _Handler) -> None:
    """What would have happened without xpukit's handler: the previous handler, or the default."""
    if callable(before):
        before(signum, frame)  # Python's SIGINT handler raises KeyboardInterrupt; an outer writer's
        return
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # the default: the process ends by this signal
    raise SystemExit(128 + signum)  # only if the default did not end it
