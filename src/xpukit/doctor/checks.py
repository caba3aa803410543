"""The doctor's checks: :func:`diagnose` turns machine and host facts into findings.

Each check is one function of the facts that yields its findings, and :data:`CHECKS` lists them in
the order they run; adding a check is one function and one row. All pure (:mod:`xpukit.doctor.host`
reads the host), so every known-bad setup is tested with hand-made facts. Sources for each check:
docs/platform-install.md §6 and docs/platform-install.md §6.4–6.5.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from xpukit._compat import version_at_least
from xpukit.doctor.host import HostFacts
from xpukit.machine.facts import MachineFacts
from xpukit.select.spec import HIERARCHIES, MASK_VARIABLE, unreadable_mask_entries

__all__ = ["CHECKS", "Check", "Finding", "Severity", "diagnose", "environment_findings"]


Severity = Literal["error", "warning", "info"]

# Names people export that the runtime never reads (docs/platform-install.md §6.5), and the real one.
_MISSPELLED = {"UR_L0_USE_RELAXED_ALLOCATION_LIMITS": "UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """One thing the doctor found: an ``error`` blocks GPU use, a ``warning`` may bite later."""

    severity: Severity
    code: str
    message: str
    fix: str = ""


def _torch_installed(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """torch is installed at all."""
    if machine.torch_version is None:
        yield Finding(
            severity="error",
            code="torch-missing",
            message="torch is not installed.",
            fix="XPU: pip install torch --index-url https://download.pytorch.org/whl/xpu ; "
            "CUDA/CPU: see https://pytorch.org/get-started/locally/",
        )


def _transformers_version(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """transformers is installed, at 5 or newer."""
    transformers = host.packages.get("transformers")
    if transformers is None:
        yield Finding(
            severity="error",
            code="transformers-missing",
            message="transformers is not installed.",
            fix='pip install "transformers>=5"',
        )
    elif not version_at_least(transformers, "5.0"):
        yield Finding(
            severity="error",
            code="transformers-old",
            message=f"transformers {transformers} is installed; xpukit needs transformers>=5.",
            fix='pip install -U "transformers>=5,<6"',
        )


def _probe_failed(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """Reading the devices did not fail."""
    for note in machine.notes:
        if "enumeration failed" in note:
            yield Finding(
                severity="error",
                code="probe-failed",
                message=f"Reading the devices failed: {note}",
                fix="check the driver with `sycl-ls` (XPU) or `nvidia-smi` (CUDA); reinstall or "
                "update the GPU driver if it fails there too",
            )


def _cpu_wheel_on_intel_gpu(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """An Intel GPU beside a torch build without XPU support."""
    if host.intel_gpus and machine.torch_version is not None and "xpu" not in machine.compiled:
        # An error only where the Intel GPU is what this machine computes on: a CUDA box or an
        # office laptop with an Intel iGPU and no Level Zero driver is healthy.
        blocking = host.level_zero_loader and not machine.devices_of("cuda")
        build = "a CUDA build" if machine.torch_cuda else "a CPU build"
        yield Finding(
            severity="error" if blocking else "warning",
            code="cpu-wheel-on-intel-gpu",
            message=f"This machine has an Intel GPU ({', '.join(host.intel_gpus)}) but torch "
            f"{machine.torch_version} is {build} without XPU support, so that GPU cannot be used."
            + ("" if host.level_zero_loader else " (No Level Zero driver was found either.)"),
            fix="pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/xpu",
        )


def _xpu_build_sees_nothing(machine: MachineFacts) -> bool:
    return "xpu" in machine.compiled and not machine.devices_of("xpu")


def _render_locked(host: HostFacts) -> bool:
    return host.dri_exists and not host.render_nodes_accessible


def _no_xpu_visible(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """An XPU build that sees no XPU: the mask, the selector, the render group or the driver, first
    that applies."""
    if not _xpu_build_sees_nothing(machine):
        return
    mask = machine.env.get("ZE_AFFINITY_MASK")
    selector = machine.env.get("ONEAPI_DEVICE_SELECTOR")
    runtime_said = [n for n in machine.notes if "XPU" in n or "xpu" in n]
    if mask is not None:
        yield Finding(
            severity="error",
            code="mask-selects-nothing",
            message=f"ZE_AFFINITY_MASK={mask!r} leaves no XPU visible (the driver skips "
            "out-of-range entries and, in FLAT mode, X.Y tile entries, silently).",
            fix="unset ZE_AFFINITY_MASK, or choose devices with `xpukit launch --devices SPEC -- CMD`",
        )
    elif selector is not None and "level_zero" not in selector and not selector.startswith("*"):
        yield Finding(
            severity="error",
            code="selector-selects-nothing",
            message=f"ONEAPI_DEVICE_SELECTOR={selector!r} leaves no Level Zero GPU, and "
            "PyTorch uses Level Zero GPUs only (an opencl:* selector gives zero XPUs).",
            fix="unset ONEAPI_DEVICE_SELECTOR (choose devices with `xpukit launch`), or use level_zero:N",
        )
    elif _render_locked(host):
        yield Finding(
            severity="error",
            code="render-permission",
            message="torch has XPU support but sees no device, and this user cannot open "
            "/dev/dri/renderD* (not in the `render` group).",
            fix="sudo usermod -aG render $USER, then log in again",
        )
    else:
        said = f" The runtime said: {runtime_said[0]}" if runtime_said else ""
        yield Finding(
            severity="error" if host.intel_gpus else "warning",
            code="xpu-no-device",
            message=f"torch {machine.torch_version} has XPU support but sees no XPU device.{said}",
            fix="install the Intel GPU driver (compute-runtime / Level Zero): see Intel's "
            "'PyTorch prerequisites for Intel GPUs'; check with `sycl-ls`",
        )


def _render_access(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """The render nodes (when :func:`_no_xpu_visible` has not already blamed them)."""
    if _xpu_build_sees_nothing(machine):
        return
    if _render_locked(host):
        yield Finding(
            severity="warning",
            code="render-permission",
            message="This user cannot open every /dev/dri/renderD* (not in the `render` group); "
            "GPU access may fail for this user.",
            fix="sudo usermod -aG render $USER, then log in again",
        )
    elif host.dri_exists and not host.in_render_group and ("xpu" in machine.compiled or host.intel_gpus):
        yield Finding(
            severity="info",
            code="render-group",
            message="The render nodes open in this session (a local login grants access), but "
            "this user is not in the `render` group: over SSH or in a batch job the GPU may vanish.",
            fix="sudo usermod -aG render $USER, then log in again",
        )


def _cuda_mask(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """CUDA_VISIBLE_DEVICES leaves a CUDA build some device."""
    if machine.torch_cuda and not machine.devices_of("cuda") and "CUDA_VISIBLE_DEVICES" in machine.env:
        yield Finding(
            severity="warning",
            code="cuda-mask-selects-nothing",
            message=f"CUDA_VISIBLE_DEVICES={machine.env['CUDA_VISIBLE_DEVICES']!r} and no CUDA "
            "device is visible.",
            fix="unset CUDA_VISIBLE_DEVICES or use `xpukit launch --devices SPEC -- CMD`",
        )


def _misspelled_variables(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """Variables people export that the runtime never reads."""
    return _misspelled(machine.env)


def _misspelled(env: Mapping[str, str]) -> Iterator[Finding]:
    for wrong, right in _MISSPELLED.items():
        if wrong in env:
            yield Finding(
                severity="warning",
                code="misspelled-variable",
                message=f"{wrong} is set, but the runtime reads {right}; this one does nothing.",
                fix=f"export {right}={env[wrong]} (and unset {wrong})",
            )


def _unreadable_masks(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """Device masks with entries the runtime cannot read."""
    return _unreadable(machine.env)


def _unreadable(env: Mapping[str, str]) -> Iterator[Finding]:
    for backend, variable in MASK_VARIABLE.items():
        mask = env.get(variable)
        unreadable = unreadable_mask_entries(backend, mask) if mask is not None else []
        if unreadable:
            xpu = backend == "xpu"
            valid = "indices '0,2' or tiles '0.1'" if xpu else "indices '0,2', 'GPU-…' or 'MIG-…' ids"
            drops = "skips what it cannot use, silently" if xpu else "hides it and every entry after it"
            yield Finding(
                severity="warning",
                code="mask-unreadable",
                message=f"{variable}={mask!r} has entries the runtime cannot read "
                f"({', '.join(map(repr, unreadable[:3]))}); it {drops}, so other devices are "
                f"visible than meant. A mask lists {valid}, comma-separated.",
                fix=f"unset {variable}, or choose devices with `xpukit launch --devices SPEC -- CMD`",
            )


def _hierarchy(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """ZE_FLAT_DEVICE_HIERARCHY is a value the driver reads."""
    return _hierarchy_value(machine.env)


def _hierarchy_value(env: Mapping[str, str]) -> Iterator[Finding]:
    hierarchy = env.get("ZE_FLAT_DEVICE_HIERARCHY")
    if hierarchy is not None and hierarchy not in HIERARCHIES:
        fix = (
            f"export ZE_FLAT_DEVICE_HIERARCHY={hierarchy.strip().upper()}"
            if hierarchy.strip().upper() in HIERARCHIES
            else "export ZE_FLAT_DEVICE_HIERARCHY=FLAT (every stack a device, the driver's default), "
            "COMPOSITE (every card a device, stacks as card.tile) or COMBINED; or unset it"
        )
        yield Finding(
            severity="warning",
            code="hierarchy-ignored",
            message=f"ZE_FLAT_DEVICE_HIERARCHY={hierarchy!r} is not one of {', '.join(HIERARCHIES)} "
            "(upper case): the driver ignores it and uses its default.",
            fix=fix,
        )


def _mixed_intel_gpus(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """An integrated and a discrete Intel GPU: which ordinal is which."""
    if host.intel_igpu_present and len(host.intel_gpus) > 1:
        yield Finding(
            severity="warning",
            code="mixed-intel-gpus",
            message="This machine has an integrated Intel GPU (PCI 00:02.0) and a discrete one. "
            "With ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 (which `xpukit launch` sets for a stable order) "
            "device ordinals follow the PCI bus, so the iGPU is 0; without it discrete cards come "
            "first, and torch >= 2.7 hides the iGPU while a discrete GPU is visible.",
            fix="check which card an ordinal means with `xpukit launch --devices N -- xpukit doctor`",
        )


def _ipex_installed(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """intel-extension-for-pytorch is not installed."""
    ipex = host.packages.get("intel-extension-for-pytorch")
    if ipex is not None:
        yield Finding(
            severity="warning",
            code="ipex-installed",
            message=f"intel-extension-for-pytorch {ipex} is installed. It is archived (no releases "
            "after 2.8), stock torch has XPU built in, and its presence breaks multi-XPU launches "
            "(accelerate#3664).",
            fix="pip uninstall intel-extension-for-pytorch",
        )


def _bitsandbytes_for_xpu(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """bitsandbytes, where installed beside an XPU build, has the XPU backend."""
    bnb = host.packages.get("bitsandbytes")
    if bnb is not None and "xpu" in machine.compiled and not version_at_least(bnb, "0.48"):
        yield Finding(
            severity="error",
            code="bitsandbytes-old-for-xpu",
            message=f"bitsandbytes {bnb} has no native XPU backend (needs >=0.48; >=0.50 for paged "
            "optimizers and bf16 4-bit on Arc A-series).",
            fix='pip install -U "bitsandbytes>=0.50"',
        )


def _kernels_accepted(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """transformers accepts the installed kernels release."""
    if host.kernels_accepted is False:
        yield Finding(
            severity="warning",
            code="kernels-rejected",
            message=f"{host.kernels_reason}. Hub kernels (flash-attn2 on XPU/CUDA, use_kernels) "
            "stay off, and transformers' own errors will wrongly say kernels is not installed.",
            fix="install a kernels release inside that range, or a transformers release that "
            'accepts the newest kernels (pip install "transformers[kernels]" resolves one)',
        )


def _hub_reachable(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """The Hub answers (when not offline)."""
    if host.hub_reachable is False:
        yield Finding(
            severity="warning",
            code="hub-unreachable",
            message=f"The Hugging Face Hub is not reachable ({host.hub_reason}). xpukit skips "
            "Hub-backed choices (flash-attn2 kernel, use_kernels) and says so in the plan; other "
            "libraries have no network timeout (huggingface_hub 2.4) and can wait forever on an "
            "endpoint that accepts and never answers.",
            fix="export HF_HUB_OFFLINE=1 on machines without Hub access",
        )


def _device_notes(machine: MachineFacts, host: HostFacts) -> Iterator[Finding]:
    """Per device: free memory unknown, and the probe's notes."""
    for device in machine.devices:
        if device.backend == "xpu" and not device.free_memory_known:
            yield Finding(
                severity="info",
                code="free-memory-unknown",
                message=f"{device.torch_device} ({device.name}) cannot report free memory; "
                "accelerate's device_map='auto' would silently skip it. xpukit plans with an "
                "explicit max_memory instead.",
            )
        for note in device.notes:
            yield Finding(severity="info", code="device-note", message=f"{device.torch_device}: {note}")


Check = Callable[[MachineFacts, HostFacts], Iterator[Finding]]

# Every check, in the order it runs (findings of one severity keep this order in the report).
CHECKS: tuple[Check, ...] = (
    _torch_installed,
    _transformers_version,
    _probe_failed,
    _cpu_wheel_on_intel_gpu,
    _no_xpu_visible,
    _render_access,
    _cuda_mask,
    _misspelled_variables,
    _unreadable_masks,
    _hierarchy,
    _mixed_intel_gpus,
    _ipex_installed,
    _bitsandbytes_for_xpu,
    _kernels_accepted,
    _hub_reachable,
    _device_notes,
)
_ORDER = {"error": 0, "warning": 1, "info": 2}


def environment_findings(env: Mapping[str, str]) -> list[Finding]:
    """The checks that read the environment alone (misspelled variables, unreadable device masks, a
    hierarchy the driver ignores), for a process about to start others (``xpukit launch``)."""
    return [*_misspelled(env), *_unreadable(env), *_hierarchy_value(env)]


def diagnose(machine: MachineFacts, host: HostFacts) -> list[Finding]:
    """The findings of every check in :data:`CHECKS`, errors first. Pure: no I/O."""
    found = [finding for check in CHECKS for finding in check(machine, host)]
    return sorted(found, key=lambda f: _ORDER[f.severity])
