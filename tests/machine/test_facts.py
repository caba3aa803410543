"""Pure facts: XPU family classification, precision rules, profiles, JSON round-trips."""

from __future__ import annotations

import json

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import MachineFacts, classify_xpu
from xpukit.machine.precision import inference_dtype, normalize_dtype, training_precision
from xpukit.machine.profiles import PROFILES, device_profile, machine_profile, parse_assume, profile_names


@pytest.mark.parametrize(
    ("name", "device_id", "family"),
    [
        ("Intel(R) Data Center GPU Max 1550", 0x0BD5, "max"),
        ("Intel(R) Data Center GPU Max 1100", None, "max"),
        ("Intel(R) Data Center GPU Flex 170", None, "flex"),
        ("Intel(R) Arc(TM) A770 Graphics", 0x56A0, "arc-a"),
        ("Intel(R) Arc(TM) A750 Graphics", None, "arc-a"),
        ("Intel(R) Arc(TM) B580 Graphics", 0xE20B, "arc-b"),
        ("Intel(R) Arc(TM) Pro B60 Graphics", None, "arc-b"),
        ("Intel(R) Arc(TM) 140V GPU (16GB)", None, "lunar-lake"),
        ("Intel(R) Graphics [0x64a0]", 0x64A0, "lunar-lake"),
        ("Intel(R) Arc(TM) Graphics", 0x7D55, "meteor-lake"),  # MTL and ARL share this name
        ("Intel(R) Arc(TM) Graphics", 0x7D51, "arrow-lake-h"),
        ("Intel(R) Arc(TM) Graphics", 0x7D67, "arrow-lake-s"),
        ("Intel(R) Arc(TM) Graphics", 0x7D60, "meteor-lake"),
        ("Intel(R) Graphics", 0xB640, "arrow-lake-s"),
        ("Intel(R) Arc(TM) B390 GPU", None, "panther-lake"),  # PTL iGPU, not a discrete Arc B
        ("Intel(R) Arc(TM) Graphics", None, "intel-unknown"),
        ("Some Future GPU", 0x1234, "intel-unknown"),
    ],
)
def test_classify_xpu(name: str, device_id: int | None, family: str) -> None:
    assert classify_xpu(name, device_id) == family


@pytest.mark.parametrize(
    ("profile", "dtype"),
    [
        ("max-1550", "bfloat16"),
        ("max-1100", "bfloat16"),
        ("arc-a770", "bfloat16"),
        ("arc-b580", "bfloat16"),
        ("arc-pro-b60", "bfloat16"),
        ("lunar-lake", "bfloat16"),
        ("meteor-lake", "float16"),
        ("h100", "bfloat16"),
        ("h200", "bfloat16"),
        ("t4", "float16"),
        ("apple-m2", "float16"),
        ("cpu-bf16", "bfloat16"),
        ("cpu", "float32"),
    ],
)
def test_inference_dtype_per_profile(profile: str, dtype: str) -> None:
    choice = inference_dtype(device_profile(profile))
    assert choice.dtype == dtype
    assert choice.reason
    assert all(alt != dtype for alt, _ in choice.rejected)


@pytest.mark.parametrize(
    ("profile", "flags"),
    [
        ("max-1550", (True, False)),
        ("arc-b580", (True, False)),
        ("arc-a770", (True, False)),  # native bf16, so its missing fp64 never matters
        ("meteor-lake", (False, True)),  # no native bf16, has fp64: fp16 + GradScaler
        ("t4", (False, True)),
        ("h100", (True, False)),
        ("apple-m2", (False, False)),
        ("cpu", (False, False)),
        ("cpu-bf16", (True, False)),
    ],
)
def test_training_precision_per_profile(profile: str, flags: tuple[bool, bool]) -> None:
    p = training_precision(device_profile(profile))
    assert (p.bf16, p.fp16) == flags


def test_no_fp16_scaler_without_fp64() -> None:
    """A device without native bf16 and without fp64 must train in fp32, never fp16+GradScaler."""
    from dataclasses import replace

    no_bf16_no_fp64 = replace(device_profile("arc-a770"), native_bf16=False)
    p = training_precision(no_bf16_no_fp64)
    assert (p.bf16, p.fp16, p.name) == (False, False, "float32")
    assert "fp64" in p.reason


@pytest.mark.parametrize(
    ("value", "want"),
    [("bf16", "bfloat16"), ("torch.float16", "float16"), ("FP32", "float32"), ("int8", None)],
)
def test_normalize_dtype(value: str, want: str | None) -> None:
    assert normalize_dtype(value) == want


def test_profiles_are_complete_and_sourced() -> None:
    required = {
        "max-1550",
        "max-1100",
        "arc-a770",
        "arc-b580",
        "arc-pro-b60",
        "lunar-lake",
        "meteor-lake",
        "h100",
        "h200",
        "t4",
        "apple-m2",
        "cpu-bf16",
        "cpu",
    }
    assert required <= set(profile_names())
    for name, facts in PROFILES.items():
        assert facts.source, name
        assert facts.total_memory > 2**30, name
    assert PROFILES["lunar-lake"].free_memory is None
    assert PROFILES["meteor-lake"].native_bf16 is False
    assert PROFILES["t4"].native_bf16 is False
    assert PROFILES["arc-a770"].fp64 is False


@pytest.mark.parametrize(
    ("spec", "want"),
    [("max-1550x2", ("max-1550", 2)), ("arc-b580", ("arc-b580", 1)), ("H200X4", ("h200", 4))],
)
def test_parse_assume(spec: str, want: tuple[str, int]) -> None:
    assert parse_assume(spec) == want


@pytest.mark.parametrize("spec", ["", "nope", "max-1550x", "arc-b580x0", "x2"])
def test_parse_assume_rejects(spec: str) -> None:
    with pytest.raises(InvalidRequestError, match=r"profile|device count"):
        parse_assume(spec)


def test_machine_profile_flat_max_1550_card_has_two_devices() -> None:
    m = machine_profile("max-1550")
    assert m.accelerator == "xpu"
    assert [d.torch_device for d in m.devices] == ["xpu:0", "xpu:1"]
    assert all(d.total_memory == 64 * 2**30 for d in m.devices)
    two_cards = machine_profile("max-1550x2")
    assert two_cards == machine_profile("max-1550", 2)
    assert two_cards.device_count == 4 and two_cards.source == "profile:max-1550x2"
    assert machine_profile("arc-b580x2").device_count == 2


def test_machine_profile_cpu_only() -> None:
    m = machine_profile("cpu")
    assert m.accelerator == "cpu" and m.devices == ()
    assert m.cpu.native_bf16 is False


@pytest.mark.parametrize("name", ["lunar-lake", "h100", "cpu-bf16", "apple-m2"])
def test_machine_facts_json_round_trip(name: str) -> None:
    m = machine_profile(name, 2 if name == "h100" else 1)
    again = MachineFacts.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m


def test_machine_facts_from_a_newer_report_keeps_what_it_knows() -> None:
    data = machine_profile("arc-b580").to_dict()
    data["devices"][0]["pci_bus_id"] = "0000:03:00.0"  # a key a later xpukit might add
    facts = MachineFacts.from_dict(data)
    assert facts.devices[0].family == "arc-b"
    assert "ignored unknown keys: pci_bus_id" in facts.devices[0].notes


@pytest.mark.parametrize(("key", "value"), [("accelerator", "tpu"), ("compiled", ["rocm"])])
def test_machine_facts_with_unknown_backend_are_refused(key: str, value: object) -> None:
    data = machine_profile("arc-b580").to_dict()
    data[key] = value
    with pytest.raises(InvalidRequestError, match="not a backend xpukit knows"):
        MachineFacts.from_dict(data)
