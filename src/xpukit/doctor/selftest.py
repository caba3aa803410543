"""``xpukit doctor --selftest``: run small real operations on each device and report what worked.

The planner decides from recorded facts; this is how an owner of a device checks those facts on the
real thing (and pastes the JSON into a bug report). Each check is tiny (256×256 tensors) and never
fatal: a failure is recorded with the exception text.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from xpukit.machine.facts import DeviceFacts, MachineFacts

__all__ = ["CheckResult", "run_selftest"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    """One check on one device."""

    device: str
    check: str
    ok: bool
    detail: str
    seconds: float
    expected: bool = True  # the device's facts say this check should pass

    @property
    def unexpected_failure(self) -> bool:
        """Failed although the recorded facts say it should work: the facts or the setup are wrong."""
        return self.expected and not self.ok


# Largest relative error accepted for a 256x256 matmul against an fp32 CPU reference: a few
# units of each format's precision after 256-term sums (measured: bf16 4e-3, fp16 5e-4).
TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}


def run_selftest(machine: MachineFacts) -> list[CheckResult]:
    """Matmul in bf16/fp16/fp32, fp64 arithmetic and the free-memory query, on every device."""
    import torch

    results: list[CheckResult] = []
    for device in (*machine.devices, machine.cpu):
        results.extend(_device_checks(torch, device))
    return results


def _device_checks(torch: Any, device: DeviceFacts) -> list[CheckResult]:
    name = device.torch_device
    out = []

    def check(label: str, fn: Any, expected: bool = True) -> None:
        start = time.perf_counter()
        try:
            detail = fn()
            ok = True
        except Exception as exc:  # a selftest records every failure instead of stopping
            detail, ok = f"{type(exc).__name__}: {exc}", False
        out.append(
            CheckResult(
                device=name,
                check=label,
                ok=ok,
                detail=str(detail),
                seconds=round(time.perf_counter() - start, 4),
                expected=expected,
            )
        )

    def matmul(dtype: Any) -> str:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(256, 256, generator=gen)
        b = torch.randn(256, 256, generator=gen)
        want = a @ b
        got = (a.to(name, dtype) @ b.to(name, dtype)).float().cpu()
        _sync(torch, device)
        if not torch.isfinite(got).all():
            raise ArithmeticError("non-finite result")
        err = ((got - want).abs().max() / want.abs().max()).item()
        limit = TOLERANCE[str(dtype).removeprefix("torch.")]
        if err > limit:
            raise ArithmeticError(f"max relative error {err:.2e} exceeds {limit:.0e}")
        return f"max relative error {err:.2e}"

    for label, dtype, expected in (
        # bf16 works (emulated) everywhere torch has it; only native bf16 is a promise of the facts.
        ("matmul-bf16", torch.bfloat16, device.native_bf16),
        ("matmul-fp16", torch.float16, device.fp16),
        ("matmul-fp32", torch.float32, True),
    ):
        check(label, lambda dtype=dtype: matmul(dtype), expected)
    if device.backend != "mps":  # MPS has no float64 at all
        check(
            "fp64",
            lambda: str((torch.ones(4, dtype=torch.float64, device=name) * 2).sum().item()),
            device.fp64,
        )
    if device.backend in ("xpu", "cuda"):
        module = getattr(torch, device.backend)
        check(
            "mem_get_info",
            lambda: "free {:.2f} GiB of {:.2f} GiB".format(
                *(v / 2**30 for v in module.mem_get_info(device.index))
            ),
            device.free_memory_known,
        )
    return out


def _sync(torch: Any, device: DeviceFacts) -> None:
    if device.backend in ("xpu", "cuda", "mps"):
        getattr(torch, device.backend).synchronize()


def results_to_dict(results: list[CheckResult]) -> list[dict[str, Any]]:
    """JSON-able list of the checks."""
    return [asdict(r) for r in results]
