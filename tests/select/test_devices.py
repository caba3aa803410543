"""select_devices / DeviceSelection: specs, the variables they produce, refusals, apply()."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from xpukit.errors import DeviceSelectionError, RuntimeAlreadyInitializedError, XpukitError
from xpukit.machine import probe
from xpukit.machine.facts import MachineFacts
from xpukit.machine.probe import intel_display_devices as real_sysfs_scan  # before any test replaces it
from xpukit.machine.profiles import machine_profile
from xpukit.select.devices import DeviceSelection, select_devices

SELECTION_VARS = (
    "ZE_AFFINITY_MASK",
    "ZE_FLAT_DEVICE_HIERARCHY",
    "ZE_ENABLE_PCI_ID_DEVICE_ORDER",
    "ONEAPI_DEVICE_SELECTOR",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
)
ORDER_XPU = {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
ORDER_CUDA = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.fixture(autouse=True)
def _clean_selection_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests decide what is exported; monkeypatch restores the real environment afterwards.
    for name in SELECTION_VARS:
        monkeypatch.delenv(name, raising=False)
    # No Intel display devices unless a test lists some: the real scan reads this machine's sysfs.
    monkeypatch.setattr(probe, "intel_display_devices", lambda: [], raising=False)


# --- valid specs: the exact variables ------------------------------------------------------------

VALID: list[tuple[Any, dict[str, Any], dict[str, str], tuple[str, ...]]] = [
    # spec, keywords, env, unset
    ("0", {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "0", **ORDER_XPU}, ()),
    ("0,2", {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "0,2", **ORDER_XPU}, ()),
    (" 0 , 2 ", {"backend": "XPU"}, {"ZE_AFFINITY_MASK": "0,2", **ORDER_XPU}, ()),
    ("0-3", {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "0,1,2,3", **ORDER_XPU}, ()),
    ("0-1,4", {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "0,1,4", **ORDER_XPU}, ()),
    ("2-2", {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "2", **ORDER_XPU}, ()),
    ("007", {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "7", **ORDER_XPU}, ()),
    ("0" * 5000 + "1", {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "1", **ORDER_XPU}, ()),  # past int()'s limit
    (3, {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "3", **ORDER_XPU}, ()),
    ([0, 2], {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "0,2", **ORDER_XPU}, ()),
    (("1", 3), {"backend": "xpu"}, {"ZE_AFFINITY_MASK": "1,3", **ORDER_XPU}, ()),
    ("all", {"backend": "xpu"}, ORDER_XPU, ("ZE_AFFINITY_MASK",)),
    (" ALL ", {"backend": "xpu"}, ORDER_XPU, ("ZE_AFFINITY_MASK",)),
    (
        "0,1",
        {"backend": "xpu", "hierarchy": "flat"},
        {"ZE_AFFINITY_MASK": "0,1", **ORDER_XPU, "ZE_FLAT_DEVICE_HIERARCHY": "FLAT"},
        (),
    ),
    (
        "all",
        {"backend": "xpu", "hierarchy": "Combined"},
        {**ORDER_XPU, "ZE_FLAT_DEVICE_HIERARCHY": "COMBINED"},
        ("ZE_AFFINITY_MASK",),
    ),
    (
        "0.0,0.1",
        {"backend": "xpu", "hierarchy": "composite"},
        {"ZE_AFFINITY_MASK": "0.0,0.1", **ORDER_XPU, "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"},
        (),
    ),
    (
        "0.1,1",
        {"backend": "xpu", "hierarchy": "COMPOSITE"},
        {"ZE_AFFINITY_MASK": "0.1,1", **ORDER_XPU, "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"},
        (),
    ),
    ("0", {"backend": "cuda"}, {"CUDA_VISIBLE_DEVICES": "0", **ORDER_CUDA}, ()),
    ("2,0", {"backend": "cuda"}, {"CUDA_VISIBLE_DEVICES": "2,0", **ORDER_CUDA}, ()),  # CUDA reorders
    ("0-2", {"backend": "cuda"}, {"CUDA_VISIBLE_DEVICES": "0,1,2", **ORDER_CUDA}, ()),
    ([3, 1], {"backend": "cuda"}, {"CUDA_VISIBLE_DEVICES": "3,1", **ORDER_CUDA}, ()),
    ("all", {"backend": "cuda"}, ORDER_CUDA, ("CUDA_VISIBLE_DEVICES",)),
    ("GPU-8932f937", {"backend": "cuda"}, {"CUDA_VISIBLE_DEVICES": "GPU-8932f937", **ORDER_CUDA}, ()),
    (
        "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,GPU-1234abcd",
        {"backend": "cuda"},
        {"CUDA_VISIBLE_DEVICES": "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,GPU-1234abcd", **ORDER_CUDA},
        (),
    ),
    (
        "MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0",
        {"backend": "cuda"},
        {"CUDA_VISIBLE_DEVICES": "MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0", **ORDER_CUDA},
        (),
    ),
    (
        "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f",
        {"backend": "cuda"},
        {"CUDA_VISIBLE_DEVICES": "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", **ORDER_CUDA},
        (),
    ),
    # Checked against the facts' device count.
    ("0,1", {"facts": machine_profile("arc-b580", 2)}, {"ZE_AFFINITY_MASK": "0,1", **ORDER_XPU}, ()),
    ("all", {"facts": machine_profile("h100", 4)}, ORDER_CUDA, ("CUDA_VISIBLE_DEVICES",)),
    ("3,0", {"facts": machine_profile("h100", 4)}, {"CUDA_VISIBLE_DEVICES": "3,0", **ORDER_CUDA}, ()),
]


@pytest.mark.parametrize(("spec", "kwargs", "env", "unset"), VALID)
def test_valid_specs_give_exact_env(
    spec: Any, kwargs: dict[str, Any], env: dict[str, str], unset: tuple[str, ...]
) -> None:
    before = dict(os.environ)
    sel = select_devices(spec, **kwargs)
    assert sel.env == env
    assert list(sel.env) == list(env)  # the order of shell_prefix() is part of the contract
    assert sel.unset == unset
    assert sel.selects_all == (not sel.devices)
    assert dict(os.environ) == before


def test_shell_prefix_matches_the_issue_example() -> None:
    sel = select_devices("0,2", backend="xpu")
    assert sel.shell_prefix() == "ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1"
    assert sel.command_line(["torchrun", "--nproc-per-node", "2", "my train.py"]) == (
        "ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 torchrun --nproc-per-node 2 'my train.py'"
    )
    assert select_devices("all", backend="cuda").shell_prefix() == (
        "env -u CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER=PCI_BUS_ID"
    )


@pytest.mark.parametrize(
    ("spec", "kwargs"),
    [
        ("0,2", {"backend": "xpu"}),
        ("all", {"backend": "cuda"}),
        ("0.1", {"backend": "xpu", "hierarchy": "composite"}),
    ],
)
def test_shell_line_really_sets_and_unsets_in_a_shell(spec: str, kwargs: dict[str, Any]) -> None:
    sel = select_devices(spec, **kwargs)
    probe_env = "import json, os; print(json.dumps(dict(os.environ)))"
    line = sel.command_line([sys.executable, "-c", probe_env])
    exported = {"ZE_AFFINITY_MASK": "7", "CUDA_VISIBLE_DEVICES": "7"}
    out = subprocess.run(
        ["/bin/sh", "-c", line],
        env=os.environ | exported,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    import json

    child = json.loads(out.stdout)
    expected = sel.environ(os.environ | exported)
    for name in SELECTION_VARS:
        assert child.get(name) == expected.get(name), name


def test_environ_is_a_copy_with_the_selection() -> None:
    base = {"PATH": "/bin", "ZE_AFFINITY_MASK": "1", "KEEP": "x"}
    sel = select_devices("all", backend="xpu")
    out = sel.environ(base)
    assert out == {"PATH": "/bin", "KEEP": "x", "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
    assert base == {"PATH": "/bin", "ZE_AFFINITY_MASK": "1", "KEEP": "x"}
    out["X"] = "y"
    assert "X" not in sel.environ(base)
    default = select_devices("1", backend="xpu").environ()
    assert default["ZE_AFFINITY_MASK"] == "1"
    assert default["PATH"] == os.environ["PATH"]
    assert "ZE_AFFINITY_MASK" not in os.environ


def test_selection_is_frozen_and_does_not_share_dicts() -> None:
    env = {"ZE_AFFINITY_MASK": "0"}
    sel = DeviceSelection(backend="xpu", spec="0", devices=("0",), env=env)
    env["ZE_AFFINITY_MASK"] = "5"
    assert sel.env == {"ZE_AFFINITY_MASK": "0"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.backend = "cuda"  # type: ignore[misc]


def test_visible_devices_and_counts() -> None:
    assert select_devices("0,2", backend="xpu").torch_devices == ("xpu:0", "xpu:1")
    # COMPOSITE: tiles of one card are one device.
    assert select_devices("0.0,0.1,1", backend="xpu", hierarchy="composite").visible_count == 2
    assert select_devices("all", backend="xpu").visible_count is None
    assert select_devices("all", facts=machine_profile("arc-b580", 3)).torch_devices == (
        "xpu:0",
        "xpu:1",
        "xpu:2",
    )


# --- refusals ------------------------------------------------------------------------------------

INVALID: list[tuple[Any, dict[str, Any], str]] = [
    ("", {"backend": "xpu"}, "empty"),
    ("   ", {"backend": "cuda"}, "empty"),
    ([], {"backend": "xpu"}, "empty"),
    ("0,,2", {"backend": "xpu"}, "empty entry"),
    ("0,", {"backend": "xpu"}, "empty entry"),
    ("zero", {"backend": "xpu"}, "cannot read 'zero'"),
    ("٣", {"backend": "xpu"}, "cannot read"),  # a non-ASCII digit that int() would accept
    ("1_0", {"backend": "xpu"}, "cannot read"),
    ("0:1", {"backend": "cuda"}, "cannot read"),
    ("-1", {"backend": "xpu"}, "negative"),
    (-2, {"backend": "cuda"}, "negative"),
    ([0, -1], {"backend": "cuda"}, "negative"),
    ("3-1", {"backend": "xpu"}, "goes down"),
    ("0-500", {"backend": "cuda"}, "past 127"),
    ("all,0", {"backend": "xpu"}, "'all' cannot be combined"),
    (True, {"backend": "xpu"}, "got bool"),
    (1.0, {"backend": "xpu"}, "got float"),
    (None, {"backend": "xpu"}, "got NoneType"),
    ([0, None], {"backend": "xpu"}, "ints or strings"),
    (["0,1"], {"backend": "xpu"}, "one device per list item"),
    ("0,0", {"backend": "xpu"}, "listed twice"),
    ("1,0-2", {"backend": "cuda"}, "listed twice"),
    ("0,1,0", {"backend": "xpu"}, "listed twice"),
    ("2,0", {"backend": "xpu"}, "device 0 as xpu:0 and device 2 as xpu:1"),
    ("1.1,1.0", {"backend": "xpu", "hierarchy": "composite"}, "cannot reorder"),
    ("1,0.0", {"backend": "xpu", "hierarchy": "composite"}, "cannot reorder"),
    ("0,0.1", {"backend": "xpu", "hierarchy": "composite"}, "already selected by card '0'"),
    ("0.1", {"backend": "xpu"}, "COMPOSITE mode"),
    ("0.1", {"backend": "xpu", "hierarchy": "flat"}, "in FLAT mode the driver silently skips it"),
    ("0.1", {"backend": "xpu", "hierarchy": "combined"}, "COMBINED mode"),
    ("0.1", {"backend": "cuda"}, "no 'card.tile' form"),
    ("GPU-8932f937", {"backend": "xpu"}, "CUDA identifier"),
    ("0,GPU-8932f937", {"backend": "cuda"}, "one form"),
    ("GPU-", {"backend": "cuda"}, "cannot read"),
    ("0", {"backend": "mps"}, "Apple GPUs"),
    ("0", {"backend": "cpu"}, "needs no device selection"),
    ("0", {"backend": "rocm"}, "Valid backends: 'xpu', 'cuda'"),
    ("0", {"backend": "xpu", "hierarchy": "tiles"}, "not a Level Zero hierarchy"),
    ("0", {"backend": "cuda", "hierarchy": "flat"}, "Intel GPUs only"),
    ("2", {"facts": machine_profile("arc-b580", 2)}, "out of range: the facts (profile:arc-b580x2) show 2"),
    ("0-4", {"facts": machine_profile("h100", 4)}, "CUDA would hide it and every device listed after it"),
    ("1", {"backend": "xpu", "facts": machine_profile("max-1100")}, "Valid indices: 0, or 'all'"),
    ("0", {"facts": machine_profile("cpu")}, "no XPU or CUDA device was found"),
    ("0", {"facts": machine_profile("apple-m2")}, "name the backend"),
]


@pytest.mark.parametrize(("spec", "kwargs", "fragment"), INVALID)
def test_invalid_specs_are_refused_and_touch_nothing(
    spec: Any, kwargs: dict[str, Any], fragment: str
) -> None:
    before = dict(os.environ)
    with pytest.raises(DeviceSelectionError) as info:
        select_devices(spec, **kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert dict(os.environ) == before


# Inputs past Python's int/str conversion limit (4300 digits), and facts that are not facts: these
# once escaped as ValueError/AttributeError (a traceback from `xpukit launch`).
HUGE: list[Any] = [
    pytest.param("1" * 5000, {"backend": "xpu"}, "an index of 5000 digits", id="long-digit-string"),
    pytest.param("1-" + "9" * 5000, {"backend": "cuda"}, "an index of 5000 digits", id="long-range-end"),
    pytest.param(
        "0." + "1" * 5000, {"backend": "xpu", "hierarchy": "composite"}, "5000 digits", id="long-tile"
    ),
    pytest.param(10**5000, {"backend": "xpu"}, "an int of 5001 digits", id="huge-int"),
    pytest.param(-(10**5000), {"backend": "cuda"}, "negative device index", id="huge-negative-int"),
    pytest.param([10**5000], {"backend": "xpu"}, "an int of 5001 digits", id="huge-int-in-list"),
    pytest.param([0, [10**5000]], {"backend": "xpu"}, "ints or strings", id="huge-int-nested"),
    pytest.param("0", {"backend": 10**5000}, "cannot be selected", id="huge-int-backend"),
    pytest.param("0", {"backend": "xpu", "hierarchy": 10**5000}, "not a Level Zero", id="huge-int-hierarchy"),
    pytest.param("0", {"facts": "x"}, "facts must be a MachineFacts", id="facts-str"),
    pytest.param("0", {"backend": "xpu", "facts": {}}, "got dict", id="facts-dict"),
]


@pytest.mark.parametrize(("spec", "kwargs", "fragment"), HUGE)
def test_huge_or_mistyped_inputs_give_a_device_selection_error(
    spec: Any, kwargs: dict[str, Any], fragment: str
) -> None:
    before = dict(os.environ)
    with pytest.raises(DeviceSelectionError) as info:
        select_devices(spec, **kwargs)
    message = str(info.value)
    assert fragment in message
    assert len(message) < 1000  # the input is summarised, not echoed
    assert dict(os.environ) == before


def test_decreasing_xpu_list_says_what_the_program_would_see() -> None:
    with pytest.raises(DeviceSelectionError) as info:
        select_devices("3,1", backend="xpu")
    message = str(info.value)
    assert "device 1 as xpu:0 and device 3 as xpu:1" in message
    assert "'1,3'" in message  # the fix
    assert "xpu:<index>" in message  # how to get another rank → device mapping


# --- what the count is checked against -----------------------------------------------------------


def test_named_backend_without_facts_checks_syntax_only() -> None:
    sel = select_devices("0-7", backend="xpu")  # a login node writing a job script
    assert not sel.count_known
    assert any("syntax only" in n for n in sel.notes)


def test_facts_read_under_a_mask_do_not_give_the_count() -> None:
    facts = machine_profile("arc-b580", 1).with_env({"ZE_AFFINITY_MASK": "1"})
    sel = select_devices("0,3", facts=facts)  # facts see 1 device, the machine may have 4
    assert sel.device_count is None
    assert any("ZE_AFFINITY_MASK=1" in n for n in sel.notes)


def test_max_counts_are_unknown_across_hierarchies_and_noted_in_flat() -> None:
    facts = machine_profile("max-1550")  # one card, two stacks, read in FLAT mode
    flat = select_devices("0,1", facts=facts)
    assert flat.device_count == 2
    assert any("every stack is its own device" in n for n in flat.notes)
    composite = select_devices("0.0,0.1", facts=facts, hierarchy="composite")
    assert composite.device_count is None
    assert composite.visible_count == 1
    # Single-stack cards count the same in every hierarchy.
    assert select_devices("1", facts=machine_profile("arc-b580", 2), hierarchy="composite").device_count == 2


def test_named_backend_with_facts_of_another_backend_is_syntax_only() -> None:
    sel = select_devices("0,5", backend="xpu", facts=machine_profile("h100", 2))
    assert sel.device_count is None


def test_hierarchy_is_inherited_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    sel = select_devices("0.1", backend="xpu")
    # Written down so that the selection does not depend on what happens to be exported.
    assert sel.env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"
    assert sel.hierarchy == "COMPOSITE"
    # Also without tiles: `0,1` names two cards in COMPOSITE but two stacks of card 0 in FLAT (the
    # default on a Max node), so the line must carry the hierarchy it was checked in.
    cards = select_devices("0,1", backend="xpu")
    assert cards.env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"
    assert cards.shell_prefix() == (
        "ZE_AFFINITY_MASK=0,1 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE"
    )
    assert "--hierarchy composite" in cards.launch_hint()
    assert select_devices("all", backend="xpu").env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"
    assert "ZE_FLAT_DEVICE_HIERARCHY" not in select_devices("0", backend="cuda").env
    monkeypatch.delenv("ZE_FLAT_DEVICE_HIERARCHY")
    assert "ZE_FLAT_DEVICE_HIERARCHY" not in select_devices("0", backend="xpu").env  # driver default
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "composite")  # the driver wants upper case
    with pytest.raises(DeviceSelectionError, match="COMPOSITE mode"):
        select_devices("0.1", backend="xpu")
    assert any("not a value the driver knows" in n for n in select_devices("0", backend="xpu").notes)


def test_hierarchy_is_inherited_from_the_facts_environment() -> None:
    facts = machine_profile("arc-b580", 2).with_env({"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"})
    assert select_devices("1.0", facts=facts).env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"
    assert select_devices("0,1", facts=facts).env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"


# --- detection (no facts, no backend) ------------------------------------------------------------


def test_detection_on_this_machine_refuses_without_a_device() -> None:
    import torch

    if torch.xpu._is_compiled() or torch.version.cuda:
        pytest.skip("this torch build has an accelerator backend")
    with pytest.raises(DeviceSelectionError, match="backend='xpu' or 'cuda'"):
        select_devices("0")
    assert not torch.xpu.is_initialized() and not torch.cuda.is_initialized()


def _fake_torch(*, zes: int | None = None, nvml: int | None = None, initialized: bool = False) -> Any:
    def module(counter_name: str, count: int | None) -> Any:
        ns = SimpleNamespace(is_initialized=lambda: initialized, device_count=lambda: count)
        if count is not None:
            setattr(ns, counter_name, lambda *args: count)
        return ns

    return SimpleNamespace(
        xpu=module("_raw_device_count_zes", zes),
        cuda=module("_raw_device_count_nvml", nvml),
        version=SimpleNamespace(hip=None),
    )


@pytest.mark.parametrize(
    ("compiled", "fake", "backend", "count"),
    [
        (("xpu",), {"zes": 2}, "xpu", 2),
        (("xpu",), {}, "xpu", None),  # torch < 2.13 or no pyzes: only the syntax is checked
        (("xpu",), {"zes": -1}, "xpu", None),  # Sysman failed
        (("cuda",), {"nvml": 4}, "cuda", 4),
        (("xpu", "cuda"), {"zes": 0, "nvml": 1}, "cuda", 1),
    ],
)
def test_detected_backend_and_count_without_initialising(
    monkeypatch: pytest.MonkeyPatch,
    compiled: tuple[Any, ...],
    fake: dict[str, Any],
    backend: str,
    count: int | None,
) -> None:
    monkeypatch.setattr(
        probe, "detect", lambda devices=True: MachineFacts(torch_version="2.13.0", compiled=compiled)
    )
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(**fake))
    sel = select_devices("0")
    assert (sel.backend, sel.device_count) == (backend, count)
    if count is not None:
        with pytest.raises(DeviceSelectionError, match="out of range"):
            select_devices(str(count))


def test_detected_backends_without_devices_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        probe, "detect", lambda devices=True: MachineFacts(torch_version="2.13.0", compiled=("xpu",))
    )
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(zes=0))
    with pytest.raises(DeviceSelectionError, match="compiled backends: xpu"):
        select_devices("all")


def test_sysman_count_leaves_torchs_device_cache_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.13's _raw_device_count_zes refills torch.xpu._cached_zes_device_infos (clear() in place,
    # then a new list when it drops iGPUs) with every device, unmasked; the telemetry calls map
    # xpu:N through that list, so a count taken for checking must not leave its list behind.
    torch = _fake_torch()
    cache = ["xpu:0 of the masked process"]
    torch.xpu._cached_zes_device_infos = cache

    def count_like_torch(visible_mask: list[int]) -> int:
        torch.xpu._cached_zes_device_infos.clear()
        torch.xpu._cached_zes_device_infos.extend(f"device {i}" for i in range(3))
        torch.xpu._cached_zes_device_infos = ["device 1", "device 2"]
        return 2

    torch.xpu._raw_device_count_zes = count_like_torch
    monkeypatch.setattr(
        probe, "detect", lambda devices=True: MachineFacts(torch_version="2.13.0", compiled=("xpu",))
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert select_devices("1").device_count == 2
    assert torch.xpu._cached_zes_device_infos is cache
    assert cache == ["xpu:0 of the masked process"]


# --- an integrated GPU next to discrete ones ------------------------------------------------------

IGPU = ("0000:00:02.0", "8086:7d55")  # Meteor Lake graphics, where Intel iGPUs always sit
B580 = ("0000:03:00.0", "8086:e20b")
B580_2 = ("0000:83:00.0", "8086:e20b")
MAX_1550 = ("0000:29:00.0", "8086:0bd5")


def _machine(monkeypatch: pytest.MonkeyPatch, sysfs: list[tuple[str, str]], **counts: int | None) -> None:
    """A torch-2.13 XPU machine: what sysfs lists, and what torch's own counters say."""
    monkeypatch.setattr(probe, "intel_display_devices", lambda: list(sysfs), raising=False)
    monkeypatch.setattr(
        probe, "detect", lambda devices=True: MachineFacts(torch_version="2.13.0", compiled=("xpu",))
    )
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(**counts))


def test_igpu_next_to_a_dgpu_counts_pci_ordinals(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sysman (like torch) counts only the discrete card; Level Zero in PCI order numbers both.
    _machine(monkeypatch, [B580, IGPU], zes=1)
    first_discrete = select_devices("1")
    assert first_discrete.env["ZE_AFFINITY_MASK"] == "1"
    assert first_discrete.device_count == 2
    assert any("integrated" in n and "checked against 2" in n for n in first_discrete.notes)
    assert first_discrete.warnings == ()
    assert first_discrete.visible_count == 1
    with pytest.raises(DeviceSelectionError, match="device 2 is out of range"):
        select_devices("2")


def test_igpu_ordinal_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, [IGPU, B580, B580_2], zes=2)
    alone = select_devices("0")
    (warning,) = alone.warnings
    assert "device 0 is the integrated GPU at 0000:00:02.0" in warning
    assert "the first discrete card is 1" in warning
    assert alone.visible_count == 1  # alone, the program runs on the iGPU
    assert alone.to_dict()["warnings"] == [warning]
    both = select_devices("0,1")
    assert "torch leaves it out" in both.warnings[0] and "will not see it" in both.warnings[0]
    assert both.visible_count == 1  # torch drops an iGPU whenever a discrete GPU is visible
    every = select_devices("all")
    assert every.device_count == 3 and every.torch_devices == ("xpu:0", "xpu:1")
    assert every.warnings == ()
    # A named backend (no count is checked) still warns: the ordinals are this machine's.
    named = select_devices("0", backend="xpu")
    assert named.device_count is None and named.warnings == alone.warnings


@pytest.mark.parametrize(
    ("sysfs", "counts", "hierarchy", "expected"),
    [
        ([IGPU, B580], {}, None, 2),  # torch <= 2.12 cannot count: sysfs lists the ordinals
        ([IGPU, MAX_1550], {"zes": 2}, None, 3),  # FLAT: two stacks, and the iGPU
        ([IGPU, MAX_1550], {}, None, None),  # stacks per card unknown without torch's count
        ([IGPU, MAX_1550], {}, "COMPOSITE", 2),  # COMPOSITE: one device per card
        ([IGPU], {"zes": 1}, None, 1),  # an iGPU alone is simply device 0
        ([B580, B580_2], {"zes": 2}, None, 2),
    ],
)
def test_count_on_machines_with_and_without_an_igpu_mix(
    monkeypatch: pytest.MonkeyPatch,
    sysfs: list[tuple[str, str]],
    counts: dict[str, int],
    hierarchy: str | None,
    expected: int | None,
) -> None:
    if hierarchy:
        monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", hierarchy)
    _machine(monkeypatch, sysfs, **counts)
    sel = select_devices("0")
    assert sel.device_count == expected
    assert bool(sel.warnings) == (IGPU in sysfs and len(sysfs) > 1)


def test_the_real_sysfs_scan_gives_intel_display_devices_in_pci_order() -> None:
    gpus = real_sysfs_scan()  # this machine's (often none): only the shape can be checked
    assert gpus == sorted(gpus)
    assert all(re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", a) for a, _ in gpus)
    assert all(re.fullmatch(r"8086:[0-9a-f]{4}", pci_id) for _, pci_id in gpus)


def test_facts_override_the_sysfs_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    # Facts may describe another machine: this machine's PCI bus says nothing about them.
    _machine(monkeypatch, [IGPU, B580], zes=1)
    sel = select_devices("0", facts=machine_profile("arc-b580", 1))
    assert sel.device_count == 1 and sel.warnings == ()
    assert not any("integrated" in n for n in sel.notes)


# --- apply() -------------------------------------------------------------------------------------


def _initialised_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose XPU runtime reports itself initialised, seen through probe.runtime_initialized."""
    fake = SimpleNamespace(
        xpu=SimpleNamespace(is_initialized=lambda: True), cuda=SimpleNamespace(is_initialized=lambda: False)
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert probe.runtime_initialized()


def test_apply_sets_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZE_AFFINITY_MASK", "3")  # registers the variable for restoring
    select_devices("all", backend="xpu").apply()
    assert "ZE_AFFINITY_MASK" not in os.environ
    assert os.environ["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"
    monkeypatch.setenv("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "0")
    select_devices("0,1", backend="xpu").apply()
    assert os.environ["ZE_AFFINITY_MASK"] == "0,1"
    assert os.environ["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"


def test_apply_warns_when_it_replaces_an_exported_mask(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ZE_AFFINITY_MASK", "2")
    monkeypatch.setenv("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1")
    with caplog.at_level(logging.WARNING, logger="xpukit.select.devices"):
        select_devices("0", backend="xpu").apply()
    (said,) = [r.getMessage() for r in caplog.records]
    assert "ZE_AFFINITY_MASK=2 was exported and is replaced by ZE_AFFINITY_MASK=0" in said
    assert os.environ["ZE_AFFINITY_MASK"] == "0"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xpukit.select.devices"):
        select_devices("0", backend="xpu").apply()  # the same mask again: nothing to say
    assert caplog.records == []


def test_apply_is_refused_once_the_runtime_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    _initialised_torch(monkeypatch)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    before = dict(os.environ)
    sel = select_devices("0,2", backend="xpu")
    with pytest.raises(RuntimeAlreadyInitializedError) as info:
        sel.apply()
    message = str(info.value)
    assert "xpukit launch --devices 0,2 --backend xpu" in message
    assert "ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 python" in message
    assert "ZE_AFFINITY_MASK (1 → 0,2)" in message
    assert isinstance(info.value, RuntimeError)
    assert dict(os.environ) == before


def test_apply_of_what_is_already_in_effect_is_allowed_after_init(monkeypatch: pytest.MonkeyPatch) -> None:
    _initialised_torch(monkeypatch)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,2")
    monkeypatch.setenv("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1")
    select_devices("0,2", backend="xpu").apply()  # e.g. a script started by `xpukit launch`
    with pytest.raises(RuntimeAlreadyInitializedError):
        select_devices("all", backend="xpu").apply()  # would unset the mask


# --- any input: a selection or an XpukitError, and os.environ untouched -------------------------

_huge_ints = st.integers(min_value=4290, max_value=4400).map(lambda n: 10**n)  # past str()'s limit
_long_digits = st.integers(min_value=4290, max_value=4400).map(lambda n: "1" * n)
_tokens = st.one_of(
    st.integers(min_value=-3, max_value=200),
    st.integers(),
    _huge_ints,
    _long_digits,
    st.text(alphabet="0123456789,.- aAlLGPUMI/f", max_size=12),
    st.text(max_size=8),
)
_small = st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=4, unique=True)
_plausible = st.one_of(  # near-valid specs, so that the property also covers the valid path
    _small.map(lambda ix: ",".join(map(str, sorted(ix)))),
    _small,
    st.sampled_from(["all", "0-3", "1-2,5", "0.0,0.1", "0.1,1", "GPU-8932f937", "MIG-ab12-cd34"]),
)
_specs = st.one_of(
    _plausible,
    _plausible,
    st.text(max_size=40),
    st.text(alphabet="0123456789,.-", max_size=20),
    st.integers(),
    _huge_ints,
    _huge_ints.map(lambda n: -n),
    _long_digits,
    st.tuples(_long_digits, st.sampled_from(["-1", "-" + "9" * 5000, ".0", ""])).map("".join),
    st.lists(_tokens, max_size=6),
    st.tuples(_tokens, _tokens),
    st.none(),
    st.floats(allow_nan=True),
    st.booleans(),
)
_hierarchies = st.one_of(
    st.none(),
    st.none(),
    st.sampled_from(["flat", "COMPOSITE", "Combined"]),
    st.text(max_size=10),
    _huge_ints,
)
_facts = st.one_of(
    st.none(),
    st.sampled_from(["arc-b580", "max-1550", "h100", "cpu"]).flatmap(
        lambda name: st.integers(1, 4).map(lambda n: machine_profile(name, n))
    ),
    st.sampled_from(["x", {}, 0]),  # not facts: refused, not an AttributeError
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=_specs,
    backend=st.one_of(
        st.none(), st.sampled_from(["xpu", "cuda", "Xpu"]), st.text(max_size=6), st.integers(), _huge_ints
    ),
    hierarchy=_hierarchies,
    facts=_facts,
)
def test_any_input_gives_a_selection_or_an_xpukit_error(
    spec: Any, backend: str | None, hierarchy: str | None, facts: MachineFacts | None
) -> None:
    assume(backend is not None or facts is not None)  # detection is tested on its own below
    before = dict(os.environ)
    try:
        sel = select_devices(spec, backend=backend, hierarchy=hierarchy, facts=facts)
    except XpukitError:
        assert dict(os.environ) == before
        return
    assert dict(os.environ) == before
    assert isinstance(sel, DeviceSelection)
    mask = sel.env.get("ZE_AFFINITY_MASK" if sel.backend == "xpu" else "CUDA_VISIBLE_DEVICES")
    assert (mask is None) == sel.selects_all
    if mask is not None:
        entries = mask.split(",")
        assert len(set(entries)) == len(entries)
        if sel.backend == "xpu":  # increasing: the mask cannot reorder, so no order is pretended
            keys = [tuple(int(p) for p in e.split(".")) for e in entries]
            assert keys == sorted(keys)
        if sel.device_count is not None:
            assert all(int(e.split(".")[0]) < sel.device_count for e in entries if e[0].isdigit())
    # The canonical spec selects the same thing again.
    again = select_devices(sel.spec, backend=sel.backend, hierarchy=sel.hierarchy)
    assert again.env == sel.env and again.unset == sel.unset


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=127), min_size=1, max_size=8, unique=True))
def test_sorted_unique_xpu_lists_are_kept_and_cuda_lists_keep_their_order(indices: list[int]) -> None:
    xpu = select_devices(sorted(indices), backend="xpu")
    assert xpu.env["ZE_AFFINITY_MASK"] == ",".join(map(str, sorted(indices)))
    cuda = select_devices(indices, backend="cuda")
    assert cuda.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, indices))
    if indices != sorted(indices):
        with pytest.raises(DeviceSelectionError, match="cannot reorder"):
            select_devices(indices, backend="xpu")


# --- on a real accelerator -----------------------------------------------------------------------


@pytest.mark.gpu
def test_detection_counts_real_devices_without_initialising() -> None:
    import torch

    if not (torch.xpu._is_compiled() or torch.version.cuda):
        pytest.skip("needs a torch build with XPU or CUDA")
    code = (
        "import torch, xpukit.select.devices as d; s = d.select_devices('0'); "
        "print(s.backend, s.device_count, torch.cuda.is_initialized(), torch.xpu.is_initialized(), "
        "getattr(torch, s.backend).device_count())"
    )
    env = {k: v for k, v in os.environ.items() if k not in SELECTION_VARS}  # count the whole machine
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    backend, count, cuda_init, xpu_init, torch_count = out.stdout.split()
    assert backend in {"xpu", "cuda"}
    assert cuda_init == xpu_init == "False"  # counting did not initialise the runtime
    assert count in {"None", torch_count}
