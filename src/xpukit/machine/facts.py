"""Facts about devices and the machine: plain frozen data, and the pure rules that classify them.

Nothing here touches torch or the hardware; :mod:`xpukit.machine.probe` reads the machine and
:mod:`xpukit.machine.profiles` holds recorded facts of real devices. The planner decides from these alone,
so every rule can be tested with hand-made facts.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from xpukit.machine.launch import LaunchFacts

__all__ = [
    "BACKENDS",
    "Backend",
    "DeviceFacts",
    "MachineFacts",
    "XpuFamily",
    "classify_xpu",
    "xpu_family_traits",
]

Backend = Literal["xpu", "cuda", "mps", "cpu"]
# The order in which an accelerator is preferred when none is named (design: xpu, cuda, mps, cpu).
BACKENDS: tuple[Backend, ...] = ("xpu", "cuda", "mps", "cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceFacts:
    """What is known about one visible device.

    Attributes:
        backend: the torch device type.
        index: the torch device index (0 for the CPU).
        name: the name the runtime reports.
        family: a coarse family (``arc-a``, ``max``, ``lunar-lake``, ``nvidia``, ``apple``, ``cpu``…)
            that the dtype rules key on; ``intel-unknown`` when an Intel name is not recognised.
        total_memory: bytes of memory the device can use.
        free_memory: bytes free now, or ``None`` when the runtime cannot say (Lunar Lake and Panther
            Lake iGPUs raise on ``mem_get_info``; see docs/platform-notes.md §2.4).
        native_bf16: bf16 runs in hardware (not emulated through fp32).
        fp16: fp16 arithmetic is supported; on a CPU only where it runs natively (AVX512-FP16,
            AMX-FP16, Arm FP16), not where F16C merely converts.
        fp64: fp64 arithmetic is supported (needed by fp16 ``GradScaler``; Arc A-series has none).
        integrated: an integrated GPU sharing system memory.
        compute_capability: CUDA ``(major, minor)``; ``None`` elsewhere.
        device_id: the PCI device id where known (Intel GPUs).
        source: where the facts come from (``detected``, or the profile and its evidence).
        notes: caveats found while reading the device (e.g. capability flags that cannot be trusted).
    """

    backend: Backend
    index: int
    name: str
    family: str
    total_memory: int
    free_memory: int | None
    native_bf16: bool
    fp16: bool = True
    fp64: bool = True
    integrated: bool = False
    compute_capability: tuple[int, int] | None = None
    device_id: int | None = None
    source: str = "detected"
    notes: tuple[str, ...] = ()

    @property
    def torch_device(self) -> str:
        """The torch device string, e.g. ``xpu:0`` (``cpu`` for the CPU)."""
        return "cpu" if self.backend == "cpu" else f"{self.backend}:{self.index}"

    @property
    def free_memory_known(self) -> bool:
        """Whether the runtime can report free memory for this device."""
        return self.free_memory is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (tuples become lists)."""
        data = asdict(self)
        data["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        data["notes"] = list(self.notes)
        return data


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineFacts:
    """What is known about the machine: the torch build, its devices and the environment.

    Attributes:
        torch_version: the installed torch version, ``None`` when torch is not installed.
        torch_xpu: ``torch.version.xpu`` (the SYCL compiler version), ``None`` on non-XPU builds.
        torch_cuda: ``torch.version.cuda``; ``None`` on non-CUDA builds.
        torch_hip: ``torch.version.hip``; ``None`` on non-ROCm builds.
        compiled: the accelerator backends this torch build was compiled with.
        accelerator: the preferred backend that has at least one device (``cpu`` when none).
        devices: the visible accelerator devices of ``accelerator`` (empty on a CPU-only machine).
        cpu: the host CPU as a device.
        env: the environment variables that matter (device selection, Hub access).
        runtime_initialized: whether the accelerator runtime was initialised when the facts were
            read (device-selection variables can no longer change anything in this process).
        xccl_available: ``torch.distributed.is_xccl_available()`` where it could be read.
        source: ``detected`` or the name of the profile.
        notes: caveats met while detecting (e.g. a warning the runtime printed).
        launch: which rank of a launched job this process is (torchrun, accelerate, MPI); ``None``
            when it was not started by a launcher.
    """

    torch_version: str | None
    torch_xpu: str | None = None
    torch_cuda: str | None = None
    torch_hip: str | None = None
    compiled: tuple[Backend, ...] = ()
    accelerator: Backend = "cpu"
    devices: tuple[DeviceFacts, ...] = ()
    cpu: DeviceFacts = field(default_factory=lambda: generic_cpu())
    env: dict[str, str] = field(default_factory=dict)
    runtime_initialized: bool = False
    xccl_available: bool | None = None
    source: str = "detected"
    notes: tuple[str, ...] = ()
    launch: LaunchFacts | None = None

    def __post_init__(self) -> None:
        # A frozen dataclass should not share a caller's mutable dict.
        object.__setattr__(self, "env", dict(self.env))

    @property
    def device_count(self) -> int:
        """Number of visible accelerator devices."""
        return len(self.devices)

    def devices_of(self, backend: str) -> tuple[DeviceFacts, ...]:
        """The visible devices of one backend (the CPU for ``cpu``)."""
        if backend == "cpu":
            return (self.cpu,)
        return tuple(d for d in self.devices if d.backend == backend)

    def with_env(self, env: dict[str, str]) -> MachineFacts:
        """A copy with another environment (for planning under a different selection)."""
        return replace(self, env=env)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; the schema is documented in docs/doctor.md."""
        return {
            "torch_version": self.torch_version,
            "torch_xpu": self.torch_xpu,
            "torch_cuda": self.torch_cuda,
            "torch_hip": self.torch_hip,
            "compiled": list(self.compiled),
            "accelerator": self.accelerator,
            "device_count": self.device_count,
            "devices": [d.to_dict() for d in self.devices],
            "cpu": self.cpu.to_dict(),
            "env": dict(self.env),
            "runtime_initialized": self.runtime_initialized,
            "xccl_available": self.xccl_available,
            "source": self.source,
            "notes": list(self.notes),
            "launch": self.launch.to_dict() if self.launch is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineFacts:
        """Rebuild facts written by :meth:`to_dict` (e.g. a ``doctor --json`` report)."""

        from dataclasses import fields

        from xpukit.errors import InvalidRequestError

        known = {f.name for f in fields(DeviceFacts)}

        def backend(value: object, what: str) -> Backend:
            for known in BACKENDS:
                if value == known:
                    return known
            raise InvalidRequestError(
                f"{what}={value!r} in these facts is not a backend xpukit knows; valid: "
                f"{', '.join(BACKENDS)}. Fix: pass a report written by `xpukit doctor --json`."
            )

        def device(d: dict[str, Any]) -> DeviceFacts:
            # Reports may come from a newer xpukit (keys are added within a schema version):
            # keep what this version knows and say what was dropped.
            extra = sorted(set(d) - known)
            d = {k: v for k, v in d.items() if k in known}
            backend(d.get("backend"), "backend")
            cc = d.get("compute_capability")
            d["compute_capability"] = tuple(cc) if cc else None
            d["notes"] = tuple(d.get("notes", ())) + (
                (f"ignored unknown keys: {', '.join(extra)}",) if extra else ()
            )
            return DeviceFacts(**d)

        return cls(
            torch_version=data["torch_version"],
            torch_xpu=data.get("torch_xpu"),
            torch_cuda=data.get("torch_cuda"),
            torch_hip=data.get("torch_hip"),
            compiled=tuple(backend(b, "compiled") for b in data.get("compiled", ())),
            accelerator=backend(data.get("accelerator", "cpu"), "accelerator"),
            devices=tuple(device(d) for d in data.get("devices", ())),
            cpu=device(data["cpu"]) if "cpu" in data else generic_cpu(),
            env=dict(data.get("env", {})),
            runtime_initialized=bool(data.get("runtime_initialized", False)),
            xccl_available=data.get("xccl_available"),
            source=data.get("source", "detected"),
            notes=tuple(data.get("notes", ())),
            launch=LaunchFacts.from_dict(data["launch"]) if data.get("launch") else None,
        )


def generic_cpu(*, native_bf16: bool = False, total_memory: int = 16 * 2**30) -> DeviceFacts:
    """A CPU device with the given bf16 support (the default when nothing was detected)."""
    return DeviceFacts(
        backend="cpu",
        index=0,
        name="CPU",
        family="cpu",
        total_memory=total_memory,
        free_memory=total_memory,
        native_bf16=native_bf16,
        fp16=False,
        source="assumed",
    )


# ---------------------------------------------------------------------------------------------
#  Intel GPU families (docs/platform-notes.md §3.1–3.2). Decided from the PCI device id first, then from the
# name;
# never from torch.xpu.is_bf16_supported(), which is True on every XPU (docs/platform-notes.md §2.3).
# ---------------------------------------------------------------------------------------------

XpuFamily = Literal[
    "max",
    "flex",
    "arc-a",
    "arc-b",
    "meteor-lake",
    "arrow-lake-h",
    "arrow-lake-s",
    "lunar-lake",
    "panther-lake",
    "intel-unknown",
]


@dataclass(frozen=True, slots=True)
class _FamilyTraits:
    native_bf16: bool
    fp64: bool
    integrated: bool
    free_memory_query: bool  # whether mem_get_info is expected to work


#  native bf16 / fp64 / integrated / free-memory query, per family (docs/platform-notes.md §3.1,
# docs/platform-notes.md §3.4).
_TRAITS: dict[str, _FamilyTraits] = {
    "max": _FamilyTraits(True, True, False, True),
    "flex": _FamilyTraits(True, False, False, True),  # fp64 on Flex: "presumably no (not verified)"
    "arc-a": _FamilyTraits(True, False, False, True),  # has_fp64=0 in real A770 dumps
    "arc-b": _FamilyTraits(True, True, False, True),
    "meteor-lake": _FamilyTraits(False, True, True, False),  # no DPAS: bf16 only emulated
    "arrow-lake-h": _FamilyTraits(True, True, True, False),
    "arrow-lake-s": _FamilyTraits(False, True, True, False),  # plain Xe-LPG, like Meteor Lake
    "lunar-lake": _FamilyTraits(True, True, True, False),  # mem_get_info raises (pytorch#159728)
    "panther-lake": _FamilyTraits(True, True, True, False),  # mem_get_info raises (pytorch#194576)
}

# PCI device ids seen in dumps and Linux/Mesa id tables.
_DEVICE_IDS: dict[str, frozenset[int]] = {
    "max": frozenset({0x0BD0, 0x0BD5, 0x0BD6, 0x0BD7, 0x0BD8, 0x0BD9, 0x0BDA, 0x0BDB}),
    "flex": frozenset({0x56C0, 0x56C1, 0x56C2}),
    "arc-a": frozenset(
        {
            0x5690,
            0x5691,
            0x5692,
            0x5693,
            0x5694,
            0x5695,
            0x5696,
            0x5697,
            0x56A0,
            0x56A1,
            0x56A2,
            0x56A3,
            0x56A4,
            0x56A5,
            0x56A6,
            0x56B0,
            0x56B1,
            0x56B2,
            0x56B3,
        }
    ),
    "arc-b": frozenset({0xE202, 0xE20B, 0xE20C, 0xE20D, 0xE210, 0xE211, 0xE212, 0xE216}),
    "meteor-lake": frozenset({0x7D40, 0x7D45, 0x7D55, 0x7D60, 0x7DD5}),
    "arrow-lake-h": frozenset({0x7D51, 0x7DD1}),
    "arrow-lake-s": frozenset({0x7D41, 0x7D67, 0xB640}),
    "lunar-lake": frozenset({0x6420, 0x64A0, 0x64B0}),
    "panther-lake": frozenset({0xB080, 0xB081, 0xB082, 0xB083, 0xB08F, 0xB090}),
}

_NAME_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Panther Lake's iGPU is sold as "Arc B390/B370": test it before the discrete Arc B pattern.
    ("panther-lake", re.compile(r"Panther Lake|Arc\W*(\(TM\))?\s*B3[79]0", re.I)),
    ("max", re.compile(r"Data Center GPU Max|Ponte Vecchio", re.I)),
    ("flex", re.compile(r"Data Center GPU Flex", re.I)),
    ("arc-b", re.compile(r"Arc\W*(\(TM\))?\s*(Pro\s+)?B\d{2,3}", re.I)),
    ("arc-a", re.compile(r"Arc\W*(\(TM\))?\s*(Pro\s+)?A\d{2,3}", re.I)),
    ("lunar-lake", re.compile(r"Arc\W*(\(TM\))?\s*1[34]0V|Lunar Lake", re.I)),
    ("arrow-lake-h", re.compile(r"Arc\W*(\(TM\))?\s*1[34]0T|Arrow Lake-H", re.I)),
    ("meteor-lake", re.compile(r"Meteor Lake", re.I)),
)


def classify_xpu(name: str, device_id: int | None = None) -> str:
    """The family of an Intel GPU, from its PCI device id (preferred) or its name."""
    if device_id is not None:
        for family, ids in _DEVICE_IDS.items():
            if device_id in ids:
                return family
    for family, pattern in _NAME_PATTERNS:
        if pattern.search(name):
            return family
    return "intel-unknown"


def xpu_family_traits(family: str) -> tuple[bool, bool, bool, bool] | None:
    """``(native_bf16, fp64, integrated, free_memory_query)`` for a known family, else ``None``."""
    traits = _TRAITS.get(family)
    if traits is None:
        return None
    return (traits.native_bf16, traits.fp64, traits.integrated, traits.free_memory_query)
