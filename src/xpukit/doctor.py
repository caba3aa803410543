"""``xpukit doctor``: what this machine has, and the known-bad setups it is in.

:func:`gather_host` reads the host (PCI devices, ``/dev/dri``, groups, installed packages);
:func:`diagnose` is a pure function from facts to findings, so every known-bad setup is tested
with hand-made facts. Sources for each check: platform.md §6 and peers.md §3.
"""

from __future__ import annotations

import ctypes.util
import grp
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from xpukit import __version__
from xpukit._compat import installed_version, version_at_least
from xpukit.facts import MachineFacts
from xpukit.probe import intel_display_devices

__all__ = [
    "PACKAGES",
    "SCHEMA_VERSION",
    "DoctorReport",
    "Finding",
    "HostFacts",
    "diagnose",
    "gather_host",
    "run_doctor",
]

# Bump when a key of DoctorReport.to_dict() changes meaning or disappears (adding keys is compatible).
SCHEMA_VERSION = 1

# Distributions whose versions the report lists (None when not installed).
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "huggingface-hub",
    "peft",
    "bitsandbytes",
    "kernels",
    "liger-kernel",
    "matplotlib",
    "triton",
    "pytorch-triton-xpu",
    "pyzes",
    "intel-extension-for-pytorch",
)

Severity = Literal["error", "warning", "info"]

# Names people export that the runtime never reads (peers.md §3.8), and the real one.
_MISSPELLED = {"UR_L0_USE_RELAXED_ALLOCATION_LIMITS": "UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """One thing the doctor found: an ``error`` blocks GPU use, a ``warning`` may bite later."""

    severity: Severity
    code: str
    message: str
    fix: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostFacts:
    """Facts about the host outside torch.

    Attributes:
        intel_gpus: PCI ids (``8086:xxxx``) of Intel display controllers found in sysfs.
        intel_igpu_present: one of them sits at PCI 00:02.0, where Intel integrated GPUs live.
        level_zero_loader: whether ``libze_loader`` can be found (the Intel GPU driver stack).
        dri_exists: whether ``/dev/dri`` exists.
        render_nodes_accessible: whether the current user can open every ``/dev/dri/renderD*``.
        in_render_group: whether the user is root or in the ``render`` group.
        packages: installed versions of :data:`PACKAGES`.
        kernels_accepted: whether transformers accepts the installed ``kernels`` (None: absent).
        kernels_reason: the version check in words.
        hub_offline: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set.
        hub_reachable: the bounded reachability check's answer (None when offline: not checked).
        hub_reason: that check in words.
    """

    intel_gpus: tuple[str, ...] = ()
    intel_igpu_present: bool = False
    level_zero_loader: bool = False
    dri_exists: bool = False
    render_nodes_accessible: bool = True
    in_render_group: bool = True
    packages: dict[str, str | None] = field(default_factory=dict)
    kernels_accepted: bool | None = None  # None: kernels not installed
    kernels_reason: str = ""
    hub_offline: bool = False
    hub_reachable: bool | None = None  # None: not checked (offline)
    hub_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        data = asdict(self)
        data["intel_gpus"] = list(self.intel_gpus)
        return data


def gather_host() -> HostFacts:
    """Read the host facts (sysfs, /dev/dri, groups, package metadata); touches no GPU runtime."""
    dri = Path("/dev/dri")
    nodes = sorted(dri.glob("renderD*")) if dri.exists() else []
    from xpukit.hub import hub_status, kernels_support

    gpus = intel_display_devices()
    kernels = kernels_support()
    hub = hub_status()  # bounded (XPUKIT_HUB_TIMEOUT, default 2 s); no network when offline
    return HostFacts(
        intel_gpus=tuple(pci_id for _, pci_id in gpus),
        intel_igpu_present=any(address.endswith(":00:02.0") for address, _ in gpus),
        level_zero_loader=ctypes.util.find_library("ze_loader") is not None,
        dri_exists=dri.exists(),
        render_nodes_accessible=all(os.access(n, os.R_OK | os.W_OK) for n in nodes),
        in_render_group=_in_render_group(),
        packages={name: installed_version(name) for name in PACKAGES},
        kernels_accepted=kernels.accepted if kernels.installed else None,
        kernels_reason=kernels.reason,
        hub_offline=hub.offline,
        hub_reachable=None if hub.offline else hub.reachable,
        hub_reason=hub.reason,
    )


def _in_render_group() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        render = grp.getgrnam("render").gr_gid
    except KeyError:
        return True  # no render group on this system: nothing to be missing from
    return render in os.getgroups()


def diagnose(machine: MachineFacts, host: HostFacts) -> list[Finding]:
    """The findings for these facts, errors first. Pure: no I/O."""
    found: list[Finding] = []
    add = found.append
    pkgs = host.packages
    xpu_build = "xpu" in machine.compiled

    if machine.torch_version is None:
        add(
            Finding(
                severity="error",
                code="torch-missing",
                message="torch is not installed.",
                fix="XPU: pip install torch --index-url https://download.pytorch.org/whl/xpu ; "
                "CUDA/CPU: see https://pytorch.org/get-started/locally/",
            )
        )
    transformers = pkgs.get("transformers")
    if transformers is None:
        add(
            Finding(
                severity="error",
                code="transformers-missing",
                message="transformers is not installed.",
                fix='pip install "transformers>=5"',
            )
        )
    elif not version_at_least(transformers, "5.0"):
        add(
            Finding(
                severity="error",
                code="transformers-old",
                message=f"transformers {transformers} is installed; xpukit needs transformers>=5.",
                fix='pip install -U "transformers>=5,<6"',
            )
        )

    for note in machine.notes:
        if "enumeration failed" in note:
            add(
                Finding(
                    severity="error",
                    code="probe-failed",
                    message=f"Reading the devices failed: {note}",
                    fix="check the driver with `sycl-ls` (XPU) or `nvidia-smi` (CUDA); reinstall or "
                    "update the GPU driver if it fails there too",
                )
            )
    cuda_devices = machine.devices_of("cuda")
    if host.intel_gpus and machine.torch_version is not None and not xpu_build:
        # An error only where the Intel GPU is what this machine computes on: a CUDA box or an
        # office laptop with an Intel iGPU and no Level Zero driver is healthy.
        blocking = host.level_zero_loader and not cuda_devices
        build = "a CUDA build" if machine.torch_cuda else "a CPU build"
        add(
            Finding(
                severity="error" if blocking else "warning",
                code="cpu-wheel-on-intel-gpu",
                message=f"This machine has an Intel GPU ({', '.join(host.intel_gpus)}) but torch "
                f"{machine.torch_version} is {build} without XPU support, so that GPU cannot be used."
                + ("" if host.level_zero_loader else " (No Level Zero driver was found either.)"),
                fix="pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/xpu",
            )
        )
    render_locked = host.dri_exists and not host.render_nodes_accessible
    if xpu_build and not machine.devices_of("xpu"):
        mask = machine.env.get("ZE_AFFINITY_MASK")
        selector = machine.env.get("ONEAPI_DEVICE_SELECTOR")
        runtime_said = [n for n in machine.notes if "XPU" in n or "xpu" in n]
        if mask is not None:
            add(
                Finding(
                    severity="error",
                    code="mask-selects-nothing",
                    message=f"ZE_AFFINITY_MASK={mask!r} leaves no XPU visible (the driver skips "
                    "out-of-range entries and, in FLAT mode, X.Y tile entries, silently).",
                    fix="unset ZE_AFFINITY_MASK, or choose devices with "
                    "`xpukit launch --devices SPEC -- CMD`",
                )
            )
        elif selector is not None and "level_zero" not in selector and not selector.startswith("*"):
            add(
                Finding(
                    severity="error",
                    code="selector-selects-nothing",
                    message=f"ONEAPI_DEVICE_SELECTOR={selector!r} leaves no Level Zero GPU, and "
                    "PyTorch uses Level Zero GPUs only (an opencl:* selector gives zero XPUs).",
                    fix="unset ONEAPI_DEVICE_SELECTOR (choose devices with `xpukit launch`), or use "
                    "level_zero:N",
                )
            )
        elif render_locked:
            add(
                Finding(
                    severity="error",
                    code="render-permission",
                    message="torch has XPU support but sees no device, and this user cannot open "
                    "/dev/dri/renderD* (not in the `render` group).",
                    fix="sudo usermod -aG render $USER, then log in again",
                )
            )
        else:
            said = f" The runtime said: {runtime_said[0]}" if runtime_said else ""
            add(
                Finding(
                    severity="error" if host.intel_gpus else "warning",
                    code="xpu-no-device",
                    message=f"torch {machine.torch_version} has XPU support but sees no XPU device.{said}",
                    fix="install the Intel GPU driver (compute-runtime / Level Zero): see Intel's "
                    "'PyTorch prerequisites for Intel GPUs'; check with `sycl-ls`",
                )
            )
    elif render_locked:
        add(
            Finding(
                severity="warning",
                code="render-permission",
                message="This user cannot open every /dev/dri/renderD* (not in the `render` group); "
                "GPU access may fail for this user.",
                fix="sudo usermod -aG render $USER, then log in again",
            )
        )
    elif host.dri_exists and not host.in_render_group and (xpu_build or host.intel_gpus):
        add(
            Finding(
                severity="info",
                code="render-group",
                message="The render nodes open in this session (a local login grants access), but "
                "this user is not in the `render` group: over SSH or in a batch job the GPU may vanish.",
                fix="sudo usermod -aG render $USER, then log in again",
            )
        )
    if machine.torch_cuda and not cuda_devices and "CUDA_VISIBLE_DEVICES" in machine.env:
        add(
            Finding(
                severity="warning",
                code="cuda-mask-selects-nothing",
                message=f"CUDA_VISIBLE_DEVICES={machine.env['CUDA_VISIBLE_DEVICES']!r} and no CUDA "
                "device is visible.",
                fix="unset CUDA_VISIBLE_DEVICES or use `xpukit launch --devices SPEC -- CMD`",
            )
        )
    for wrong, right in _MISSPELLED.items():
        if wrong in machine.env:
            add(
                Finding(
                    severity="warning",
                    code="misspelled-variable",
                    message=f"{wrong} is set, but the runtime reads {right}; this one does nothing.",
                    fix=f"export {right}={machine.env[wrong]} (and unset {wrong})",
                )
            )
    hierarchy = machine.env.get("ZE_FLAT_DEVICE_HIERARCHY")
    if hierarchy is not None and hierarchy not in ("FLAT", "COMPOSITE", "COMBINED"):
        add(
            Finding(
                severity="warning",
                code="hierarchy-ignored",
                message=f"ZE_FLAT_DEVICE_HIERARCHY={hierarchy!r} is not one of FLAT, COMPOSITE, "
                "COMBINED (upper case): the driver ignores it and uses its default.",
                fix=f"export ZE_FLAT_DEVICE_HIERARCHY={hierarchy.upper()}",
            )
        )
    if host.intel_igpu_present and len(host.intel_gpus) > 1:
        add(
            Finding(
                severity="warning",
                code="mixed-intel-gpus",
                message="This machine has an integrated Intel GPU (PCI 00:02.0) and a discrete one. "
                "With ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 (which `xpukit launch` sets for a stable order) "
                "device ordinals follow the PCI bus, so the iGPU is 0; without it discrete cards come "
                "first, and torch >= 2.7 hides the iGPU while a discrete GPU is visible.",
                fix="check which card an ordinal means with `xpukit launch --devices N -- xpukit doctor`",
            )
        )
    ipex = pkgs.get("intel-extension-for-pytorch")
    if ipex is not None:
        add(
            Finding(
                severity="warning",
                code="ipex-installed",
                message=f"intel-extension-for-pytorch {ipex} is installed. It is archived (no releases "
                "after 2.8), stock torch has XPU built in, and its presence breaks multi-XPU launches "
                "(accelerate#3664).",
                fix="pip uninstall intel-extension-for-pytorch",
            )
        )
    bnb = pkgs.get("bitsandbytes")
    if bnb is not None and xpu_build and not version_at_least(bnb, "0.48"):
        add(
            Finding(
                severity="error",
                code="bitsandbytes-old-for-xpu",
                message=f"bitsandbytes {bnb} has no native XPU backend (needs >=0.48; >=0.50 for paged "
                "optimizers and bf16 4-bit on Arc A-series).",
                fix='pip install -U "bitsandbytes>=0.50"',
            )
        )
    if host.kernels_accepted is False:
        add(
            Finding(
                severity="warning",
                code="kernels-rejected",
                message=f"{host.kernels_reason}. Hub kernels (flash-attn2 on XPU/CUDA, use_kernels) "
                "stay off, and transformers' own errors will wrongly say kernels is not installed.",
                fix="install a kernels release inside that range, or a transformers release that "
                'accepts the newest kernels (pip install "transformers[kernels]" resolves one)',
            )
        )
    if host.hub_reachable is False:
        add(
            Finding(
                severity="warning",
                code="hub-unreachable",
                message=f"The Hugging Face Hub is not reachable ({host.hub_reason}). xpukit skips "
                "Hub-backed choices (flash-attn2 kernel, use_kernels) and says so in the plan; other "
                "libraries have no network timeout (huggingface_hub 2.4) and can wait forever on an "
                "endpoint that accepts and never answers.",
                fix="export HF_HUB_OFFLINE=1 on machines without Hub access",
            )
        )
    for device in machine.devices:
        if device.backend == "xpu" and not device.free_memory_known:
            add(
                Finding(
                    severity="info",
                    code="free-memory-unknown",
                    message=f"{device.torch_device} ({device.name}) cannot report free memory; "
                    "accelerate's device_map='auto' would silently skip it. xpukit plans with an "
                    "explicit max_memory instead.",
                )
            )
        for note in device.notes:
            add(Finding(severity="info", code="device-note", message=f"{device.torch_device}: {note}"))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda f: order[f.severity])


@dataclass(frozen=True, kw_only=True, slots=True)
class DoctorReport:
    """Everything ``xpukit doctor`` prints; :meth:`to_dict` is the stable ``--json`` schema."""

    machine: MachineFacts
    host: HostFacts
    findings: tuple[Finding, ...]
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        """No blocking problem was found."""
        return not any(f.severity == "error" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (schema documented in docs/doctor.md)."""
        return {
            "schema": SCHEMA_VERSION,
            "xpukit": __version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "healthy": self.healthy,
            "machine": self.machine.to_dict(),
            "host": self.host.to_dict(),
            "findings": [asdict(f) for f in self.findings],
            **self.extras,
        }

    def render(self) -> str:
        """Human-readable report, readable at a glance."""
        m = self.machine
        build = "+".join(m.compiled) if m.compiled else "CPU only"
        gib = 2**30
        lines = [
            f"xpukit {__version__} doctor — Python {platform.python_version()}, {platform.system()}",
            f"torch        {m.torch_version or 'not installed'} (build: {build}"
            + (f", xpu {m.torch_xpu}" if m.torch_xpu else "")
            + (f", cuda {m.torch_cuda}" if m.torch_cuda else "")
            + ")",
            f"accelerator  {m.accelerator} ({m.device_count} device{'s' if m.device_count != 1 else ''})",
        ]
        for d in (*m.devices, m.cpu):
            free = f"{d.free_memory / gib:.1f} GiB free" if d.free_memory is not None else "free: unknown"
            caps = ", ".join(
                c for c, ok in (("bf16", d.native_bf16), ("fp16", d.fp16), ("fp64", d.fp64)) if ok
            )
            cc = f", cc {d.compute_capability[0]}.{d.compute_capability[1]}" if d.compute_capability else ""
            kind = " integrated" if d.integrated and d.backend != "cpu" else ""
            lines.append(
                f"  {d.torch_device:<7} {d.name} [{d.family}{kind}{cc}] "
                f"{d.total_memory / gib:.1f} GiB, {free}; native: {caps or 'none'}"
            )
        pkgs = ", ".join(f"{k} {v}" for k, v in self.host.packages.items() if v is not None)
        lines.append(f"packages     {pkgs}")
        env = ", ".join(f"{k}={v}" for k, v in m.env.items()) or "none set"
        lines.append(f"environment  {env}")
        hub = (
            "offline (HF_HUB_OFFLINE)"
            if self.host.hub_offline
            else ("reachable" if self.host.hub_reachable else "NOT reachable") + f": {self.host.hub_reason}"
        )
        lines.append(f"hub          {hub}")
        if self.host.kernels_reason:
            lines.append(f"kernels      {self.host.kernels_reason}")
        for key, value in self.extras.items():
            if isinstance(value, dict) and "summary" in value:
                lines.append(f"{key:<12} {value['summary']}")
        lines.append("")
        if not self.findings:
            lines.append("OK: no known problem found.")
        for f in self.findings:
            mark = {"error": "ERROR", "warning": "WARN ", "info": "note "}[f.severity]
            lines.append(f"{mark} [{f.code}] {f.message}")
            if f.fix:
                lines.append(f"      fix: {f.fix}")
        lines.append("")
        lines.append("healthy" if self.healthy else "NOT healthy: fix the errors above")
        return "\n".join(lines)


def run_doctor(*, machine: MachineFacts | None = None, host: HostFacts | None = None) -> DoctorReport:
    """Gather facts (unless given) and diagnose them."""
    from xpukit.probe import detect

    machine = machine if machine is not None else detect()
    host = host if host is not None else gather_host()
    return DoctorReport(machine=machine, host=host, findings=tuple(diagnose(machine, host)))


def _main() -> int:  # pragma: no cover - convenience for `python -m xpukit.doctor`
    report = run_doctor()
    print(report.render())
    return 0 if report.healthy else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
