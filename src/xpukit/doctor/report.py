"""``xpukit doctor``'s report: facts plus findings, rendered for a terminal or as versioned JSON."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from typing import Any

from xpukit import __version__
from xpukit.doctor.checks import Finding, diagnose
from xpukit.doctor.ecosystem import enabled_by_versions
from xpukit.doctor.host import HostFacts, gather_host
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.machine.precision import slow_precision

__all__ = ["SCHEMA_VERSION", "DoctorReport", "run_doctor"]

# Bump when a key of DoctorReport.to_dict() changes meaning or disappears (adding keys is compatible).
SCHEMA_VERSION = 1


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
            "enabled": self.enabled,
            **self.extras,
        }

    @property
    def enabled(self) -> list[str]:
        """What the installed versions enable (:func:`xpukit.doctor.ecosystem.enabled_by_versions`)."""
        host = self.host
        return enabled_by_versions(
            host.packages, kernels_accepted=host.kernels_accepted, kernels_reason=host.kernels_reason
        )

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
            cc = f", cc {d.compute_capability[0]}.{d.compute_capability[1]}" if d.compute_capability else ""
            kind = " integrated" if d.integrated and d.backend != "cpu" else ""
            lines.append(
                f"  {d.torch_device:<7} {d.name} [{d.family}{kind}{cc}] "
                f"{d.total_memory / gib:.1f} GiB, {free}; {_precisions(d)}"
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
        lines += [f"{'enables' if i == 0 else '':<12} {line}" for i, line in enumerate(self.enabled)]
        for key, value in self.extras.items():
            if isinstance(value, dict) and "summary" in value:
                lines.append(f"{key:<12} {value['summary']}")
        for c in self.extras.get("selftest", {}).get("checks", ()):  # before the verdict
            lines.append(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['device']:<7} {c['check']:<13} {c['detail']}")
        lines.append("")
        for f in self.findings:
            mark = {"error": "ERROR", "warning": "WARN ", "info": "note "}[f.severity]
            lines.append(f"{mark} [{f.code}] {f.message}")
            if f.fix:
                lines.append(f"      fix: {f.fix}")
        if self.findings:
            lines.append("")
        lines.append(self.verdict)
        return "\n".join(lines)

    @property
    def verdict(self) -> str:
        """The report's last line: one verdict, the selftest included."""
        if not self.healthy:
            return "NOT healthy: fix the errors above."
        if not self.extras.get("selftest", {}).get("passed", True):
            return "NOT healthy: the selftest failed where the device's facts say it should pass."
        if any(f.severity == "warning" for f in self.findings):
            return "OK: nothing blocks the GPU; the warnings above may bite later."
        return "OK: no known problem found" + (" (notes above)." if self.findings else ".")


def _precisions(device: DeviceFacts) -> str:
    """What the device computes in natively, and what it only emulates (docs/platform-notes.md §3.5)."""
    # The loader's rule (machine/precision.py slow_precision), so doctor and the plans agree.
    facts = (("bf16", "bfloat16", device.native_bf16), ("fp16", "float16", device.fp16))
    native = [n for n, dtype, ok in facts if ok and slow_precision(device, dtype) is None]
    native += ["fp32"] + (["fp64"] if device.fp64 else [])
    emulated = [n for n in ("bf16", "fp16") if n not in native]  # computed through fp32 (§3.5)
    text = f"native: {', '.join(native)}"
    text += f"; emulated (slow): {', '.join(emulated)}" if emulated else ""
    return text + ("" if device.fp64 else "; no fp64")


def run_doctor(*, machine: MachineFacts | None = None, host: HostFacts | None = None) -> DoctorReport:
    """Gather facts (unless given) and diagnose them."""
    from xpukit.machine.probe import detect

    machine = machine if machine is not None else detect()
    host = host if host is not None else gather_host()
    return DoctorReport(machine=machine, host=host, findings=tuple(diagnose(machine, host)))
