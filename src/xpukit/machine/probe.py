"""Reading the machine: the only impure part of deciding.

What :func:`detect` touches, in order (docs/platform-notes.md §1–2):

1. Build facts: ``torch.version.{xpu,cuda,hip}``, ``torch.xpu._is_compiled()``,
   ``torch.backends.mps.is_built()``, ``torch.{xpu,cuda}.is_initialized()``. None of these
   initialises a device runtime.
2. Only with ``devices=True`` (the default), and only for backends compiled into this build:
   ``device_count()``, ``get_device_properties(i)`` and ``mem_get_info(i)``. These **initialise the
   runtime**: on XPU with torch <= 2.12 the Level Zero driver then reads ``ZE_AFFINITY_MASK`` and
   friends once for the whole process. Settle device selection (``xpukit launch`` or
   :meth:`xpukit.DeviceSelection.apply`) before calling it.
3. The CPU (:mod:`xpukit.machine.cpu`), from ``/proc/cpuinfo`` and ``/proc/meminfo`` (Linux; through
   :mod:`xpukit._platform`, which also reads Windows' memory) or ``sysctl`` (macOS); the flags can
   be replaced with ``XPUKIT_CPU_FLAGS`` (docs/env.md).

``torch.xpu.is_bf16_supported()`` is never used as a hardware fact: it is True on every XPU.
"""

from __future__ import annotations

import contextlib
import platform
import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from xpukit import _environ, _platform
from xpukit._compat import installed_version
from xpukit.errors import XpukitError
from xpukit.machine.cpu import CPU_FLAGS_VARIABLE, cpu_facts, cpu_facts_from_flags, host_memory
from xpukit.machine.facts import BACKENDS, Backend, DeviceFacts, MachineFacts, classify_xpu, xpu_family_traits
from xpukit.machine.launch import LAUNCH_VARIABLES, LaunchFacts, parse_launch

if TYPE_CHECKING:
    import types

__all__ = [
    "CPU_FLAGS_VARIABLE",
    "cpu_facts",
    "cpu_facts_from_flags",
    "detect",
    "intel_display_devices",
    "runtime_initialized",
    "xpu_device_facts",
]


def detect(*, devices: bool = True) -> MachineFacts:
    """Read the facts of this machine.

    Args:
        devices: also enumerate accelerator devices (initialises the runtime; see the module
            docstring). With ``False`` only the build, the CPU and the environment are read.

    Returns:
        The machine's facts. A machine without torch gives ``torch_version=None``.
    """
    env = _environ.relevant()
    cpu = cpu_facts()
    if installed_version("torch") is None:
        launch, note = launch_facts()
        notes_ = ("torch is not installed", *note)
        return MachineFacts(torch_version=None, cpu=cpu, env=env, notes=notes_, launch=launch)
    import torch

    compiled = _compiled_backends(torch)
    initialized = runtime_initialized()
    notes: list[str] = []
    found: dict[Backend, tuple[DeviceFacts, ...]] = {}
    if devices:
        _mark_devices_read(compiled)
        for backend in compiled:
            with _captured_warnings(notes):
                try:
                    found[backend] = _READERS[backend](torch)
                except Exception as exc:  # a broken driver must give a report, not a traceback
                    notes.append(f"{backend} device enumeration failed: {type(exc).__name__}: {exc}")
                    found[backend] = ()
    accelerator: Backend = next((b for b in BACKENDS if found.get(b)), "cpu")
    launch, launch_note = launch_facts()
    return MachineFacts(
        torch_version=torch.__version__,
        torch_xpu=getattr(torch.version, "xpu", None),
        torch_cuda=torch.version.cuda,
        torch_hip=getattr(torch.version, "hip", None),
        compiled=compiled,
        accelerator=accelerator,
        devices=found.get(accelerator, ()) if accelerator != "cpu" else (),
        cpu=cpu,
        env=env,
        runtime_initialized=initialized,
        xccl_available=_xccl_available(torch),
        notes=tuple(notes) + launch_note,
        launch=launch,
    )


# Backends whose devices this process has enumerated through detect(devices=True): on XPU with
# torch <= 2.12 (or without pyzes) that initialises Level Zero without setting is_initialized().
_DEVICES_READ: set[str] = set()


def launch_facts() -> tuple[LaunchFacts | None, tuple[str, ...]]:
    """This process's rank facts from the launcher's variables; malformed ones become a note."""
    variables = {n: v for n in LAUNCH_VARIABLES if (v := _environ.get(n)) is not None}
    try:
        return parse_launch(variables), ()
    except XpukitError as exc:  # detect() reports; planning with these facts plans a single process
        return None, (str(exc),)


def _mark_devices_read(backends: tuple[Backend, ...]) -> None:
    _DEVICES_READ.update(backends)


def runtime_initialized() -> bool:
    """Whether an XPU or CUDA runtime has (probably) read its device variables in this process.

    Never imports torch. True when ``torch.{xpu,cuda}.is_initialized()`` says so, and also after the
    touches that read ``ZE_*`` / ``CUDA_*`` without setting that flag (docs/platform-notes.md §1.4):
    xpukit's own device enumeration, transformers' cached ``is_torch_xpu_available()`` /
    accelerate's ``is_xpu_available()`` having run, or transformers' SDPA integration imported —
    each counted only when this torch build has the matching backend compiled in.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    for name in ("xpu", "cuda"):
        module = getattr(torch, name, None)
        check = getattr(module, "is_initialized", None)
        if check is not None and check():
            return True
    compiled = _compiled_backends(torch)
    if _DEVICES_READ & set(compiled):
        return True
    if "xpu" in compiled:
        if "transformers.integrations.sdpa_attention" in sys.modules:
            return True
        for module_name, function in (
            ("transformers.utils.import_utils", "is_torch_xpu_available"),
            ("accelerate.utils.imports", "is_xpu_available"),
        ):
            cached = getattr(sys.modules.get(module_name), function, None)
            info = getattr(cached, "cache_info", None)
            if info is not None and info().currsize > 0:
                return True
    return False


def intel_display_devices() -> list[tuple[str, str]]:
    """Every Intel display controller on the PCI bus, in PCI order; touches no GPU runtime.

    Read from sysfs (Linux); other systems give an empty list.

    Returns:
        ``[(PCI address, "8086:<device id>"), ...]``, e.g. ``[("0000:00:02.0", "8086:7d55")]``,
        sorted by address, which is PCI domain/bus/device/function order.
    """
    found = []
    for dev in _platform.pci_device_dirs():
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
            device = (dev / "device").read_text().strip()
        except OSError:
            continue
        if vendor == "0x8086" and klass.startswith("0x03"):  # PCI class 03: display controller
            found.append((dev.name, f"8086:{device.removeprefix('0x')}"))
    return found


def _compiled_backends(torch: types.ModuleType) -> tuple[Backend, ...]:
    compiled: list[Backend] = []
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu._is_compiled():
        compiled.append("xpu")
    if torch.version.cuda or getattr(torch.version, "hip", None):
        compiled.append("cuda")  # ROCm builds use the cuda device type too
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_built():
        compiled.append("mps")
    return tuple(compiled)


@contextlib.contextmanager
def _captured_warnings(notes: list[str]) -> Iterator[None]:
    # The runtime reports a missing driver only as a UserWarning ("Failed to initialize XPU
    # devices..."); keep it as a note so `doctor` can quote it verbatim.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    notes.extend(str(w.message) for w in caught)


def xpu_device_facts(index: int, props: object, free: int | None) -> DeviceFacts:
    """Facts of one XPU from its ``_XpuDeviceProperties`` (pure: tests feed recorded dumps).

    The family comes from the PCI device id or the name. The ``has_*`` capability flags come from an
    ``ocloc`` query that returns False on every failure (pytorch#196074), so all four reading False is
    treated as "unknown", and the family's traits win whenever the family is known.
    """
    name = str(getattr(props, "name", "Intel GPU"))
    device_id = getattr(props, "device_id", None)
    family = classify_xpu(name, device_id)
    flags = {
        key: bool(getattr(props, key, False))
        for key in (
            "has_fp16",
            "has_fp64",
            "has_bfloat16_conversions",
            "has_subgroup_matrix_multiply_accumulate",
        )
    }
    notes: list[str] = []
    flags_known = any(flags.values())
    if not flags_known:
        notes.append("all has_* capability flags read False (ocloc missing?): treated as unknown")
    integrated_prop = getattr(props, "is_integrated_gpu", None)
    traits = xpu_family_traits(family)
    if traits is not None:
        native_bf16, fp64, integrated, _ = traits
    else:
        # Unknown family: trust the flags when they say anything. Without them, an integrated GPU,
        # or one named just "Intel(R) Arc(TM) Graphics" (Meteor Lake and Arrow Lake share it), may
        # lack bf16 hardware (old iGPUs give garbage in bf16, IPEX#711): fp16 is the safe choice.
        # Only an unrecognised discrete card is assumed to have bf16.
        integrated = bool(integrated_prop)
        generic_name = re.fullmatch(r"Intel\(R\) Arc\(TM\) Graphics|Intel\(R\) Graphics.*", name)
        if flags_known:
            native_bf16 = (
                flags["has_subgroup_matrix_multiply_accumulate"] or flags["has_bfloat16_conversions"]
            )
        else:
            native_bf16 = not (integrated or generic_name)
        fp64 = flags["has_fp64"] if flags_known else False
        notes.append(
            f"unrecognised Intel GPU {name!r} (device id {device_id}): traits from "
            + (
                "its capability flags"
                if flags_known
                else "its kind, bf16 " + ("assumed" if native_bf16 else "not assumed")
            )
        )
    if flags_known and traits is not None and flags["has_fp64"] != fp64:
        fp64 = flags["has_fp64"]  # a real dump beats the family table
    if integrated_prop is not None:
        integrated = bool(integrated_prop)
    return DeviceFacts(
        backend="xpu",
        index=index,
        name=name,
        family=family,
        total_memory=int(getattr(props, "total_memory", 0)),
        free_memory=free,
        native_bf16=native_bf16,
        fp16=flags["has_fp16"] or not flags_known,
        fp64=fp64,
        integrated=integrated,
        device_id=device_id,
        notes=tuple(notes),
    )


def _read_xpu(torch: types.ModuleType) -> tuple[DeviceFacts, ...]:
    out = []
    for i in range(torch.xpu.device_count()):
        props = torch.xpu.get_device_properties(i)
        try:
            free: int | None = int(torch.xpu.mem_get_info(i)[0])
        except (RuntimeError, AttributeError, NotImplementedError):
            free = None  # iGPUs raise "doesn't support querying the available free memory"
        out.append(xpu_device_facts(i, props, free))
    return tuple(out)


def _read_cuda(torch: types.ModuleType) -> tuple[DeviceFacts, ...]:
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        cc = (int(props.major), int(props.minor))
        try:
            free: int | None = int(torch.cuda.mem_get_info(i)[0])
        except RuntimeError:
            free = None
        hip = bool(getattr(torch.version, "hip", None))
        out.append(
            DeviceFacts(
                backend="cuda",
                index=i,
                name=str(props.name),
                family="amd" if hip else "nvidia",
                total_memory=int(props.total_memory),
                free_memory=free,
                # bf16 in hardware from Ampere (8.0); is_bf16_supported() also counts emulation.
                native_bf16=cc >= (8, 0) if not hip else True,
                fp16=True,
                fp64=True,
                compute_capability=cc,
            )
        )
    return tuple(out)


def _read_mps(torch: types.ModuleType) -> tuple[DeviceFacts, ...]:
    if not torch.backends.mps.is_available():
        return ()
    total = int(getattr(torch.mps, "recommended_max_memory", lambda: 0)()) or host_memory()[0]
    return (
        DeviceFacts(
            backend="mps",
            index=0,
            name=f"Apple {platform.processor() or 'GPU'}",
            family="apple",
            total_memory=total,
            free_memory=None,
            native_bf16=False,
            fp16=True,
            fp64=False,
            integrated=True,
        ),
    )


_READERS = {"xpu": _read_xpu, "cuda": _read_cuda, "mps": _read_mps}


def _xccl_available(torch: types.ModuleType) -> bool | None:
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        check = getattr(dist, "is_xccl_available", None)
        return bool(check()) if check is not None else None
    except (ImportError, RuntimeError):
        return None
