"""Parsing and validating a device-selection spec (``"0,2"``, ``"0-3"``, ``"0.1"``, UUIDs): pure.

Split out of :mod:`xpukit.select.devices`, which builds the environment from what this module accepts.
Every refusal is a :class:`~xpukit.errors.DeviceSelectionError` that names the spec and the fix.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from typing import Literal

from xpukit.errors import DeviceSelectionError

__all__ = [
    "HIERARCHIES",
    "HIERARCHY_VARIABLE",
    "MASK_VARIABLE",
    "MAX_INDEX",
    "ORDER_VARIABLE",
    "SELECTABLE_BACKENDS",
    "Entry",
    "SelectableBackend",
    "check_cuda",
    "check_range",
    "check_xpu",
    "parse_backend",
    "parse_hierarchy",
    "parse_spec",
    "show",
    "unreadable_mask_entries",
]

SelectableBackend = Literal["xpu", "cuda"]
SELECTABLE_BACKENDS: tuple[SelectableBackend, ...] = ("xpu", "cuda")
HIERARCHIES = ("FLAT", "COMPOSITE", "COMBINED")

# The variable that narrows the visible devices, and the one that fixes their order, per backend
# (docs/devices.md).
MASK_VARIABLE: dict[SelectableBackend, str] = {"xpu": "ZE_AFFINITY_MASK", "cuda": "CUDA_VISIBLE_DEVICES"}
ORDER_VARIABLE: dict[SelectableBackend, tuple[str, str]] = {
    "xpu": ("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1"),
    "cuda": ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
}
HIERARCHY_VARIABLE = "ZE_FLAT_DEVICE_HIERARCHY"

MAX_INDEX = 127  # torch's DeviceIndex is an int8: no process can address more devices than this

_INDEX = re.compile(r"[0-9]+", re.ASCII)
_RANGE = re.compile(r"([0-9]+)-([0-9]+)", re.ASCII)
_TILE = re.compile(r"([0-9]+)\.([0-9]+)", re.ASCII)
_HEX = r"[0-9a-fA-F]+(?:-[0-9a-fA-F]+)*-?"
_GPU_UUID = re.compile(rf"GPU-{_HEX}", re.ASCII)  # a unique prefix is enough for CUDA
_MIG_ID = re.compile(rf"MIG-(?:GPU-{_HEX}/[0-9]+/[0-9]+|{_HEX})", re.ASCII)


@dataclass(frozen=True, slots=True)
class Entry:
    """One selected device: an ordinal, a tile ``card.tile``, or a CUDA UUID / MIG id."""

    text: str
    kind: Literal["index", "tile", "uuid"]
    card: int = -1
    tile: int = -1


# --- parsing ---------------------------------------------------------------------------------------


class _ShortRepr(reprlib.Repr):
    """``repr`` for messages: bounded in length, and safe for ints past ``str()``'s digit limit."""

    def repr_int(self, x: int, level: int) -> str:
        if abs(x) > 10**30:
            return f"<an int of {_digits(x)} digits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()
_SHORT.maxstring = 50
_SHORT.maxother = 50


def show(value: object) -> str:
    """A short, always printable ``repr`` of a user's value (huge ints become "an int of N digits")."""
    text = _SHORT.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _digits(value: int) -> int:
    """The number of decimal digits of ``value``, without ``str()`` (limited to 4300 digits)."""
    value = abs(value)
    n = int((value.bit_length() - 1) * math.log10(2)) + 1 if value else 1
    # The float estimate can be off by one either way for very large values.
    while n > 1 and value < 10 ** (n - 1):
        n -= 1
    while value >= 10**n:
        n += 1
    return n


def parse_spec(spec: object) -> tuple[list[Entry], bool]:
    where = f"select_devices({show(spec)})"
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
    entries: list[Entry] = []
    for token in tokens:
        entries.extend(_parse_token(token, where))
        if len(entries) > MAX_INDEX + 1:  # some are repeated; stop before a huge list is built
            raise DeviceSelectionError(
                f"{where}: names more than {MAX_INDEX + 1} devices, more than torch can address; "
                "name each device once."
            )
    return entries, False


def _parse_token(token: object, where: str) -> list[Entry]:
    if isinstance(token, bool) or not isinstance(token, (int, str)):
        raise DeviceSelectionError(f"{where}: list items must be ints or strings, got {show(token)}.")
    if isinstance(token, int):
        # Compare before str(): an int past 4300 digits cannot be turned into a string.
        if token < 0:
            raise DeviceSelectionError(f"{where}: negative device index {show(token)}; indices start at 0.")
        if token > MAX_INDEX:
            raise DeviceSelectionError(f"{where}: device index {show(token)} is past {_past_max()}.")
        token = str(int(token))  # int(): an int subclass (IntEnum…) may print as its name
    text = token.strip()
    if re.fullmatch(r"-[0-9]+", text, re.ASCII):
        raise DeviceSelectionError(f"{where}: negative device index {_show_index(text)}; indices start at 0.")
    if _INDEX.fullmatch(text):
        index = _index(text, where)
        return [Entry(str(index), "index", card=index)]
    if m := _RANGE.fullmatch(text):
        lo, hi = _index(m[1], where), _index(m[2], where)
        if hi < lo:
            raise DeviceSelectionError(
                f"{where}: range {show(text)} goes down; write it as '{hi}-{lo}' (ranges go up)."
            )
        return [Entry(str(i), "index", card=i) for i in range(lo, hi + 1)]
    if m := _TILE.fullmatch(text):
        card, tile = _index(m[1], where), _index(m[2], where)
        return [Entry(f"{card}.{tile}", "tile", card=card, tile=tile)]
    if _GPU_UUID.fullmatch(text) or _MIG_ID.fullmatch(text):
        return [Entry(text, "uuid")]
    if text.lower() == "all":
        raise DeviceSelectionError(f"{where}: 'all' cannot be combined with other devices.")
    reason = "an empty entry (two commas, or a comma at an end)" if not text else show(text)
    raise DeviceSelectionError(
        f"{where}: cannot read {reason}. Valid entries: an index '2', a range '0-3', a tile '0.1' "
        "(Intel, COMPOSITE mode), a GPU UUID 'GPU-…' or MIG id 'MIG-…' (CUDA), or 'all' alone."
    )


def unreadable_mask_entries(backend: SelectableBackend, value: str) -> list[str]:
    """The entries of an exported mask the runtime cannot read (docs/devices.md "How the two runtimes
    read a mask"): ``ZE_AFFINITY_MASK`` takes indices and ``card.tile``; ``CUDA_VISIBLE_DEVICES``
    indices, ``GPU-…`` UUIDs and ``MIG-…`` ids. Empty for a readable mask, and for CUDA's ways of
    hiding every device (an empty value, or a negative first index such as ``-1``).
    """
    entries = [e.strip() for e in value.split(",")]
    if backend == "cuda" and (not value.strip() or re.fullmatch(r"-[0-9]+", entries[0], re.ASCII)):
        return []
    readable = (_INDEX, _TILE) if backend == "xpu" else (_INDEX, _GPU_UUID, _MIG_ID)
    return [e for e in entries if not any(r.fullmatch(e) for r in readable)]


def _index(text: str, where: str) -> int:
    """An ASCII digit string as an index ≤ ``MAX_INDEX``; too many digits are refused before int()."""
    digits = text.lstrip("0") or "0"  # leading zeros count towards int()'s 4300-digit limit too
    if len(digits) > len(str(MAX_INDEX)) or int(digits) > MAX_INDEX:
        raise DeviceSelectionError(f"{where}: device index {_show_index(digits)} is past {_past_max()}.")
    return int(digits)


def _show_index(digits: str) -> str:
    """A digit string for a message: itself when short, else how long it is."""
    sign, digits = ("-", digits[1:]) if digits.startswith("-") else ("", digits)
    return sign + digits if len(digits) <= 20 else f"{sign}<an index of {len(digits)} digits>"


def _past_max() -> str:
    return f"{MAX_INDEX}, the highest index torch can address"


def parse_backend(backend: str | None, where: str) -> SelectableBackend | None:
    if backend is None:
        return None
    name = backend.strip().lower() if isinstance(backend, str) else ""
    if name in SELECTABLE_BACKENDS:
        return "xpu" if name == "xpu" else "cuda"
    why = {
        "mps": "Apple GPUs are one device, with no variable to choose among them",
        "cpu": "the CPU needs no device selection",
    }.get(name, "it is not a backend with a device-visibility variable")
    raise DeviceSelectionError(
        f"{where}: backend={show(backend)} cannot be selected ({why}). Valid backends: 'xpu', 'cuda'."
    )


def parse_hierarchy(hierarchy: str | None, where: str) -> str | None:
    if hierarchy is None:
        return None
    value = hierarchy.strip().upper() if isinstance(hierarchy, str) else None
    if value not in HIERARCHIES:
        raise DeviceSelectionError(
            f"{where}: hierarchy={show(hierarchy)} is not a Level Zero hierarchy. Valid: FLAT, COMPOSITE, "
            "COMBINED (any case)."
        )
    return value


# --- checks ----------------------------------------------------------------------------------------


def check_xpu(entries: list[Entry], hierarchy: str | None, where: str) -> None:
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


def _check_unique(entries: list[Entry], where: str) -> None:
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


def check_cuda(entries: list[Entry], where: str) -> None:
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


def check_range(
    entries: list[Entry], count: int, backend: SelectableBackend, source: str, where: str
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
