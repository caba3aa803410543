"""torch's compile caches for the decode step, kept under xpukit's cache dir across processes.

torch.compile already caches inductor's FX graphs and AOT-autograd graphs on disk
(``torch._inductor.config.fx_graph_cache``, ``torch._functorch.config.enable_autograd_cache``, both
on by default), under a per-user temporary directory that a reboot or a fresh container loses. The
"mega-cache" (``torch.compiler.save_cache_artifacts()`` / ``load_cache_artifacts()``) serialises
every artifact compiled in this process into one blob; xpukit writes that blob to
``<xpukit cache>/compile/<key>.bin`` after a new graph compiled and loads it before the graph is
first needed, so that a second process's first call hits the caches (docs/decode-internals.md
"Compile cache"). The blob holds every artifact torch registers with the mega-cache: inductor's FX
graphs with their compiled Triton kernels bundled in (``bundle_triton_into_fx_graph_cache``, on by
default), AOT-autograd's graphs, autotuning results and dynamo's profile-guided shapes; dynamo's own
trace is not among them (only torch's experimental ``caching_precompile`` adds it), so it runs again.
``os.environ`` is never changed: no ``TORCHINDUCTOR_CACHE_DIR``.

The key hashes what makes a graph differ (the model config, dtype, device name and compute
capability, torch / triton / transformers / torchao / bitsandbytes / xpukit versions, the weights'
format and whether projections are fused, batch size, cache length, step, compile settings): a
blob is only ever loaded where it was made. torch checks its own artifacts again on every hit, so
a wrong blob costs a miss, not a wrong result. A cache dir that cannot be written (read-only, full)
is recorded, never raised.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

from xpukit import _environ, _platform
from xpukit._partial import write_file

if TYPE_CHECKING:
    from xpukit.loading.decode.interfaces import DecodeModel

__all__ = [
    "CACHE_FORMAT",
    "CompileRecord",
    "cache_key",
    "compile_cache_dir",
    "key_fields",
    "load_artifacts",
    "model_key",
    "save_artifacts",
]

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when the decode step's code changes what it compiles
# Config entries that name the checkpoint, not the graph.
_IGNORED_CONFIG = {"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"}


class CompileRecord(TypedDict, total=False):
    """What the compile cache did for one compiled decode step (an entry of ``loop.cache_records``).

    :func:`load_artifacts` and :func:`save_artifacts` give the blob's ``path``, whether it was
    ``loaded`` / ``saved``, its ``bytes``, how many ``artifacts`` torch took or gave, or the ``error``;
    the loop adds the step's ``batch`` and ``step`` kind. A step built ahead of time (docs/decode.md
    "Tiered decoding") says ``how`` (``loaded`` from ``<key>.step``, else ``compiled``), its
    ``seconds``, and a ``load_error`` / ``save_error`` / ``error``.
    """

    batch: int
    step: str
    path: str
    loaded: bool
    saved: bool
    bytes: int
    artifacts: int | None
    how: Literal["loaded", "compiled"]
    seconds: float
    error: str
    load_error: str
    save_error: str


def compile_cache_dir() -> Path:
    """``$XPUKIT_CACHE_DIR/compile``, else ``<user cache dir>/xpukit/compile`` (docs/env.md)."""
    root = _environ.get("XPUKIT_CACHE_DIR")
    return (Path(root).expanduser() if root else _platform.cache_dir()) / "compile"


def key_fields(
    model_config: Mapping[str, object],
    *,
    dtype: str,
    device_name: str,
    batch_size: int,
    cache_len: int,
    step: str,
    compile_options: Mapping[str, object],
    versions: dict[str, str] | None = None,
    weights: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Everything the compile-cache key depends on, as a JSON-able dict.

    Args:
        model_config: ``model.config.to_dict()`` (checkpoint names are dropped).
        dtype: the model's dtype (``bfloat16``).
        device_name: the accelerator's name (``NVIDIA H200``).
        batch_size: the batch size the graph is compiled for.
        cache_len: the static cache length.
        step: which decode step (``greedy``, ``sample-k50-p``: the sampling settings that shape it).
        compile_options: the ``torch.compile`` keyword arguments (a backend is named by ``repr``).
        versions: torch, triton, transformers, torchao, bitsandbytes, xpukit versions (default: the
            installed ones).
        weights: what the load did to the weights and where they run: their format (``bfloat16``, a
            torchao format), whether q/k/v and gate/up are fused, the device's compute capability.
    """
    config = {k: v for k, v in sorted(model_config.items()) if k not in _IGNORED_CONFIG}
    return {
        "format": CACHE_FORMAT,
        "config": config,
        "dtype": dtype,
        "device": device_name,
        "batch_size": batch_size,
        "cache_len": cache_len,
        "step": step,
        "compile": {k: v if isinstance(v, (str, int, bool)) else repr(v) for k, v in compile_options.items()},
        "versions": versions if versions is not None else _versions(),
        "weights": dict(sorted((weights or {}).items())),
    }


def model_key(
    model: DecodeModel,
    *,
    batch: int,
    step: str,
    cache_len: int,
    compile_options: Mapping[str, object],
    weights: Mapping[str, object],
) -> str:
    """:func:`cache_key` of a loaded model's decode step (its config, dtype and device read here)."""
    import torch

    device = model.device
    name, capability = device.type, None
    module = getattr(torch, device.type, None)
    if device.type in {"cuda", "xpu"} and module is not None:
        name = module.get_device_name(device)
        capability = repr(module.get_device_capability(device))
    fields = key_fields(
        model.config.to_dict(),
        dtype=str(model.dtype).removeprefix("torch."),
        device_name=name,
        batch_size=batch,
        cache_len=cache_len,
        step=step,
        compile_options=compile_options,
        weights={**weights, "capability": capability},
    )
    return cache_key(fields)


def cache_key(fields: Mapping[str, object]) -> str:
    """A short hex digest of :func:`key_fields`' dict (stable across processes and dict order)."""
    text = json.dumps(fields, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_artifacts(key: str, directory: Path | None = None) -> CompileRecord:
    """Load the blob of ``key`` into torch's compile caches, if there is one.

    Returns:
        What happened: ``{"loaded": bool, "path": str}`` plus ``"error"`` when reading or loading
        failed (the compile then runs cold), or ``"artifacts"`` (how many torch took).
    """
    path = (directory or compile_cache_dir()) / f"{key}.bin"
    record: CompileRecord = {"loaded": False, "path": str(path)}
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return record
    except OSError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        return record
    try:
        import torch

        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as exc:  # a blob of another torch, or a torch without the mega-cache
        record["error"] = f"{type(exc).__name__}: {exc}"
        logger.info("compile cache %s not loaded: %s", path, record["error"])
        return record
    record["loaded"] = info is not None
    record["artifacts"] = _count(info)
    return record


def save_artifacts(key: str, directory: Path | None = None) -> CompileRecord:
    """Write what this process compiled so far to the blob of ``key`` (atomically).

    Returns:
        ``{"saved": bool, "path": str}``, plus ``"bytes"`` and ``"artifacts"`` when saved, or
        ``"error"`` when the directory cannot be written (read-only, full) or torch had nothing.
    """
    path = (directory or compile_cache_dir()) / f"{key}.bin"
    record: CompileRecord = {"saved": False, "path": str(path)}
    try:
        import torch

        result = torch.compiler.save_cache_artifacts()
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        return record
    if result is None:
        record["error"] = "torch recorded no compile artifacts"
        return record
    blob, info = result
    try:
        write_file(path, blob)  # whole or not at all (xpukit._partial)
    except OSError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        logger.info("compile cache not written to %s: %s", path, record["error"])
        return record
    record.update({"saved": True, "bytes": len(blob), "artifacts": _count(info)})
    return record


def _count(info: object) -> int | None:
    artifacts = getattr(info, "artifacts", None)
    if not isinstance(artifacts, dict):
        return None
    return sum(len(v) for v in artifacts.values())


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in (
        "torch",
        "triton",
        "pytorch-triton-xpu",
        "transformers",
        "torchao",
        "bitsandbytes",
        "kernels",  # transformers routes some functions through it when installed (a traced module)
        "xpukit",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out
