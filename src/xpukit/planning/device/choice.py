"""Which machine and which device a plan is for, and the dtype on it.

``facts=`` may be recorded facts or a profile name; otherwise this machine is detected. The device
is the first available of xpu, cuda, mps, cpu unless one is asked for; an asked device that this
torch build or machine cannot give is refused with the install fix.
"""

from __future__ import annotations

import re

from xpukit.errors import DeviceSelectionError, DeviceUnavailableError, InvalidRequestError
from xpukit.machine.facts import BACKENDS, DeviceFacts, MachineFacts
from xpukit.machine.precision import inference_dtype, slow_precision
from xpukit.planning.vocabulary import Decision

__all__ = ["DEVICE_PATTERN", "INSTALL_FIX", "decide_dtype", "machine_for", "resolve_device"]

DEVICE_PATTERN = re.compile(r"^(?P<backend>xpu|cuda|mps|cpu)(?::(?P<index>\d+))?$")


INSTALL_FIX = {
    "xpu": "pip install torch --index-url https://download.pytorch.org/whl/xpu (and the Intel GPU driver: "
    "see 'PyTorch prerequisites for Intel GPUs')",
    "cuda": "pip install torch --index-url https://download.pytorch.org/whl/cu128 (the index for your CUDA "
    "version: see pytorch.org/get-started)",
    "mps": "MPS needs macOS 12.3+ on Apple silicon with the standard macOS torch wheel (pip install torch)",
}


def machine_for(facts: MachineFacts | str | None) -> tuple[MachineFacts, bool]:
    if isinstance(facts, MachineFacts):
        return facts, True
    if isinstance(facts, str):
        from xpukit.machine.profiles import machine_profile, parse_assume

        name, count = parse_assume(facts)
        return machine_profile(name, count), True
    if facts is not None:
        raise InvalidRequestError(
            f"facts={facts!r} must be MachineFacts or a profile name such as 'arc-b580x2'."
        )
    from xpukit.machine.probe import detect

    return detect(devices=True), False


def resolve_device(
    text: str | None, machine: MachineFacts, *, origin: str | None = None
) -> tuple[DeviceFacts, tuple[DeviceFacts, ...], Decision]:
    """The main device, the candidates for placement, and the ``device`` decision.

    ``origin`` says where ``text`` came from when it was not ``device=`` (a device_map, a launched
    job's rank); the decision then names that instead of ``device=``.
    """
    order = ", ".join(BACKENDS)
    said = origin or f"device={text!r} given"
    if text is None:
        if machine.devices:
            main = machine.devices[0]
            n = len(machine.devices)
            plural = "s" if n > 1 else ""
            reason = (
                f"first available backend in the order {order}: {n} {main.backend} device{plural} visible"
            )
            return main, machine.devices, Decision(name="device", value=main.torch_device, reason=reason)
        built = ", ".join(machine.compiled) or "CPU only"
        reason = f"no accelerator visible (torch build: {built}), so the CPU"
        return machine.cpu, (machine.cpu,), Decision(name="device", value="cpu", reason=reason)
    match = DEVICE_PATTERN.match(text)
    assert match is not None  # checked by parse_device
    backend, index = match["backend"], match["index"]
    if backend == "cpu":
        return (
            machine.cpu,
            (machine.cpu,),
            Decision(name="device", value="cpu", reason=said, source="user"),
        )
    if backend not in machine.compiled:
        build = machine.torch_version or "not installed"
        raise DeviceUnavailableError(
            f"device={text!r} was asked, but this torch build ({build}) has no {backend.upper()} support "
            f"(compiled backends: {', '.join(machine.compiled) or 'none'}). Fix: {INSTALL_FIX[backend]}"
        )
    devices = machine.devices_of(backend)
    if not devices:
        notes = "; ".join(machine.notes)
        raise DeviceUnavailableError(
            f"device={text!r} was asked; torch supports {backend} but no {backend} device is visible"
            + (f" ({notes})" if notes else "")
            + ". Check the driver, that the user is in the 'render' group (XPU), and ZE_AFFINITY_MASK / "
            "CUDA_VISIBLE_DEVICES; `xpukit doctor` shows what is seen."
        )
    if index is None:
        reason = f"{said}: the first of {len(devices)} visible"
        return (
            devices[0],
            devices,
            Decision(name="device", value=devices[0].torch_device, reason=reason, source="user"),
        )
    for d in devices:
        if d.index == int(index):
            return (
                d,
                (d,),
                Decision(name="device", value=d.torch_device, reason=said, source="user"),
            )
    raise DeviceSelectionError(
        f"device={text!r}: only {len(devices)} {backend} device(s) are visible "
        f"({', '.join(d.torch_device for d in devices)}). Fix: use one of those indices."
    )


def decide_dtype(
    requested: str, device: DeviceFacts, *, trained: tuple[str, str] | None = None
) -> tuple[Decision, tuple[str, ...]]:
    """The ``dtype`` decision: the one asked, else the dtype a trained adapter trained in (``trained``:
    that dtype and the record that says so; docs/training.md "Loading an adapter"), else the device's;
    with its warnings (a dtype asked that this device only emulates)."""
    if requested == "auto" and trained is not None:
        return _trained_dtype(*trained, device), ()
    if requested == "auto":
        choice = inference_dtype(device)
        return Decision(name="dtype", value=choice.dtype, reason=choice.reason, rejected=choice.rejected), ()
    reason = f"dtype={requested!r} given"
    slow = slow_precision(device, requested)
    if slow is None:
        return Decision(name="dtype", value=requested, reason=reason, source="user"), ()
    warning = f"dtype={slow}"
    reason = f"dtype={requested!r} given; {warning}"
    return Decision(name="dtype", value=requested, reason=reason, source="user"), (warning,)


def _trained_dtype(dtype: str, record: str, device: DeviceFacts) -> Decision:
    """A trained adapter with no dtype asked: the dtype it trained in, so it is the trained model."""
    reason = (
        f"the dtype the adapter was trained in ({dtype}), recorded with it in {record}: in it, the "
        "model computes what the trained one did"
    )
    slow = slow_precision(device, dtype)
    if slow is not None:
        reason += f"; {slow}, dtype= trades the likeness for speed"
    native = inference_dtype(device).dtype
    rejected = ((native, "the device's own dtype: not the one the adapter trained in"),)
    return Decision(name="dtype", value=dtype, reason=reason, rejected=rejected if native != dtype else ())
