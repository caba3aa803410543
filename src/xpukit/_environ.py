"""The one place xpukit reads environment variables (ruff bans ``os.getenv`` elsewhere).

Variables are read at call time, never cached at import, so a launcher that sets them later is seen.
docs/env.md lists every variable that matters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RELEVANT_PREFIXES", "RELEVANT_VARIABLES", "flag", "get", "relevant"]

# Variables that change which devices a process sees, or how the Hub is reached.
RELEVANT_VARIABLES = (
    "ZE_AFFINITY_MASK",
    "ZE_FLAT_DEVICE_HIERARCHY",
    "ZE_ENABLE_PCI_ID_DEVICE_ORDER",
    "ONEAPI_DEVICE_SELECTOR",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "HIP_VISIBLE_DEVICES",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "HF_HUB_OFFLINE",
    "HF_ENDPOINT",
    "HF_HOME",
    "USE_HUB_KERNELS",
    "UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS",
    "XPUKIT_HUB_TIMEOUT",
    "XPUKIT_HUB_FETCH_TIMEOUT",
    "XPUKIT_CACHE_DIR",
    "XPUKIT_CPU_FLAGS",
    "KERNELS_CACHE",
    "TRANSFORMERS_OFFLINE",
    "WORLD_SIZE",
)
RELEVANT_PREFIXES = ("ZE_", "ZES_", "UR_", "CCL_", "ONEAPI_", "SYCL_", "CUDA_", "PYTORCH_")


def get(name: str, default: str | None = None, *, environ: Mapping[str, str] | None = None) -> str | None:
    """Read one variable from ``environ`` (default: ``os.environ``)."""
    return (os.environ if environ is None else environ).get(name, default)


def flag(name: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Read a boolean variable the way huggingface_hub does (1/true/yes/on, any case)."""
    value = get(name, environ=environ)
    return value is not None and value.strip().lower() in {"1", "true", "yes", "on"}


def relevant(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that matter to device selection and Hub access, as currently set."""
    env = os.environ if environ is None else environ
    out = {k: env[k] for k in RELEVANT_VARIABLES if k in env}
    out.update({k: v for k, v in env.items() if k.startswith(RELEVANT_PREFIXES)})
    return dict(sorted(out.items()))
