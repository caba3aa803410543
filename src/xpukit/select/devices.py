"""Choosing which accelerator devices a process sees: ``select_devices`` → :class:`DeviceSelection`.

A selection is a validated set of environment variables (``ZE_AFFINITY_MASK`` and friends on Intel
GPUs, ``CUDA_VISIBLE_DEVICES`` on NVIDIA). Building one touches nothing: hand its :meth:`environ`
to a child process (what ``xpukit launch`` does), or :meth:`~DeviceSelection.apply` it in-process
before anything initialises the device runtime. The rules come from docs/platform-notes.md §1:

- The driver reads these variables once per process, at its first initialisation.
- ``ZE_AFFINITY_MASK`` filters but never reorders: ``2,0`` is the same as ``0,2``. CUDA enumerates
  in list order, so ``2,0`` does reorder there.
- Level Zero silently skips entries it cannot use (an index past the last device, ``X.Y`` outside
  COMPOSITE mode); CUDA drops an invalid entry and every entry after it. Both are refused here.
- Under ``ZE_ENABLE_PCI_ID_DEVICE_ORDER=1`` Level Zero numbers devices in PCI order, so an Intel
  integrated GPU (always at ``00:02.0``) is device 0 next to discrete cards, while torch's own count
  leaves it out; such machines are recognised from sysfs (:func:`xpukit.machine.probe.intel_display_devices`).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xpukit import _environ, _platform
from xpukit.errors import DeviceSelectionError, RuntimeAlreadyInitializedError
from xpukit.machine import probe
from xpukit.machine.facts import MachineFacts
from xpukit.select.counting import (
    count_from_facts,
    count_with_integrated,
    detect_backend,
    inherited_hierarchy,
    integrated_warnings,
    intel_mix,
    no_device_message,
)
from xpukit.select.spec import (
    HIERARCHIES,
    HIERARCHY_VARIABLE,
    MASK_VARIABLE,
    ORDER_VARIABLE,
    SELECTABLE_BACKENDS,
    SelectableBackend,
    check_cuda,
    check_range,
    check_xpu,
    parse_backend,
    parse_hierarchy,
    parse_spec,
    show,
)

__all__ = ["HIERARCHIES", "SELECTABLE_BACKENDS", "DeviceSelection", "select_devices"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSelection:
    """A validated device selection: the variables that make a process see exactly these devices.

    Attributes:
        backend: ``xpu`` or ``cuda``.
        spec: the selection in canonical form (``0,2``, ``all``, ``0.1``…), as ``xpukit launch
            --devices`` takes it.
        devices: the selected entries, in the order the program will see them; empty when
            ``selects_all``.
        env: the variables to set, e.g. ``{"ZE_AFFINITY_MASK": "0,2",
            "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}``.
        unset: variables to remove from the child's environment (the mask, when all devices are
            selected, so that an exported mask cannot narrow them).
        hierarchy: the Level Zero hierarchy the spec was checked against (asked for, or read from
            ``ZE_FLAT_DEVICE_HIERARCHY``); ``None`` means the driver's default.
        device_count: how many devices the indices were checked against; ``None`` when the count
            could not be known without initialising a runtime (then only the syntax was checked).
        notes: what was assumed or could not be checked, in words.
        warnings: what may make the program run somewhere other than the user expects (e.g. index 0
            being an integrated GPU); ``xpukit launch`` prints them on stderr.
        integrated: the ordinals of integrated GPUs that this machine lists next to discrete ones.
            Torch leaves an integrated GPU out whenever a discrete one is visible, which
            ``visible_count`` takes into account.
    """

    backend: SelectableBackend
    spec: str
    devices: tuple[str, ...]
    env: dict[str, str]
    unset: tuple[str, ...] = ()
    hierarchy: str | None = None
    device_count: int | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    integrated: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Frozen means frozen: never share (or expose for mutation) the caller's dict.
        object.__setattr__(self, "env", dict(self.env))

    @property
    def count_known(self) -> bool:
        """Whether indices were checked against a known device count (not only their syntax)."""
        return self.device_count is not None

    @property
    def selects_all(self) -> bool:
        """Whether every device stays visible (no mask)."""
        return not self.devices

    @property
    def visible_count(self) -> int | None:
        """How many devices the program will see, or ``None`` when that depends on the machine.

        In COMPOSITE mode the tiles of one card form one device, so cards are counted. Torch leaves
        an integrated GPU out while a discrete one is visible, so it counts only when alone.
        """
        integrated = {str(i) for i in self.integrated}
        if self.selects_all:
            if self.device_count is None or self.device_count <= len(integrated):
                return self.device_count
            return self.device_count - len(integrated)  # torch shows the discrete devices only
        cards = [d.partition(".")[0] for d in self.devices]
        if integrated and any(card not in integrated for card in cards):
            cards = [card for card in cards if card not in integrated]
        if self.backend == "xpu" and self.hierarchy == "COMPOSITE":
            return len(set(cards))
        return len(cards)

    @property
    def torch_devices(self) -> tuple[str, ...] | None:
        """The torch device names the program will see (``xpu:0``, ``xpu:1``…), if known."""
        n = self.visible_count
        return None if n is None else tuple(f"{self.backend}:{i}" for i in range(n))

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """A copy of ``base`` (default: ``os.environ``) with this selection applied.

        Args:
            base: the environment to start from; it is not modified.

        Returns:
            A new dict for ``subprocess.run(..., env=...)``.
        """
        out = dict(os.environ if base is None else base)
        for name in self.unset:
            out.pop(name, None)
        out.update(self.env)
        return out

    def shell_prefix(self, shell: str | None = None) -> str:
        """The selection as a shell command prefix.

        For example ``ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1``. Variables to remove are
        written with ``env -u NAME`` (an empty value would mean "no device" to CUDA). PowerShell and
        cmd have no per-command form: their prefix sets the variables in that shell window
        (docs/windows.md "Shells"); ``xpukit launch`` scopes them to the one command.

        Args:
            shell: ``"posix"``, ``"powershell"`` or ``"cmd"``; default: PowerShell on Windows, else
                POSIX.

        Returns:
            The prefix, without the command.

        Raises:
            InvalidRequestError: an unknown shell.

        Example:
            >>> from xpukit import select_devices
            >>> sel = select_devices("0,2", backend="xpu")
            >>> sel.shell_prefix("posix")
            'ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1'
            >>> sel.shell_prefix("powershell")
            "$env:ZE_AFFINITY_MASK = '0,2'; $env:ZE_ENABLE_PCI_ID_DEVICE_ORDER = '1';"
            >>> sel.shell_prefix("cmd")
            'set "ZE_AFFINITY_MASK=0,2" && set "ZE_ENABLE_PCI_ID_DEVICE_ORDER=1" &&'
        """
        return _platform.env_prefix(self.env, self.unset, shell=shell)

    def command_line(self, command: Sequence[str], shell: str | None = None) -> str:
        """The exact shell line that runs ``command`` with this selection, properly quoted.

        Args:
            command: the program and its arguments.
            shell: as for :meth:`shell_prefix`.

        Returns:
            One line to paste into that shell.
        """
        return f"{self.shell_prefix(shell)} {_platform.join_command(command, shell=shell)}".strip()

    def conflicts(self, base: Mapping[str, str] | None = None) -> dict[str, tuple[str, str | None]]:
        """Variables exported in ``base`` that this selection overrides or removes.

        Returns:
            ``{name: (exported value, value this selection uses or None when removed)}``.
        """
        env = os.environ if base is None else base
        out: dict[str, tuple[str, str | None]] = {}
        for name in (*self.unset, *self.env):
            exported = _environ.get(name, environ=env)
            wanted = self.env.get(name)
            if exported is not None and exported != wanted:
                out[name] = (exported, wanted)
        return out

    def apply(self) -> None:
        """Set this selection in ``os.environ`` for the current process.

        Only works before the device runtime reads the variables (at its first initialisation).
        Applying a selection that is already in effect is always allowed. A different mask already
        exported is replaced with a logged warning (``xpukit launch`` warns the same way).

        Raises:
            RuntimeAlreadyInitializedError: the XPU or CUDA runtime of this process is initialised,
                so the change could not take effect; ``os.environ`` is left unchanged.
        """
        pending = self._pending(os.environ)
        if not pending:
            return
        if probe.runtime_initialized():
            changes = ", ".join(f"{name} ({old} → {new})" for name, (old, new) in pending.items())
            raise RuntimeAlreadyInitializedError(
                f"select_devices({self.spec!r}).apply() would change {changes}, but the device runtime "
                "of this process is already initialised and reads these variables only once, so the "
                "program would stay on the devices it has. Fix: select devices before the process "
                f"starts: `{self.launch_hint()}`, or `{self.command_line(['python', 'train.py'])}`; in a "
                "notebook, restart the kernel and call apply() before anything touches the device."
            )
        for name, (exported, used) in self.conflicts(os.environ).items():
            # As `xpukit launch` warns: an exported mask replaced is a job moved to other devices.
            now = f"replaced by {name}={used}" if used is not None else "removed"
            logger.warning(
                "select_devices(%r).apply(): %s=%s was exported and is %s in this process. Indices name the "
                "machine's devices, not positions in the exported mask; if that mask was meant (a job "
                "scheduler's, say), do not apply this selection.",
                self.spec,
                name,
                exported,
                now,
            )
        for name in self.unset:
            os.environ.pop(name, None)
        os.environ.update(self.env)

    def _pending(self, env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
        """What applying to ``env`` would change: ``{name: (old, new)}``, ``unset`` for absent."""
        out = {name: (env[name], "unset") for name in self.unset if name in env}
        for name, value in self.env.items():
            if env.get(name) != value:
                out[name] = (env.get(name, "unset"), value)
        return out

    def launch_hint(self, command: str = "python train.py") -> str:
        """The ``xpukit launch`` command line that runs ``command`` with this selection."""
        chosen = self.env.get(HIERARCHY_VARIABLE)
        hierarchy = f" --hierarchy {chosen.lower()}" if chosen else ""
        spec = shlex.quote(self.spec)
        return f"xpukit launch --devices {spec} --backend {self.backend}{hierarchy} -- {command}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the selection."""
        return {
            "backend": self.backend,
            "spec": self.spec,
            "devices": list(self.devices),
            "env": dict(self.env),
            "unset": list(self.unset),
            "hierarchy": self.hierarchy,
            "device_count": self.device_count,
            "visible_count": self.visible_count,
            "shell_prefix": self.shell_prefix(),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "integrated": list(self.integrated),
        }


def select_devices(
    spec: str | int | Sequence[int | str],
    *,
    backend: str | None = None,
    hierarchy: str | None = None,
    facts: MachineFacts | None = None,
) -> DeviceSelection:
    """Validate a device selection and build the variables that make it happen. Touches nothing.

    Args:
        spec: ``"0,2"``, a range ``"0-3"``, ``"all"``, an int, or a list of ints. Intel tiles
            ``"0.1"`` (card 0, tile 1) only in COMPOSITE hierarchy; CUDA also takes GPU UUIDs
            (``GPU-8932f937``) and MIG ids (``MIG-…``).
        backend: ``"xpu"`` or ``"cuda"``. Default: the detected accelerator. A named backend needs
            no device here (e.g. a login node writing a job script for a GPU node).
        hierarchy: ``"FLAT"``, ``"COMPOSITE"`` or ``"COMBINED"`` (any case), written to
            ``ZE_FLAT_DEVICE_HIERARCHY``. Default: the value already in the environment, if any.
        facts: the machine's facts (e.g. ``xpukit.detect()`` or a profile) to check indices against.
            Without them the count is detected only when ``backend`` is not named, and only in ways
            that do not initialise a runtime; and this machine's PCI bus (sysfs) is read to recognise
            an Intel integrated GPU next to discrete ones (see ``DeviceSelection.warnings``).

    Returns:
        A frozen :class:`DeviceSelection`.

    Raises:
        DeviceSelectionError: the spec is empty or malformed; an index is negative, repeated or out
            of range; an Intel list is not increasing (the mask cannot reorder); a tile is asked
            outside COMPOSITE mode; ``facts`` is not a ``MachineFacts``; or no backend was named and
            no XPU or CUDA device was found.

    Example:
        >>> sel = select_devices("0,2", backend="xpu")
        >>> sel.shell_prefix()
        'ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1'
    """
    entries, selects_all = parse_spec(spec)
    where = f"select_devices({show(spec)})"
    if facts is not None and not isinstance(facts, MachineFacts):
        raise DeviceSelectionError(
            f"{where}: facts must be a MachineFacts (`xpukit.detect()`, or a profile such as "
            f"`xpukit.machine.profiles.machine_profile('arc-b580', 2)`), or None; got {type(facts).__name__}."
        )
    named = parse_backend(backend, where)
    wanted_hierarchy = parse_hierarchy(hierarchy, where)
    count: int | None = None
    if named is not None:
        chosen: SelectableBackend = named
        how = "backend named and no facts given: indices were checked for syntax only"
        if facts is not None:
            count, how = count_from_facts(chosen, facts, wanted_hierarchy)
    elif facts is not None:
        if facts.accelerator not in SELECTABLE_BACKENDS:
            raise DeviceSelectionError(f"{where}: {no_device_message(facts)}")
        chosen = "xpu" if facts.accelerator == "xpu" else "cuda"
        count, how = count_from_facts(chosen, facts, wanted_hierarchy)
    else:
        chosen, count, how = detect_backend(wanted_hierarchy, where)
    notes: list[str] = []
    warnings: tuple[str, ...] = ()
    integrated: tuple[int, ...] = ()

    if chosen == "cuda":
        if wanted_hierarchy:
            raise DeviceSelectionError(
                f"{where}: hierarchy={show(hierarchy)} applies to Intel GPUs only "
                "(ZE_FLAT_DEVICE_HIERARCHY); drop it for CUDA."
            )
        check_cuda(entries, where)
        effective = None
    else:
        effective = wanted_hierarchy or inherited_hierarchy(facts, notes)
        check_xpu(entries, effective, where)
        if effective is None and facts and any(d.family == "max" for d in facts.devices_of("xpu")):
            notes.append(
                "Data Center GPU Max in the driver's default FLAT mode: every stack is its own "
                "device (a Max 1550 counts as 2)"
            )
        # Facts may describe another machine; only without them is this machine's PCI bus relevant.
        mix = intel_mix() if facts is None else None
        if mix is not None:
            integrated = mix.integrated
            if named is None:  # counted on this machine: the count must be Level Zero's, not torch's
                count, how = count_with_integrated(mix, count, how, effective)
            warnings = tuple(integrated_warnings(mix, entries))
    if count is not None:
        check_range(entries, count, chosen, how, where)

    env: dict[str, str] = {}
    if not selects_all:
        env[MASK_VARIABLE[chosen]] = ",".join(e.text for e in entries)
    order_name, order_value = ORDER_VARIABLE[chosen]
    env[order_name] = order_value
    # Write the hierarchy down even when it was inherited: it was checked in that hierarchy, and
    # the same mask names other devices in another (`0,1` is two cards in COMPOSITE, two stacks of
    # card 0 in FLAT), so the line must not depend on what the shell it runs in exports.
    if effective:
        env[HIERARCHY_VARIABLE] = effective
    return DeviceSelection(
        backend=chosen,
        spec="all" if selects_all else ",".join(e.text for e in entries),
        devices=tuple(e.text for e in entries),
        env=env,
        unset=(MASK_VARIABLE[chosen],) if selects_all else (),
        hierarchy=effective,
        device_count=count,
        notes=(how, *notes),
        warnings=warnings,
        integrated=integrated,
    )


# --- device counts ---------------------------------------------------------------------------------


# --- an Intel integrated GPU next to discrete ones -------------------------------------------------
