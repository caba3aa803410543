"""Recorded facts of real devices, for planning on hardware this machine does not have.

Values come from property dumps and specifications cited in docs/platform-notes.md §2.2 and §3.1 (the
``source`` of each profile names its evidence). They drive the planner's tests and
``xpukit plan --assume NAME[xN]``; they are facts about a device, not a claim that xpukit ran there.
"""

from __future__ import annotations

import re
from dataclasses import replace

from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import DeviceFacts, MachineFacts

__all__ = ["PROFILES", "device_profile", "machine_profile", "parse_assume", "profile_names"]

MiB = 2**20
GiB = 2**30


def _xpu(
    name: str,
    family: str,
    device_id: int,
    total: int,
    *,
    native_bf16: bool = True,
    fp64: bool = True,
    integrated: bool = False,
    free_query: bool = True,
    source: str,
    notes: tuple[str, ...] = (),
) -> DeviceFacts:
    return DeviceFacts(
        backend="xpu",
        index=0,
        name=name,
        family=family,
        total_memory=total,
        # A freshly started process sees nearly all memory free; iGPUs cannot be asked at all.
        free_memory=total if free_query else None,
        native_bf16=native_bf16,
        fp16=True,
        fp64=fp64,
        integrated=integrated,
        device_id=device_id,
        source=source,
        notes=notes,
    )


def _cuda(name: str, cc: tuple[int, int], total: int, *, source: str) -> DeviceFacts:
    return DeviceFacts(
        backend="cuda",
        index=0,
        name=name,
        family="nvidia",
        total_memory=total,
        free_memory=total,
        native_bf16=cc >= (8, 0),
        fp16=True,
        fp64=True,
        compute_capability=cc,
        source=source,
    )


PROFILES: dict[str, DeviceFacts] = {
    # --- Intel Data Center -------------------------------------------------------------------
    "max-1550": _xpu(
        "Intel(R) Data Center GPU Max 1550",
        "max",
        0x0BD5,
        64 * GiB,
        source="spec: 128 GB HBM2e over 2 stacks; FLAT hierarchy (default on Xe-HPC) exposes each "
        "stack as one ~64 GB device (docs/platform-notes.md §1.1)",
        notes=("one of two stacks of one card (FLAT mode)",),
    ),
    "max-1100": _xpu(
        "Intel(R) Data Center GPU Max 1100",
        "max",
        0x0BDA,
        49136 * MiB,
        source="property dump intel/torch-xpu-ops#4397: total_memory 49136 MB, has_fp64=1",
    ),
    # --- Intel Arc discrete ------------------------------------------------------------------
    "arc-a770": _xpu(
        "Intel(R) Arc(TM) A770 Graphics",
        "arc-a",
        0x56A0,
        15473 * MiB,
        fp64=False,
        source="property dump stas00/ml-engineering#107 (torch 2.7): total_memory 15473 MB, has_fp64=0",
    ),
    "arc-b580": _xpu(
        "Intel(R) Arc(TM) B580 Graphics",
        "arc-b",
        0xE20B,
        12 * GiB,
        source="spec: 12 GB GDDR6 (docs/platform-notes.md §3.1)",
    ),
    "arc-pro-b60": _xpu(
        "Intel(R) Arc(TM) Pro B60 Graphics",
        "arc-b",
        0xE211,
        24480 * MiB,
        source="property dump intel/torch-xpu-ops#5187: total_memory 24480 MB",
    ),
    # --- Intel integrated --------------------------------------------------------------------
    "lunar-lake": _xpu(
        "Intel(R) Arc(TM) 140V GPU (16GB)",
        "lunar-lake",
        0x64A0,
        16 * GiB,
        integrated=True,
        free_query=False,
        source="pytorch#159728 (device 0x64a0: mem_get_info raises); 16 GB on package, shared",
    ),
    "meteor-lake": _xpu(
        "Intel(R) Arc(TM) Graphics",
        "meteor-lake",
        0x7D55,
        16 * GiB,
        native_bf16=False,
        integrated=True,
        free_query=False,
        source="intel-xpu-backend-for-triton#1888 dump: has_bf16_conversion false, no DPAS, "
        "has_fp64 true; shared system memory (16 GB assumed)",
    ),
    # --- NVIDIA ------------------------------------------------------------------------------
    "h100": _cuda(
        "NVIDIA H100 80GB HBM3", (9, 0), 81559 * MiB, source="spec: 80 GB HBM3, compute capability 9.0"
    ),
    "h200": _cuda(
        "NVIDIA H200",
        (9, 0),
        143771 * MiB,
        source="nvidia-smi on a real H200: 143771 MiB, compute capability 9.0",
    ),
    "t4": _cuda(
        "Tesla T4",
        (7, 5),
        15360 * MiB,
        source="spec: 16 GB GDDR6 (15360 MiB usable), compute capability 7.5 (no bf16)",
    ),
    # --- Apple -------------------------------------------------------------------------------
    "apple-m2": DeviceFacts(
        backend="mps",
        index=0,
        name="Apple M2",
        family="apple",
        total_memory=16 * GiB,
        free_memory=None,
        native_bf16=False,
        fp16=True,
        fp64=False,
        integrated=True,
        source="spec: unified memory (16 GB model); MPS has no fp64",
    ),
    # --- CPU ---------------------------------------------------------------------------------
    "cpu-bf16": DeviceFacts(
        backend="cpu",
        index=0,
        name="Intel(R) Xeon(R) (Sapphire Rapids, avx512_bf16+amx)",
        family="cpu",
        total_memory=24 * GiB,
        free_memory=24 * GiB,
        native_bf16=True,
        fp16=True,  # Sapphire Rapids has AVX512-FP16 and AMX (docs/platform-notes.md §3.5)
        source="a 2-vCPU Sapphire Rapids machine we measured on: avx512_bf16, avx512_fp16 and AMX, 24 GiB",
    ),
    "laptop-16g": DeviceFacts(
        backend="cpu",
        index=0,
        name="laptop CPU with 16 GB shared with its integrated GPU (no avx512_bf16)",
        family="cpu",
        total_memory=16 * GiB,
        # Free memory on a laptop depends on what else runs: left unknown, so the shared-memory
        # fraction applies, the same pool the integrated GPU draws from.
        free_memory=None,
        native_bf16=False,
        fp16=False,
        source="the host of the lunar-lake, meteor-lake and apple-m2 profiles: 16 GB of memory that "
        "the CPU and the integrated GPU share (Lunar Lake and Meteor Lake CPUs have no avx512_bf16)",
    ),
    "cpu": DeviceFacts(
        backend="cpu",
        index=0,
        name="x86-64 CPU (AVX2, no native bf16)",
        family="cpu",
        total_memory=16 * GiB,
        free_memory=16 * GiB,
        native_bf16=False,
        fp16=False,  # F16C converts; it does not compute fp16
        source="a CPU without avx512_bf16/amx_bf16/avx512_fp16 (AMD Zen 3, Intel before Cooper Lake)",
    ),
}


def profile_names() -> list[str]:
    """The names accepted by :func:`device_profile` and ``--assume``."""
    return sorted(PROFILES)


def device_profile(name: str, index: int = 0) -> DeviceFacts:
    """The recorded facts of one device, at a given index."""
    try:
        facts = PROFILES[name]
    except KeyError:
        raise InvalidRequestError(
            f"Unknown device profile {name!r}. Valid profiles: {', '.join(profile_names())}."
        ) from None
    return replace(facts, index=index)


def parse_assume(spec: str) -> tuple[str, int]:
    """Split ``NAME[xN]`` (e.g. ``max-1550x2``) into the profile name and the device count."""
    match = re.fullmatch(r"(?P<name>[a-z0-9-]+?)(?:x(?P<count>\d+))?", spec.strip().lower())
    if not match or match["name"] not in PROFILES:
        raise InvalidRequestError(
            f"--assume {spec!r} does not name a profile. Use NAME or NAMExN, e.g. 'arc-b580' or "
            f"'max-1550x2'. Valid names: {', '.join(profile_names())}."
        )
    count = int(match["count"] or 1)
    if count < 1:
        raise InvalidRequestError(f"--assume {spec!r}: the device count must be at least 1.")
    return match["name"], count


# Cards that show up as several torch devices: a Max 1550 has two stacks, and FLAT mode (the
# default on Xe-HPC) makes each stack one device (docs/platform-notes.md §1.1).
STACKS = {"max-1550": 2}


# The host of each profile whose GPU shares the machine's memory: the same 16 GB, not a server's
# 24 GiB beside it (docs/platform-notes.md §2.5: integrated GPUs and Apple silicon have one memory pool).
HOSTS = {"lunar-lake": "laptop-16g", "meteor-lake": "laptop-16g", "apple-m2": "laptop-16g"}
DEFAULT_HOST = "cpu-bf16"


def machine_profile(name: str, count: int = 1, *, cpu: str | None = None) -> MachineFacts:
    """Facts of a machine with ``count`` cards of one profile (and a CPU profile as host).

    ``cpu`` names the host's profile; by default the laptop host (``laptop-16g``) for the
    integrated GPUs and Apple silicon, whose memory it shares, else ``cpu-bf16``.

    ``count`` counts cards: ``machine_profile("max-1550")`` is one card, i.e. two ~64 GB devices
    in FLAT mode, and ``"max-1550x2"`` is two cards, four devices. A CPU profile gives a CPU-only
    machine. The torch build is described as a recent one with the matching backend compiled in.
    """
    if "x" in name and name not in PROFILES:
        name, count = parse_assume(name)
    device = device_profile(name)
    count *= STACKS.get(name, 1)
    if device.backend == "cpu":
        return MachineFacts(torch_version="2.13.0", cpu=device, source=f"profile:{name}")
    devices = tuple(replace(device, index=i) for i in range(count))
    return MachineFacts(
        torch_version="2.13.0",
        torch_xpu="20250300" if device.backend == "xpu" else None,
        torch_cuda="13.0" if device.backend == "cuda" else None,
        compiled=(device.backend,),
        accelerator=device.backend,
        devices=devices,
        cpu=device_profile(cpu or HOSTS.get(name, DEFAULT_HOST)),
        xccl_available=True if device.backend == "xpu" else None,
        source=f"profile:{name}x{count // STACKS.get(name, 1)}"
        if count > STACKS.get(name, 1)
        else f"profile:{name}",
    )
