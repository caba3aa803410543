"""Which compiled-kernel caches a variant's process starts with (``--kernel-caches``).

Triton writes each kernel it compiles to a cache on disk (``TRITON_CACHE_DIR``, by default under
``~/.triton``) and inductor its compiled graphs (``TORCHINDUCTOR_CACHE_DIR``); a later process reads
them instead of compiling. Children sharing the machine's caches are not compared fairly: the first
process to use a kernel compiles it and every later one reads it, so whichever variant runs first
pays for the others. On an H100 and an H200 (2026-12-06, docs/benchmarks.md "Captures, part by
part") two settings of the same code swapped places with the process order: the first process's
first capture spent 1.45 s compiling against 0.36–0.39 s, its first 20 steps half as fast.

    own     each variant its own caches, kept from round to round: every variant compiles in its
            first process (round 0 is each one's first run) and reads its own kernels after
    empty   every process starts with empty caches (a first run's compile, every round)
    shared  the machine's caches, as a user's processes share them (the order decides who compiles)
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

KERNEL_CACHES = ("own", "empty", "shared")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kernel-caches`` and ``--kernel-cache-dir`` (the module docstring)."""
    parser.add_argument(
        "--kernel-caches",
        choices=KERNEL_CACHES,
        default="own",
        help="compiled-kernel caches per child: own (per variant, kept across rounds), empty, shared",
    )
    parser.add_argument(
        "--kernel-cache-dir",
        help="with own: where each variant's caches live (kept, so rounds run apart find them)",
    )


def fresh_caches(prefix: str) -> dict[str, str]:
    """The environment with empty Triton and inductor caches (a first run's compile)."""
    return _with_caches(Path(tempfile.mkdtemp(prefix=prefix)))


def _with_caches(folder: Path) -> dict[str, str]:
    return dict(
        os.environ, TRITON_CACHE_DIR=str(folder / "triton"), TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor")
    )


def child_caches(mode: str, variant: str, root: Path) -> tuple[dict[str, str] | None, str]:
    """The child's environment (None: this process's) and what its caches held at its start:
    ``own, empty`` / ``own, filled`` / ``empty`` / ``shared``."""
    if mode == "shared":
        return None, "shared"
    if mode == "empty":
        return fresh_caches("xpukit-bench-caches-"), "empty"
    if mode != "own":
        raise ValueError(f"--kernel-caches {mode!r}: choose from {', '.join(KERNEL_CACHES)}")
    folder = root / variant.replace("/", "_")
    filled = folder.is_dir() and any(folder.rglob("*"))
    folder.mkdir(parents=True, exist_ok=True)
    return _with_caches(folder), "own, filled" if filled else "own, empty"
