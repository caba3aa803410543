"""Choosing which accelerator devices a process sees: ``select_devices`` → :class:`DeviceSelection`.

A selection is a validated set of environment variables (``ZE_AFFINITY_MASK`` and friends on Intel
GPUs, ``CUDA_VISIBLE_DEVICES`` on NVIDIA). Building one touches nothing: hand its :meth:`environ`
to a child process (what ``xpukit launch`` does), or :meth:`~DeviceSelection.apply` it in-process
before anything initialises the device runtime. The rules come from platform.md §1:

- The driver reads these variables once per process, at its first initialisation.
- ``ZE_AFFINITY_MASK`` filters but never reorders: ``2,0`` is the same as ``0,2``. CUDA enumerates
  in list order, so ``2,0`` does reorder there.
- Level Zero silently skips entries it cannot use (an index past the last device, ``X.Y`` outside
  COMPOSITE mode); CUDA drops an invalid entry and every entry after it. Both are refused here.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from xpukit import _environ, probe
from xpukit.errors import DeviceSelectionError, RuntimeAlreadyInitializedError
from xpukit.facts import MachineFacts

__all__ = ["HIERARCHIES", "SELECTABLE_BACKENDS", "DeviceSelection", "select_devices"]

SelectableBackend = Literal["xpu", "cuda"]
SELECTABLE_BACKENDS: tuple[SelectableBackend, ...] = ("xpu", "cuda")
HIERARCHIES = ("FLAT", "COMPOSITE", "COMBINED")

# The variable that narrows the visible devices, and the one that fixes their order, per backend.
_MASK: dict[SelectableBackend, str] = {"xpu": "ZE_AFFINITY_MASK", "cuda": "CUDA_VISIBLE_DEVICES"}
_ORDER: dict[SelectableBackend, tuple[str, str]] = {
    "xpu": ("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1"),
    "cuda": ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
}
_HIERARCHY = "ZE_FLAT_DEVICE_HIERARCHY"
_MAX_INDEX = 127  # torch's DeviceIndex is an int8: no process can address more devices than this

_INDEX = re.compile(r"[0-9]+", re.ASCII)
_RANGE = re.compile(r"([0-9]+)-([0-9]+)", re.ASCII)
_TILE = re.compile(r"([0-9]+)\.([0-9]+)", re.ASCII)
_HEX = r"[0-9a-fA-F]+(?:-[0-9a-fA-F]+)*-?"
_GPU_UUID = re.compile(rf"GPU-{_HEX}", re.ASCII)  # a unique prefix is enough for CUDA
_MIG_ID = re.compile(rf"MIG-(?:GPU-{_HEX}/[0-9]+/[0-9]+|{_HEX})", re.ASCII)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One selected device: an ordinal, a tile ``card.tile``, or a CUDA UUID / MIG id."""

    text: str
    kind: Literal["index", "tile", "uuid"]
    card: int = -1
    tile: int = -1


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
    """

    backend: SelectableBackend
    spec: str
    devices: tuple[str, ...]
    env: dict[str, str]
    unset: tuple[str, ...] = ()
    hierarchy: str | None = None
    device_count: int | None = None
    notes: tuple[str, ...] = ()

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

        In COMPOSITE mode the tiles of one card form one device, so cards are counted.
        """
        if self.selects_all:
            return self.device_count
        if self.backend == "xpu" and self.hierarchy == "COMPOSITE":
            return len({d.partition(".")[0] for d in self.devices})
        return len(self.devices)

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

    def shell_prefix(self) -> str:
        """The selection as a shell command prefix.

        For example ``ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1``. Variables to remove are
        written with ``env -u NAME`` (an empty value would mean "no device" to CUDA).
        """
        parts = ["env", *(f"-u {name}" for name in self.unset)] if self.unset else []
        parts += [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join(parts)

    def command_line(self, command: Sequence[str]) -> str:
        """The exact shell line that runs ``command`` with this selection, properly quoted."""
        return f"{self.shell_prefix()} {shlex.join(command)}".strip()

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
        Applying a selection that is already in effect is always allowed.

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
        chosen = self.env.get(_HIERARCHY)
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
            that do not initialise a runtime.

    Returns:
        A frozen :class:`DeviceSelection`.

    Raises:
        DeviceSelectionError: the spec is empty or malformed; an index is negative, repeated or out
            of range; an Intel list is not increasing (the mask cannot reorder); a tile is asked
            outside COMPOSITE mode; or no backend was named and no XPU or CUDA device was found.

    Example:
        >>> sel = select_devices("0,2", backend="xpu")
        >>> sel.shell_prefix()
        'ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1'
    """
    entries, selects_all = _parse(spec)
    where = f"select_devices({_show(spec)})"
    named = _backend(backend, where)
    wanted_hierarchy = _hierarchy(hierarchy, where)
    count: int | None = None
    if named is not None:
        chosen: SelectableBackend = named
        how = "backend named and no facts given: indices were checked for syntax only"
        if facts is not None:
            count, how = _count_from_facts(chosen, facts, wanted_hierarchy)
    elif facts is not None:
        if facts.accelerator not in SELECTABLE_BACKENDS:
            raise DeviceSelectionError(f"{where}: {_no_device_message(facts)}")
        chosen = "xpu" if facts.accelerator == "xpu" else "cuda"
        count, how = _count_from_facts(chosen, facts, wanted_hierarchy)
    else:
        chosen, count, how = _detect(wanted_hierarchy, where)
    notes = [how]

    if chosen == "cuda":
        if wanted_hierarchy:
            raise DeviceSelectionError(
                f"{where}: hierarchy={hierarchy!r} applies to Intel GPUs only (ZE_FLAT_DEVICE_HIERARCHY); "
                "drop it for CUDA."
            )
        _check_cuda(entries, where)
        effective = None
    else:
        effective = wanted_hierarchy or _inherited_hierarchy(facts, notes)
        _check_xpu(entries, effective, where)
        if effective is None and facts and any(d.family == "max" for d in facts.devices_of("xpu")):
            notes.append(
                "Data Center GPU Max in the driver's default FLAT mode: every stack is its own "
                "device (a Max 1550 counts as 2)"
            )
    if count is not None:
        _check_range(entries, count, chosen, how, where)

    env: dict[str, str] = {}
    if not selects_all:
        env[_MASK[chosen]] = ",".join(e.text for e in entries)
    order_name, order_value = _ORDER[chosen]
    env[order_name] = order_value
    # A tile only means something in COMPOSITE mode: write the mode down even when it was inherited,
    # so that the selection does not depend on what happens to be exported.
    if effective and (wanted_hierarchy or any(e.kind == "tile" for e in entries)):
        env[_HIERARCHY] = effective
    return DeviceSelection(
        backend=chosen,
        spec="all" if selects_all else ",".join(e.text for e in entries),
        devices=tuple(e.text for e in entries),
        env=env,
        unset=(_MASK[chosen],) if selects_all else (),
        hierarchy=effective,
        device_count=count,
        notes=tuple(notes),
    )


def _inherited_hierarchy(facts: MachineFacts | None, notes: list[str]) -> str | None:
    """``ZE_FLAT_DEVICE_HIERARCHY`` from the facts' environment, else from this process's."""
    value = _environ.get(_HIERARCHY, environ=facts.env if facts is not None else None)
    if value is None or value in HIERARCHIES:
        return value
    # The driver compares the exact upper-case names; anything else leaves its default in place.
    notes.append(f"{_HIERARCHY}={value!r} is not a value the driver knows: treated as its default")
    return None


# --- parsing ---------------------------------------------------------------------------------------


def _show(spec: object) -> str:
    text = repr(spec)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(spec: object) -> tuple[list[_Entry], bool]:
    where = f"select_devices({_show(spec)})"
    if isinstance(spec, bool) or not isinstance(spec, (str, int, list, tuple)):
        raise DeviceSelectionError(
            f"{where}: a device spec is a string such as '0,2', '0-3' or 'all', an int, or a list "
            f"of ints; got {type(spec).__name__}."
        )
    if isinstance(spec, str):
        tokens: list[object] = list(spec.split(","))
        if spec.strip().lower() == "all":
            return [], True
    elif isinstance(spec, int):
        tokens = [spec]
    else:
        tokens = list(spec)
        if any(isinstance(t, str) and "," in t for t in tokens):
            raise DeviceSelectionError(f"{where}: write one device per list item, not comma lists.")
    if not tokens or tokens == [""] or (isinstance(spec, str) and not spec.strip()):
        raise DeviceSelectionError(f"{where}: the spec is empty. Name devices ('0', '0,2', '0-3') or 'all'.")
    entries: list[_Entry] = []
    for token in tokens:
        entries.extend(_parse_token(token, where))
    return entries, False


def _parse_token(token: object, where: str) -> list[_Entry]:
    if isinstance(token, bool) or not isinstance(token, (int, str)):
        raise DeviceSelectionError(f"{where}: list items must be ints or strings, got {token!r}.")
    text = str(token).strip()
    if (isinstance(token, int) and token < 0) or re.fullmatch(r"-[0-9]+", text, re.ASCII):
        raise DeviceSelectionError(f"{where}: negative device index {text}; indices start at 0.")
    if _INDEX.fullmatch(text):
        return [_Entry(str(_index(text, where)), "index", card=int(text))]
    if m := _RANGE.fullmatch(text):
        lo, hi = _index(m[1], where), _index(m[2], where)
        if hi < lo:
            raise DeviceSelectionError(
                f"{where}: range {text!r} goes down; write it as '{hi}-{lo}' (ranges go up)."
            )
        return [_Entry(str(i), "index", card=i) for i in range(lo, hi + 1)]
    if m := _TILE.fullmatch(text):
        card, tile = _index(m[1], where), _index(m[2], where)
        return [_Entry(f"{card}.{tile}", "tile", card=card, tile=tile)]
    if _GPU_UUID.fullmatch(text) or _MIG_ID.fullmatch(text):
        return [_Entry(text, "uuid")]
    if text.lower() == "all":
        raise DeviceSelectionError(f"{where}: 'all' cannot be combined with other devices.")
    reason = "an empty entry (two commas, or a comma at an end)" if not text else repr(text)
    raise DeviceSelectionError(
        f"{where}: cannot read {reason}. Valid entries: an index '2', a range '0-3', a tile '0.1' "
        "(Intel, COMPOSITE mode), a GPU UUID 'GPU-…' or MIG id 'MIG-…' (CUDA), or 'all' alone."
    )


def _index(text: str, where: str) -> int:
    value = int(text)
    if value > _MAX_INDEX:
        raise DeviceSelectionError(
            f"{where}: device index {value} is past {_MAX_INDEX}, the highest index torch can address."
        )
    return value


def _backend(backend: str | None, where: str) -> SelectableBackend | None:
    if backend is None:
        return None
    name = backend.strip().lower() if isinstance(backend, str) else backend
    if name == "xpu" or name == "cuda":
        return name  # type: ignore[return-value]  # narrowed by the comparison
    why = {
        "mps": "Apple GPUs are one device, with no variable to choose among them",
        "cpu": "the CPU needs no device selection",
    }.get(str(name), "it is not a backend with a device-visibility variable")
    raise DeviceSelectionError(
        f"{where}: backend={backend!r} cannot be selected ({why}). Valid backends: 'xpu', 'cuda'."
    )


def _hierarchy(hierarchy: str | None, where: str) -> str | None:
    if hierarchy is None:
        return None
    value = hierarchy.strip().upper() if isinstance(hierarchy, str) else None
    if value not in HIERARCHIES:
        raise DeviceSelectionError(
            f"{where}: hierarchy={hierarchy!r} is not a Level Zero hierarchy. Valid: FLAT, COMPOSITE, "
            "COMBINED (any case)."
        )
    return value


# --- checks ----------------------------------------------------------------------------------------


def _check_xpu(entries: list[_Entry], hierarchy: str | None, where: str) -> None:
    for e in entries:
        if e.kind == "uuid":
            raise DeviceSelectionError(
                f"{where}: {e.text!r} is a CUDA identifier; ZE_AFFINITY_MASK takes device ordinals only "
                "('0,2'), or tiles ('0.1') in COMPOSITE mode."
            )
        if e.kind == "tile" and hierarchy != "COMPOSITE":
            mode = f"{hierarchy} mode" if hierarchy else "the driver's default mode (FLAT on current drivers)"
            raise DeviceSelectionError(
                f"{where}: tile {e.text!r} (card {e.card}, tile {e.tile}) only means something in "
                f"COMPOSITE mode; in {mode} the driver silently skips it. Either ask for "
                "hierarchy='COMPOSITE' (`--hierarchy composite`), or name the tile by its FLAT index: "
                "in FLAT mode every tile is its own device, numbered card by card (two cards of two "
                "tiles: card 0 → 0,1; card 1 → 2,3)."
            )
    _check_unique(entries, where)
    # A whole card sorts before its own tiles; the uniqueness check already refused that overlap.
    keys = [(e.card, e.tile) for e in entries]
    if keys != sorted(keys):
        ordered = [e.text for _, e in sorted(zip(keys, entries, strict=True), key=lambda p: p[0])]
        if all(e.kind == "index" for e in entries):
            seen = " and ".join(f"device {t} as xpu:{i}" for i, t in enumerate(ordered))
        else:
            seen = "them in the order " + ",".join(ordered)
        raise DeviceSelectionError(
            f"{where}: ZE_AFFINITY_MASK cannot reorder devices: asked for "
            f"{','.join(e.text for e in entries)}, but the program would still see {seen} (Level "
            f"Zero keeps its own order). Write them in increasing order ('{','.join(ordered)}'). For "
            "another rank → device mapping keep them all visible and pick `xpu:<index>` in the "
            "program; processes that never communicate can each be launched with one device "
            f"(`xpukit launch --devices {entries[0].text} -- ...`)."
        )


def _check_unique(entries: list[_Entry], where: str) -> None:
    seen: set[str] = set()
    whole_cards = {e.card for e in entries if e.kind == "index"}
    for e in entries:
        if e.text in seen:
            raise DeviceSelectionError(f"{where}: device {e.text!r} is listed twice; name each device once.")
        seen.add(e.text)
        if e.kind == "tile" and e.card in whole_cards:
            raise DeviceSelectionError(
                f"{where}: tile {e.text!r} is already selected by card '{e.card}', which holds all its "
                "tiles; name each device once."
            )


def _check_cuda(entries: list[_Entry], where: str) -> None:
    if any(e.kind == "tile" for e in entries):
        raise DeviceSelectionError(
            f"{where}: CUDA has no 'card.tile' form; name a MIG instance by its MIG id (`nvidia-smi -L`)."
        )
    kinds = {e.kind for e in entries}
    if len(kinds) > 1:
        raise DeviceSelectionError(
            f"{where}: mixes indices with UUIDs/MIG ids; use one form (CUDA's handling of mixed lists "
            "is not documented)."
        )
    _check_unique(entries, where)


def _check_range(
    entries: list[_Entry], count: int, backend: SelectableBackend, source: str, where: str
) -> None:
    bad = [e.text for e in entries if e.kind != "uuid" and e.card >= count]
    if not bad:
        return
    valid = "none" if count == 0 else ("0" if count == 1 else f"0-{count - 1}")
    effect = (
        "Level Zero would silently skip it and run on fewer devices"
        if backend == "xpu"
        else "CUDA would hide it and every device listed after it"
    )
    raise DeviceSelectionError(
        f"{where}: device {', '.join(bad)} is out of range: {source}. {effect}. Valid indices: "
        f"{valid}, or 'all'. To build the variables for another machine, name the backend and give "
        "no facts: then only the syntax is checked."
    )


# --- device counts ---------------------------------------------------------------------------------


def _count_from_facts(
    backend: SelectableBackend, facts: MachineFacts, hierarchy: str | None
) -> tuple[int | None, str]:
    devices = facts.devices_of(backend)
    if not devices:
        return None, f"the facts list no {backend} devices: indices were checked for syntax only"
    mask = _MASK[backend]
    if mask in facts.env:
        return None, (
            f"the facts were read under {mask}={facts.env[mask]}, so they count only the devices it let "
            "through: indices were checked for syntax only"
        )
    facts_composite = facts.env.get(_HIERARCHY) == "COMPOSITE"
    multi_stack = any(d.family == "max" for d in devices)
    if hierarchy and (hierarchy == "COMPOSITE") != facts_composite and multi_stack:
        return None, (
            f"the facts were read in another hierarchy than {hierarchy}, and a multi-stack GPU counts "
            "differently there: indices were checked for syntax only"
        )
    return len(devices), f"the facts ({facts.source}) show {len(devices)} {backend} device(s)"


def _detect(hierarchy: str | None, where: str) -> tuple[SelectableBackend, int | None, str]:
    facts = probe.detect(devices=False)  # the build only: initialises nothing
    unknown: list[tuple[SelectableBackend, str]] = []
    for backend in SELECTABLE_BACKENDS:
        if backend not in facts.compiled:
            continue
        count, how = _count_without_init(backend, hierarchy)
        if count is None:
            unknown.append((backend, how))
        elif count > 0:
            return backend, count, f"{how} shows {count} {backend} device(s)"
    if unknown:
        backend, how = unknown[0]
        return backend, None, f"{how}: indices were checked for syntax only"
    raise DeviceSelectionError(f"{where}: {_no_device_message(facts)}")


def _count_without_init(backend: SelectableBackend, hierarchy: str | None) -> tuple[int | None, str]:
    """The machine's device count where it can be had without initialising a runtime, else None.

    Uses the counting paths torch itself uses before initialisation (private helpers, looked up
    with getattr so that a torch without them simply gives "unknown"): NVML for CUDA, Level Zero
    Sysman through ``pyzes`` for XPU (torch ≥ 2.13). Both ignore any exported mask.
    """
    import warnings

    import torch

    module = getattr(torch, backend)
    if module.is_initialized():
        # Already initialised: asking costs nothing more, but the answer is the masked view.
        if _environ.get(_MASK[backend]) is None:
            return int(module.device_count()), "the initialised runtime"
        return None, f"the runtime is initialised under an exported {_MASK[backend]}"
    if backend == "cuda":
        if getattr(torch.version, "hip", None):
            return None, "ROCm builds cannot count devices through NVML"
        counter, how = getattr(module, "_raw_device_count_nvml", None), "NVML"
        args: tuple[Any, ...] = ()
    else:
        inherited = _environ.get(_HIERARCHY) == "COMPOSITE"
        if hierarchy and (hierarchy == "COMPOSITE") != inherited:
            return None, f"Level Zero Sysman counts in the exported hierarchy, not {hierarchy}"
        counter, how = getattr(module, "_raw_device_count_zes", None), "Level Zero Sysman (pyzes)"
        args = (list(range(_MAX_INDEX + 1)),)  # "every index visible": ignore an exported mask
    if counter is None:
        return None, f"this torch has no way to count {backend} devices without initialising them"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Can't initialize NVML" is an answer, not a warning
            count = int(counter(*args))
    except (OSError, AttributeError, RuntimeError, ImportError):
        count = -1
    if count < 0:
        return None, f"{how} could not count {backend} devices"
    return count, how


def _no_device_message(facts: MachineFacts) -> str:
    build = (
        f"torch {facts.torch_version} (compiled backends: {', '.join(facts.compiled) or 'none'})"
        if facts.torch_version
        else "torch is not installed"
    )
    return (
        f"no XPU or CUDA device was found; {build}. To build the variables for another machine, name "
        "the backend: backend='xpu' or 'cuda' (`xpukit launch --backend xpu ...`). `xpukit doctor` "
        "shows why no device is visible here."
    )
