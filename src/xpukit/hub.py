"""The Hugging Face Hub as a capability: is it reachable, and can a Hub kernel be had — in bounded time.

huggingface_hub 2.4 makes some requests with no timeout at all (``list_repo_refs`` in the kernels
library, the publisher trust check), so against an endpoint that accepts connections and never
answers, the flash-attn2 Hub path and ``KernelConfig`` loading hang forever (docs/known-issues.md
"huggingface_hub 2.4: Hub requests without a timeout").
Only ``HF_HUB_OFFLINE=1`` avoided it. xpukit therefore decides reachability itself, before any
Hub-backed choice:

* ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set → offline, no network at all.
* otherwise one ``HEAD`` of ``HF_ENDPOINT`` (default https://huggingface.co) in a daemon thread
  that is waited on for ``XPUKIT_HUB_TIMEOUT`` seconds (default 2, at most 60), DNS included. The
  answer is cached per process and endpoint: a failure for 60 s, a success for an hour.

A kernel can be had when ``kernels`` is installed at a version this transformers accepts and the
kernel is in the local cache or the Hub is reachable. Fetches at load time run under
:func:`run_bounded`; while the Hub is unreachable, :func:`offline_guard` puts huggingface_hub in
offline mode so that nothing it does can wait on the network.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TypeVar

from packaging.version import InvalidVersion, Version

from xpukit import _environ
from xpukit._compat import installed_version, is_installed
from xpukit.errors import InvalidRequestError

__all__ = [
    "DEFAULT_ENDPOINT",
    "DEFAULT_FETCH_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "RECHECK_HINT",
    "HubStatus",
    "KernelsSupport",
    "hub_endpoint",
    "hub_offline",
    "hub_status",
    "kernel_cached",
    "kernels_support",
    "offline_guard",
    "run_bounded",
]

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_TIMEOUT = 2.0  # seconds for the reachability check, DNS included
DEFAULT_FETCH_TIMEOUT = 300.0  # seconds for fetching one Hub kernel at load time

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class HubStatus:
    """Whether the Hub can be used now, and why (or why not)."""

    endpoint: str
    offline: bool
    reachable: bool
    reason: str
    elapsed_s: float = 0.0

    @property
    def usable(self) -> bool:
        """Online and answering: Hub-backed choices may fetch."""
        return not self.offline and self.reachable


# A failed check is kept for a minute only: one slow first answer (DNS + TLS can take > 2 s) must not
# make the whole process offline. A success is kept longer; a load that then cannot reach the Hub
# still runs each fetch under a time bound.
FAILURE_TTL_S = 60.0
SUCCESS_TTL_S = 3600.0
MAX_HUB_TIMEOUT = 60.0
MAX_FETCH_TIMEOUT = 3600.0
RECHECK_HINT = (
    "xpukit checks again after a minute, or at once with xpukit.hub.hub_status(refresh=True); set "
    "HF_HUB_OFFLINE=1 to work from the local cache without checking"
)

_STATUS_CACHE: dict[str, tuple[HubStatus, float]] = {}
_STATUS_LOCK = threading.Lock()


def hub_offline() -> bool:
    """Whether Hub access is switched off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``).

    Also true when huggingface_hub was imported while one of them was set: it read them at import.
    """
    if _environ.flag("HF_HUB_OFFLINE") or _environ.flag("TRANSFORMERS_OFFLINE"):
        return True
    constants = sys.modules.get("huggingface_hub.constants")
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def hub_endpoint() -> str:
    """The Hub endpoint huggingface_hub uses (``HF_ENDPOINT``, else https://huggingface.co)."""
    constants = sys.modules.get("huggingface_hub.constants")
    endpoint = getattr(constants, "ENDPOINT", None) or _environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    return str(endpoint).rstrip("/")


def _seconds(variable: str, default: float, maximum: float) -> float:
    raw = _environ.get(variable)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequestError(
            f"{variable}={raw!r} is not a positive number of seconds (e.g. {default:g}; at most {maximum:g})."
        )
    if value > maximum:
        logger.warning("%s=%s is capped at %g seconds", variable, raw, maximum)
        return maximum
    return value


def hub_timeout() -> float:
    """Seconds the reachability check may take (``XPUKIT_HUB_TIMEOUT``, default 2, at most 60)."""
    return _seconds("XPUKIT_HUB_TIMEOUT", DEFAULT_TIMEOUT, MAX_HUB_TIMEOUT)


def fetch_timeout() -> float:
    """Seconds one Hub kernel fetch may take (``XPUKIT_HUB_FETCH_TIMEOUT``, default 300, at most 3600)."""
    return _seconds("XPUKIT_HUB_FETCH_TIMEOUT", DEFAULT_FETCH_TIMEOUT, MAX_FETCH_TIMEOUT)


def hub_status(*, refresh: bool = False) -> HubStatus:
    """Whether the Hub is offline, reachable or not — decided within ``XPUKIT_HUB_TIMEOUT`` seconds.

    Offline mode answers at once with no network. Otherwise the result of one bounded ``HEAD`` of
    the endpoint is cached per process and endpoint: a failure for :data:`FAILURE_TTL_S` seconds, a
    success for :data:`SUCCESS_TTL_S` (``refresh=True`` checks again now).
    """
    endpoint = hub_endpoint()
    if hub_offline():
        return HubStatus(endpoint=endpoint, offline=True, reachable=False, reason="HF_HUB_OFFLINE is set")
    now = time.monotonic()
    with _STATUS_LOCK:
        cached = _STATUS_CACHE.get(endpoint)
        if not refresh and cached is not None:
            status, at = cached
            if now - at < (SUCCESS_TTL_S if status.reachable else FAILURE_TTL_S):
                return status
    status = _probe(endpoint, hub_timeout())
    with _STATUS_LOCK:
        _STATUS_CACHE[endpoint] = (status, time.monotonic())
    logger.info("Hub %s: %s (%.2f s)", endpoint, status.reason, status.elapsed_s)
    return status


def _probe(endpoint: str, timeout: float) -> HubStatus:
    import urllib.error
    import urllib.request

    start = time.perf_counter()

    def head() -> int:
        request = urllib.request.Request(endpoint + "/", method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:  # an HTTP answer, even an error, means it answers
            return int(exc.code)

    if not endpoint.startswith(("http://", "https://")):
        return HubStatus(
            endpoint=endpoint, offline=False, reachable=False, reason=f"bad endpoint {endpoint!r}"
        )
    try:
        code = run_bounded(head, timeout, f"HEAD {endpoint}")
    except TimeoutError:
        reason = f"no answer from {endpoint} within {timeout:g} s"
        return _status(endpoint, False, reason, start)
    except Exception as exc:  # DNS failure, refused connection, TLS error…: all mean "not reachable"
        detail = getattr(exc, "reason", None) or exc
        return _status(endpoint, False, f"{endpoint} not reachable: {detail}", start)
    if code >= 500:
        return _status(endpoint, False, f"{endpoint} answered HTTP {code}", start)
    return _status(endpoint, True, f"{endpoint} answered HTTP {code}", start)


def _status(endpoint: str, reachable: bool, reason: str, start: float) -> HubStatus:
    return HubStatus(
        endpoint=endpoint,
        offline=False,
        reachable=reachable,
        reason=reason,
        elapsed_s=round(time.perf_counter() - start, 3),
    )


def run_bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Run ``fn`` in a daemon thread and wait at most ``timeout`` seconds for it.

    Returns its result or re-raises its exception; raises :class:`TimeoutError` when it did not
    finish in time. A timed-out call cannot be interrupted: it is abandoned (daemon threads do not
    keep the process alive), which is why only fetches whose result can be thrown away run here.
    """
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"xpukit-bounded: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


@contextlib.contextmanager
def offline_guard(active: bool) -> Iterator[None]:
    """While ``active``, make huggingface_hub behave as with ``HF_HUB_OFFLINE=1``.

    huggingface_hub reads ``HF_HUB_OFFLINE`` once, at import; transformers, kernels and
    bitsandbytes then consult ``huggingface_hub.constants.HF_HUB_OFFLINE`` at call time. Setting it
    for the duration of a load means a Hub that was found unreachable cannot make any of them wait
    forever (``import bitsandbytes`` fetches a kernel on CPUs with avx512_bf16). The previous value
    is restored afterwards; ``os.environ`` is never touched.
    """
    if not active:
        yield
        return
    from huggingface_hub import constants

    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = previous


# ---------------------------------------------------------------------------------------------
# The kernels package, against what this transformers accepts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelsSupport:
    """Whether transformers will use the installed ``kernels`` package, and the fix when not."""

    installed: str | None
    required: str | None  # transformers' specifier, e.g. ">=0.17.2,<0.18"
    transformers: str | None
    accepted: bool
    reason: str


@functools.lru_cache(maxsize=1)
def kernels_support() -> KernelsSupport:
    """Compare the installed ``kernels`` with the range this transformers accepts (no imports).

    Cached per process (``kernels_support.cache_clear()`` re-reads the installed versions).

    transformers treats a kernels release outside its window as not installed and says so
    ("`kernels` is either not installed…", "LayerRepository requires `kernels` to be installed"),
    which misleads when it is installed (docs/known-issues.md "transformers: the kernels version window" and
    docs/known-issues.md "transformers: misleading error messages"). This names the real problem.
    """
    from packaging.requirements import InvalidRequirement, Requirement  # 20 ms: only when asked

    found = installed_version("kernels") if is_installed("kernels") else None
    tf_version = installed_version("transformers")
    required = _transformers_kernels_requirement()
    if found is None:
        return KernelsSupport(
            installed=None,
            required=required,
            transformers=tf_version,
            accepted=False,
            reason='the `kernels` package is not installed (pip install "xpukit[kernels]")',
        )
    if required is None:
        return KernelsSupport(
            installed=found,
            required=None,
            transformers=tf_version,
            accepted=True,
            reason=f"kernels {found} is installed",
        )
    try:
        accepted = Version(found) in Requirement(f"kernels{required}").specifier
    except (InvalidRequirement, InvalidVersion):
        accepted = False
    if accepted:
        reason = f"kernels {found} is installed (transformers {tf_version} accepts kernels{required})"
    else:
        reason = (
            f"kernels {found} is installed, but transformers {tf_version} accepts only kernels{required} "
            f'and treats it as missing. Fix: pip install "kernels{required}"'
        )
    return KernelsSupport(
        installed=found, required=required, transformers=tf_version, accepted=accepted, reason=reason
    )


def _transformers_kernels_requirement() -> str | None:
    # Read from the installed distribution's metadata (the `kernels` extra), not by importing
    # transformers: e.g. 'kernels<0.18,>=0.17.2; extra == "kernels"'.
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirements = metadata.requires("transformers") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "kernels" and req.specifier:
            # Lower bound first: ">=0.17.2,<0.18".
            return ",".join(sorted((str(s) for s in req.specifier), key=lambda s: (not s.startswith(">"), s)))
    return None


# ---------------------------------------------------------------------------------------------
# The local kernel cache (read from disk; no huggingface_hub network code)
# ---------------------------------------------------------------------------------------------


def kernel_cache_dir() -> Path:
    """Where the kernels library keeps Hub kernels (``KERNELS_CACHE``, else the HF Hub cache)."""
    explicit = _environ.get("KERNELS_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    from huggingface_hub import constants  # reads the env at import; no network

    return Path(constants.HF_HUB_CACHE)


def kernel_cached(repo_id: str, *, version: int | None = None, revision: str | None = None) -> bool:
    """Whether a Hub kernel at this version (``refs/v<N>``) or revision (any, if neither) is cached.

    The same lookup the kernels library makes offline (``_get_available_versions_from_cache``), plus
    a check that the snapshot directory it points to exists.
    """
    cache = kernel_cache_dir()
    org_name = repo_id.replace("/", "--")
    for prefix in ("kernels", "models"):  # newer caches use the "kernel" repo type; older "model"
        repo_dir = cache / f"{prefix}--{org_name}"
        if not repo_dir.is_dir():
            continue
        ref = f"v{version}" if version is not None else revision
        if ref is None:  # any version will do (a user mapping that names no version)
            snapshots = repo_dir / "snapshots"
            if snapshots.is_dir() and any(snapshots.iterdir()):
                return True
            continue
        commit = ref
        ref_file = repo_dir / "refs" / ref
        if ref_file.is_file():
            try:
                commit = ref_file.read_text().strip()
            except OSError:
                continue
        if (repo_dir / "snapshots" / commit).is_dir():
            return True
    return False
