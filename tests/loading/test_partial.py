"""Nothing half-written: xpukit's partial files and folders go on an error, SIGTERM, Ctrl-C, and after a kill.

The mechanism is :mod:`xpukit._partial`; the writers are ``xpukit merge`` (``save_merged``), the
demo model's cache, the adapter's base record, the compile cache and the demo's scratch folder.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from xpukit._partial import PARTIAL_SUFFIX, partial_path, stale_partials, write_file, writing

POSIX = sys.platform != "win32"


def _partials(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(PARTIAL_SUFFIX))


def test_names_say_whose_they_are(tmp_path: Path) -> None:
    path = partial_path(tmp_path / "merged")
    assert path.parent == tmp_path and not path.exists()
    assert path.name.startswith(".merged.xpukit-") and path.name.endswith(".partial")
    assert f"-{os.getpid()}-" in path.name and path != partial_path(tmp_path / "merged")


def test_stale_partial_of_a_dead_process_is_removed_by_the_next_write_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, partial_folder: Callable[..., Path]
) -> None:
    stale = partial_folder(tmp_path / "merged")
    dead = int(stale.name.split("-")[-2])
    live = partial_folder(tmp_path / "other", os.getppid())  # a writer still running: left alone
    elsewhere = partial_folder(tmp_path / "third", dead, host="0badc0de")  # another machine's: left alone
    foreign = tmp_path / ".merged.abc123.partial"  # not a name xpukit writes: left alone
    foreign.mkdir()
    assert stale_partials(tmp_path) == [stale]

    from xpukit.loading.adapter_record import write_record

    with caplog.at_level(logging.WARNING, logger="xpukit"):
        write_record(tmp_path, {"format": 1})  # any xpukit write into the folder sweeps it
    assert not stale.exists() and live.is_dir() and elsewhere.is_dir() and foreign.is_dir()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("xpukit")]
    assert len(said) == 1 and said[0].startswith(f"removed 1 half-written copy left in {tmp_path}")
    assert f"by an interrupted xpukit write (process {dead}, no longer running): {stale.name}" in said[0]
    assert (tmp_path / "xpukit_base.json").read_text() == '{\n  "format": 1\n}\n'
    assert _partials(tmp_path) == sorted([live.name, elsewhere.name, foreign.name])


def test_an_error_while_writing_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), writing(tmp_path / "out") as partial:
        (partial / "half").write_text("x")
        raise RuntimeError("disk full")
    with pytest.raises(TypeError), writing(tmp_path / "file", directory=False):
        raise TypeError("bad data")
    assert list(tmp_path.iterdir()) == []
    write_file(tmp_path / "file", b"whole")
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and (tmp_path / "file").read_bytes() == b"whole"


@pytest.mark.skipif(not POSIX, reason="SIGTERM is sent between processes on POSIX only")
def test_signals_remove_the_partial_and_go_on_to_the_previous_handler(tmp_path: Path) -> None:
    # Ctrl-C: Python's handler raises KeyboardInterrupt, after the partial is gone. Python's own
    # handler is put in place first: a process started in the background by a shell ignores SIGINT.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), writing(tmp_path / "out") as partial:
            (partial / "half").write_text("x")
            signal.raise_signal(signal.SIGINT)
        assert (
            list(tmp_path.iterdir()) == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
    finally:
        signal.signal(signal.SIGINT, before)
    # SIGTERM with a handler of the program's own: it still runs, and is back in place afterwards.
    seen: list[tuple[int, bool]] = []

    def own(signum: int, frame: Any) -> None:
        seen.append((signum, any(tmp_path.iterdir())))

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with writing(tmp_path / "out") as partial:
            signal.raise_signal(signal.SIGTERM)
            assert not partial.exists()
        assert seen == [(signal.SIGTERM, False)] and signal.getsignal(signal.SIGTERM) is own
        # Ignored stays ignored: no handler is installed, the signal does nothing.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with writing(tmp_path / "out") as partial:
            signal.raise_signal(signal.SIGTERM)
            assert partial.is_dir()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(tmp_path.iterdir()) == []


# --- a real merge, stopped ------------------------------------------------------------------------

# The merge, held inside its write (after the weights, before the rename) until it is signalled.
_HELD_MERGE = """
import sys, time
from xpukit.loading import save_merged
real = save_merged.save_tokenizer
def held(source, out):
    real(source, out)
    print("writing", flush=True)
    for _ in range(2400):  # busy in Python, as a writer is: a signal's handler runs within 50 ms
        time.sleep(0.05)
save_merged.save_tokenizer = held
from xpukit.cli.main import main
sys.exit(main(["merge", *sys.argv[1:]]))
"""


def _stopped_merge(base: Path, adapter: Path, out: Path, signum: int) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HELD_MERGE), str(base), str(adapter), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        said = ""
        while not said.endswith("writing\n") and proc.poll() is None:  # until it is inside its write
            said += proc.stdout.readline()
        assert _partials(out.parent), f"the merge writes into a partial folder: {said}"
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, said + stdout, stderr)


@pytest.mark.skipif(not POSIX, reason="SIGTERM is a POSIX signal")
def test_a_merge_stopped_by_sigterm_leaves_no_partial_folder(
    tiny_model: Path,
    perturbed_adapter: Callable[..., Path],
    partial_folder: Callable[..., Path],
    tmp_path: Path,
) -> None:
    adapter = perturbed_adapter(tiny_model, tmp_path / "adapter", quantize=None)
    parent = tmp_path / "models"
    parent.mkdir()
    killed = partial_folder(parent / "merged")  # what a merge killed by SIGKILL leaves
    dead = int(killed.name.split("-")[-2])
    # The next merge into the folder removes it and says so; stopped by SIGTERM in turn, it removes
    # its own partial folder and ends by the signal, as it would without xpukit.
    stopped = _stopped_merge(tiny_model, adapter, parent / "merged", signal.SIGTERM)
    assert stopped.returncode == -signal.SIGTERM, stopped.stderr[-2000:]
    said = " ".join(stopped.stderr.split())
    assert f"xpukit: WARNING: removed 1 half-written copy left in {parent} by an interrupted" in said
    assert f"(process {dead}, no longer running): {killed.name}" in said
    assert list(parent.iterdir()) == []  # no partial, no OUT
