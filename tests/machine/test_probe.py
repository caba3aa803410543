"""Detection: real on this machine, and simulated XPU/CUDA runtimes built from recorded dumps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from xpukit.machine.probe import cpu_facts, detect, xpu_device_facts

MiB = 2**20


def test_detect_this_machine_for_real(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XPUKIT_CPU_FLAGS")  # this one test reads the real host
    facts = detect()
    import torch

    assert facts.torch_version == torch.__version__
    assert facts.cpu.total_memory > 0
    assert facts.cpu.free_memory is not None
    # The CPU bf16 fact must agree with /proc/cpuinfo, read independently here.
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = cpuinfo.read_text()
        words = set(flags.split())
        assert facts.cpu.native_bf16 == bool(words & {"avx512_bf16", "amx_bf16", "bf16"})
        assert facts.cpu.fp16 == bool(words & {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
    if not torch.xpu._is_compiled() and not torch.version.cuda:
        assert facts.accelerator == "cpu"
        assert facts.devices == ()
        assert facts.compiled in ((), ("mps",))


def test_detect_without_devices_does_not_initialise() -> None:
    code = (
        "import xpukit, torch; f = xpukit.detect(devices=False); "
        "print(torch.xpu.is_initialized(), torch.cuda.is_initialized(), f.devices)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "()"]


# Flag sets as /proc/cpuinfo lists them on real CPUs (abridged to the SIMD and matrix flags), and
# what each computes natively.
REAL_CPUS = {
    "Xeon 8480+ (Sapphire Rapids)": (
        "sse4_2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 "
        "avx512_fp16 amx_bf16 amx_tile amx_int8",
        True,
        True,
    ),
    "Xeon 8380 (Ice Lake)": (
        "sse4_2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_vbmi2 avx512_bitalg",
        False,
        False,
    ),
    "Core i7-8700 (Coffee Lake, AVX2)": ("sse4_2 avx f16c fma avx2", False, False),
    "EPYC 7763 (Zen 3)": ("sse4_2 avx f16c fma avx2 sha_ni vaes vpclmulqdq", False, False),
    "EPYC 9654 (Zen 4)": (
        "sse4_2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_bitalg",
        True,
        False,
    ),
    "Graviton3 (Neoverse V1, aarch64 Features)": ("fp asimd fphp asimdhp asimddp sve bf16 i8mm", True, True),
}


@pytest.mark.parametrize("cpu", sorted(REAL_CPUS))
def test_cpu_native_arithmetic_from_real_flag_sets(cpu: str) -> None:
    from xpukit.machine.probe import cpu_facts_from_flags

    flags, bf16, fp16 = REAL_CPUS[cpu]
    facts = cpu_facts_from_flags(cpu, set(flags.split()), total_memory=2**34, free_memory=2**33)
    assert (facts.native_bf16, facts.fp16) == (bf16, fp16)


@pytest.mark.parametrize("cpu", sorted(REAL_CPUS))
def test_injected_cpu_flags_replace_the_hosts(cpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    flags, bf16, fp16 = REAL_CPUS[cpu]
    monkeypatch.setenv("XPUKIT_CPU_FLAGS", flags)
    facts = cpu_facts()
    assert (facts.native_bf16, facts.fp16) == (bf16, fp16)


def test_doctor_says_an_f16c_only_cpu_computes_no_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    from xpukit.doctor.host import HostFacts
    from xpukit.doctor.report import run_doctor

    monkeypatch.setenv("XPUKIT_CPU_FLAGS", REAL_CPUS["EPYC 7763 (Zen 3)"][0])
    report = run_doctor(machine=detect(devices=False), host=HostFacts())
    (line,) = [line for line in report.render().splitlines() if "native:" in line and "cpu" in line.lower()]
    # fp32 is named (the line read "native: fp64", as if the CPU computed in fp64 only).
    assert line.endswith("native: fp32, fp64; emulated (slow): bf16, fp16")
    monkeypatch.setenv("XPUKIT_CPU_FLAGS", REAL_CPUS["Xeon 8480+ (Sapphire Rapids)"][0])
    report = run_doctor(machine=detect(devices=False), host=HostFacts())
    (line,) = [line for line in report.render().splitlines() if "native:" in line and "cpu" in line.lower()]
    assert line.endswith("native: bf16, fp16, fp32, fp64")


def test_cpu_facts_reads_memory() -> None:
    cpu = cpu_facts()
    assert cpu.backend == "cpu" and cpu.torch_device == "cpu"
    assert 0 < (cpu.free_memory or 0) <= cpu.total_memory


# --- simulated runtimes --------------------------------------------------------------------------
# Property dumps as torch.xpu.get_device_properties returns them (docs/platform-notes.md §2.2 and §3.1).
A770_DUMP = dict(
    name="Intel(R) Arc(TM) A770 Graphics",
    device_id=0x56A0,
    total_memory=15473 * MiB,
    has_fp16=True,
    has_fp64=False,
    has_bfloat16_conversions=True,
    has_subgroup_matrix_multiply_accumulate=True,
    is_integrated_gpu=False,
)
LNL_DUMP = dict(
    name="Intel(R) Arc(TM) 140V GPU (16GB)",
    device_id=0x64A0,
    total_memory=16 * 2**30,
    has_fp16=True,
    has_fp64=True,
    has_bfloat16_conversions=False,  # may read False on LNL
    has_subgroup_matrix_multiply_accumulate=True,
    is_integrated_gpu=True,
)
MTL_DUMP = dict(
    name="Intel(R) Arc(TM) Graphics",
    device_id=0x7D55,
    total_memory=15 * 2**30,
    has_fp16=True,
    has_fp64=True,
    has_bfloat16_conversions=False,
    has_subgroup_matrix_multiply_accumulate=False,
    is_integrated_gpu=True,
)
B580_NO_OCLOC = dict(
    name="Intel(R) Arc(TM) B580 Graphics",
    device_id=0xE20B,
    total_memory=12 * 2**30,
    has_fp16=False,
    has_fp64=False,
    has_bfloat16_conversions=False,
    has_subgroup_matrix_multiply_accumulate=False,
)
MAX1550_STACK = dict(
    name="Intel(R) Data Center GPU Max 1550",
    device_id=0x0BD5,
    total_memory=64 * 2**30,
    has_fp16=True,
    has_fp64=True,
    has_bfloat16_conversions=True,
    has_subgroup_matrix_multiply_accumulate=True,
    is_integrated_gpu=False,
)


def _simulate_xpu(monkeypatch: pytest.MonkeyPatch, dumps: list[dict[str, Any]], free_ok: bool) -> None:
    import torch

    def mem_get_info(i: int) -> tuple[int, int]:
        if not free_ok:
            raise RuntimeError(
                "The device (Intel(R) Graphics [0x64a0]) doesn't support querying the available free memory."
            )
        return (dumps[i]["total_memory"] - 100 * MiB, dumps[i]["total_memory"])

    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.version, "xpu", "20250301", raising=False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: len(dumps))
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda i: SimpleNamespace(**dumps[i]))
    monkeypatch.setattr(torch.xpu, "mem_get_info", mem_get_info)


def test_simulated_xpu_arc_a770(monkeypatch: pytest.MonkeyPatch) -> None:
    _simulate_xpu(monkeypatch, [A770_DUMP], free_ok=True)
    facts = detect()
    assert facts.accelerator == "xpu" and facts.compiled[0] == "xpu"
    (d,) = facts.devices
    assert (d.family, d.native_bf16, d.fp64, d.integrated) == ("arc-a", True, False, False)
    assert d.free_memory == 15373 * MiB
    assert facts.torch_xpu == "20250301"


def test_simulated_xpu_max_1550_flat_two_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    _simulate_xpu(monkeypatch, [MAX1550_STACK, MAX1550_STACK], free_ok=True)
    facts = detect()
    assert [d.torch_device for d in facts.devices] == ["xpu:0", "xpu:1"]
    assert all(d.family == "max" and d.fp64 for d in facts.devices)


def test_simulated_xpu_lunar_lake_free_memory_query_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _simulate_xpu(monkeypatch, [LNL_DUMP], free_ok=False)
    (d,) = detect().devices
    assert d.family == "lunar-lake"
    assert d.free_memory is None and not d.free_memory_known
    assert d.native_bf16  # family trait wins over a has_bfloat16_conversions that reads False
    assert d.integrated


def test_simulated_xpu_meteor_lake_has_no_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    _simulate_xpu(monkeypatch, [MTL_DUMP], free_ok=False)
    (d,) = detect().devices
    assert (d.family, d.native_bf16, d.fp64) == ("meteor-lake", False, True)


def test_simulated_xpu_all_flags_false_means_unknown_not_absent() -> None:
    d = xpu_device_facts(0, SimpleNamespace(**B580_NO_OCLOC), free=None)
    assert d.family == "arc-b" and d.native_bf16 and d.fp16
    assert any("ocloc" in n for n in d.notes)


def test_simulated_xpu_unknown_device_uses_flags() -> None:
    dump = dict(MTL_DUMP, name="Intel(R) Graphics [0x9999]", device_id=0x9999)
    d = xpu_device_facts(0, SimpleNamespace(**dump), free=None)
    assert d.family == "intel-unknown" and d.native_bf16 is False
    assert any("unrecognised" in n for n in d.notes)


def test_simulated_xpu_runtime_warning_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    import torch

    def no_devices() -> int:
        warnings.warn(
            "Failed to initialize XPU devices. The driver may not be installed", UserWarning, stacklevel=1
        )
        return 0

    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", no_devices)
    facts = detect()
    assert facts.accelerator == "cpu" and facts.devices == ()
    assert any("Failed to initialize XPU devices" in n for n in facts.notes)


def _simulate_cuda(monkeypatch: pytest.MonkeyPatch, props: list[dict[str, Any]]) -> None:
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(**props[i]))
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda i: (props[i]["total_memory"] // 2, props[i]["total_memory"])
    )


@pytest.mark.parametrize(
    ("name", "cc", "bf16"),
    [("NVIDIA H100 80GB HBM3", (9, 0), True), ("Tesla T4", (7, 5), False), ("NVIDIA A100", (8, 0), True)],
)
def test_simulated_cuda(monkeypatch: pytest.MonkeyPatch, name: str, cc: tuple[int, int], bf16: bool) -> None:
    _simulate_cuda(monkeypatch, [dict(name=name, major=cc[0], minor=cc[1], total_memory=16 * 2**30)])
    facts = detect()
    assert facts.accelerator == "cuda" and facts.torch_cuda == "13.0"
    (d,) = facts.devices
    assert (d.compute_capability, d.native_bf16, d.free_memory) == (cc, bf16, 8 * 2**30)


def test_simulated_xpu_preferred_over_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _simulate_xpu(monkeypatch, [A770_DUMP], free_ok=True)
    _simulate_cuda(monkeypatch, [dict(name="Tesla T4", major=7, minor=5, total_memory=16 * 2**30)])
    facts = detect()
    assert facts.accelerator == "xpu"
    assert facts.compiled[:2] == ("xpu", "cuda")


@pytest.mark.parametrize(
    ("name", "integrated", "bf16"),
    [
        ("Intel(R) Arc(TM) Graphics", None, False),  # MTL/ARL share the name: no bf16 assumed
        ("Intel(R) Graphics [0x9a49]", True, False),  # an unknown iGPU
        ("Intel(R) Future Discrete GPU", False, True),  # an unknown discrete card
    ],
)
def test_simulated_xpu_unknown_device_without_flags(name: str, integrated: bool | None, bf16: bool) -> None:
    dump = dict(B580_NO_OCLOC, name=name, device_id=None, is_integrated_gpu=integrated)
    d = xpu_device_facts(0, SimpleNamespace(**dump), free=None)
    assert d.family == "intel-unknown" and d.native_bf16 is bf16
    assert any("not assumed" in n or "assumed" in n for n in d.notes)


def test_simulated_xpu_broken_driver_gives_a_note_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def lost(i: int) -> object:
        raise RuntimeError("UR_RESULT_ERROR_DEVICE_LOST")

    _simulate_xpu(monkeypatch, [A770_DUMP], free_ok=True)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lost)
    facts = detect()
    assert facts.devices == () and facts.accelerator == "cpu"
    assert any("xpu device enumeration failed" in n and "DEVICE_LOST" in n for n in facts.notes)


def _forget_other_touches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide what earlier tests in this process imported or cached (transformers, accelerate)."""
    import sys

    for name in (
        "transformers.integrations.sdpa_attention",
        "transformers.utils.import_utils",
        "accelerate.utils.imports",
    ):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_runtime_initialized_counts_xpukits_own_enumeration(monkeypatch: pytest.MonkeyPatch) -> None:
    from xpukit.machine import probe

    _simulate_xpu(monkeypatch, [A770_DUMP], free_ok=True)
    monkeypatch.setattr(probe, "_DEVICES_READ", set())
    _forget_other_touches(monkeypatch)
    assert probe.runtime_initialized() is False
    detect(devices=False)
    assert probe.runtime_initialized() is False  # reading the build touches nothing
    detect()
    assert probe.runtime_initialized() is True  # enumerating XPUs initialises Level Zero


def test_runtime_initialized_counts_transformers_xpu_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import functools
    import sys
    import types

    from xpukit.machine import probe

    _simulate_xpu(monkeypatch, [A770_DUMP], free_ok=True)
    monkeypatch.setattr(probe, "_DEVICES_READ", set())
    _forget_other_touches(monkeypatch)
    fake = types.ModuleType("transformers.utils.import_utils")
    fake.is_torch_xpu_available = functools.lru_cache(lambda check_device=False: True)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.utils.import_utils", fake)
    assert probe.runtime_initialized() is False
    fake.is_torch_xpu_available()  # type: ignore[attr-defined]
    assert probe.runtime_initialized() is True
