"""The host CPU as facts: its name, native bf16 / fp16 arithmetic and memory.

Read from ``/proc/cpuinfo`` and ``/proc/meminfo`` (Linux; through :mod:`xpukit._platform`, which also
reads Windows' memory) or ``sysctl`` (macOS); the flags can be replaced with ``XPUKIT_CPU_FLAGS``
(docs/env.md). :func:`xpukit.machine.probe.detect` reads the CPU with :func:`cpu_facts`.
"""

from __future__ import annotations

import platform
import subprocess

from xpukit import _environ, _platform
from xpukit.machine.facts import DeviceFacts

__all__ = [
    "CPU_BF16_FLAGS",
    "CPU_FLAGS_VARIABLE",
    "CPU_FP16_FLAGS",
    "cpu_facts",
    "cpu_facts_from_flags",
    "host_memory",
]

# What a CPU computes natively (docs/platform-notes.md §3.5): bf16 arithmetic is
# AVX512-BF16 / AMX-BF16 on x86 and the BF16 extension on Arm; fp16 arithmetic is AVX512-FP16 /
# AMX-FP16 on x86 and FEAT_FP16 ("fphp"/"asimdhp") on Arm. F16C only converts between fp16 and fp32,
# so a CPU with F16C alone computes fp16 through fp32: not native.
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPU_FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
# XPUKIT_CPU_FLAGS replaces the flags read from the machine (docs/env.md): what xpukit would decide on
# another CPU, and what makes the test suite independent of the CPU it runs on.
CPU_FLAGS_VARIABLE = "XPUKIT_CPU_FLAGS"


def cpu_facts() -> DeviceFacts:
    """The host CPU: its name, native bf16 / fp16 arithmetic and memory (``XPUKIT_CPU_FLAGS`` overrides
    the flags read from ``/proc/cpuinfo``)."""
    name, flags = _cpu_name_and_flags()
    override = _environ.get(CPU_FLAGS_VARIABLE)
    if override is not None:
        flags = set(override.replace(",", " ").split())
    total, free = host_memory()
    return cpu_facts_from_flags(name, flags, total_memory=total, free_memory=free)


def cpu_facts_from_flags(
    name: str, flags: set[str] | frozenset[str], *, total_memory: int, free_memory: int | None
) -> DeviceFacts:
    """CPU facts from its feature flags (as ``/proc/cpuinfo`` lists them); pure.

    ``fp16`` is True only where the CPU computes fp16 natively (AVX512-FP16, AMX-FP16, Arm FP16),
    not where it can only convert (F16C).
    """
    lowered = {f.lower() for f in flags}
    return DeviceFacts(
        backend="cpu",
        index=0,
        name=name,
        family="cpu",
        total_memory=total_memory,
        free_memory=free_memory,
        native_bf16=bool(lowered & CPU_BF16_FLAGS),
        fp16=bool(lowered & CPU_FP16_FLAGS),
        fp64=True,
    )


def _cpu_name_and_flags() -> tuple[str, set[str]]:
    cpuinfo = _platform.cpuinfo_text()
    if cpuinfo is not None:
        name, flags = platform.processor() or "CPU", set()
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "model name" and name in {"", "CPU", platform.processor()}:
                name = value.strip()
            elif key in {"flags", "features"}:  # x86 "flags", aarch64 "Features"
                flags |= set(value.split())
        return name, flags
    if _platform.system() == "macos":
        brand = _sysctl("machdep.cpu.brand_string") or "Apple CPU"
        bf16 = _sysctl("hw.optional.arm.FEAT_BF16") == "1"
        return brand, {"bf16"} if bf16 else set()
    return platform.processor() or "CPU", set()


def _sysctl(key: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def host_memory() -> tuple[int, int]:
    """The host's physical memory: (total, free) bytes."""
    return _platform.physical_memory()  # /proc/meminfo, GlobalMemoryStatusEx or sysconf
