"""Doctor: healthy and broken setups (simulated through facts), JSON schema, real run, CLI exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from xpukit.doctor.checks import diagnose
from xpukit.doctor.host import HostFacts
from xpukit.doctor.report import SCHEMA_VERSION, DoctorReport, run_doctor
from xpukit.machine.facts import MachineFacts
from xpukit.machine.profiles import machine_profile

HEALTHY_PKGS = {"torch": "2.13.0", "transformers": "5.22.2", "bitsandbytes": "0.50.2"}


def host(**kw: object) -> HostFacts:
    base: dict[str, object] = {"packages": dict(HEALTHY_PKGS)}
    base.update(kw)
    return HostFacts(**base)  # type: ignore[arg-type]


def codes(machine: MachineFacts, h: HostFacts) -> dict[str, str]:
    return {f.code: f.severity for f in diagnose(machine, h)}


def xpu_build_without_devices(**env: str) -> MachineFacts:
    m = machine_profile("arc-b580")
    return replace(m, devices=(), accelerator="cpu", env=env)


def test_healthy_xpu_machine() -> None:
    report = run_doctor(machine=machine_profile("arc-b580"), host=host(intel_gpus=("8086:e20b",)))
    assert report.healthy and report.findings == ()


def test_healthy_cpu_machine() -> None:
    assert codes(machine_profile("cpu-bf16"), host()) == {}


def test_cpu_wheel_on_intel_gpu_machine_is_an_error() -> None:
    found = diagnose(machine_profile("cpu-bf16"), host(intel_gpus=("8086:56a0",), level_zero_loader=True))
    (f,) = found
    assert (f.code, f.severity) == ("cpu-wheel-on-intel-gpu", "error")
    assert "whl/xpu" in f.fix and "8086:56a0" in f.message


def test_intel_gpu_without_driver_and_cpu_wheel_is_only_a_warning() -> None:
    # An office laptop's iGPU with no Level Zero driver: nothing the user meant to compute on.
    found = codes(machine_profile("cpu-bf16"), host(intel_gpus=("8086:9a49",)))
    assert found == {"cpu-wheel-on-intel-gpu": "warning"}


def test_healthy_cuda_machine_with_an_intel_igpu_is_healthy() -> None:
    pkgs = dict(HEALTHY_PKGS, bitsandbytes="0.47.0")
    report = run_doctor(
        machine=machine_profile("h100"),
        host=host(intel_gpus=("8086:a780",), intel_igpu_present=True, level_zero_loader=True, packages=pkgs),
    )
    assert report.healthy
    assert {f.code: f.severity for f in report.findings} == {"cpu-wheel-on-intel-gpu": "warning"}
    assert "a CUDA build" in report.findings[0].message


def test_accessible_nodes_without_render_group_are_not_called_locked() -> None:
    h = host(dri_exists=True, render_nodes_accessible=True, in_render_group=False)
    assert codes(machine_profile("arc-b580"), h) == {"render-group": "info"}
    # With no device visible, the runtime's own words matter more than the group.
    m = replace(
        xpu_build_without_devices(),
        notes=("Failed to initialize XPU devices. The driver may not be installed",),
    )
    found = diagnose(m, replace(h, intel_gpus=("8086:e20b",)))
    assert found[0].code == "xpu-no-device" and "Failed to initialize" in found[0].message


def test_selector_hiding_every_level_zero_gpu() -> None:
    found = diagnose(
        xpu_build_without_devices(ONEAPI_DEVICE_SELECTOR="opencl:*"), host(intel_gpus=("8086:e20b",))
    )
    assert found[0].code == "selector-selects-nothing" and "level_zero" in found[0].fix


def test_misspelled_and_ignored_variables() -> None:
    m = replace(
        machine_profile("arc-a770"),
        env={"UR_L0_USE_RELAXED_ALLOCATION_LIMITS": "1", "ZE_FLAT_DEVICE_HIERARCHY": "flat"},
    )
    assert codes(m, host()) == {"misspelled-variable": "warning", "hierarchy-ignored": "warning"}


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("flat", "export ZE_FLAT_DEVICE_HIERARCHY=FLAT"),  # a case slip: the upper-case spelling
        ("weird", "FLAT (every stack a device, the driver's default), COMPOSITE"),  # not WEIRD
    ],
)
def test_ignored_hierarchy_suggests_a_valid_value(value: str, fix: str) -> None:
    m = replace(machine_profile("arc-b580"), env={"ZE_FLAT_DEVICE_HIERARCHY": value})
    (f,) = diagnose(m, host())
    assert f.code == "hierarchy-ignored" and fix in f.fix and value.upper() not in f.fix.replace("FLAT", "")


@pytest.mark.parametrize(
    ("variable", "value", "unreadable"),
    [
        ("ZE_AFFINITY_MASK", "garbage", True),
        ("ZE_AFFINITY_MASK", "0,GPU-12ab", True),  # UUIDs are CUDA's
        ("ZE_AFFINITY_MASK", "0.1,2", False),
        ("CUDA_VISIBLE_DEVICES", "banana", True),
        ("CUDA_VISIBLE_DEVICES", "0,x", True),
        ("CUDA_VISIBLE_DEVICES", "1,GPU-8932f937", False),
        ("CUDA_VISIBLE_DEVICES", "-1", False),  # hides every device on purpose
        ("CUDA_VISIBLE_DEVICES", "", False),
    ],
)
def test_an_unreadable_mask_is_reported(variable: str, value: str, unreadable: bool) -> None:
    m = replace(machine_profile("arc-b580" if variable.startswith("ZE") else "h100"), env={variable: value})
    report = run_doctor(machine=m, host=host())
    found = {f.code: f for f in report.findings}
    assert ("mask-unreadable" in found) is unreadable
    if unreadable:
        assert found["mask-unreadable"].severity == "warning" and variable in found["mask-unreadable"].fix
        assert "OK: no known problem found" not in report.render()


def test_one_verdict_line_and_selftest_before_it() -> None:
    text = run_doctor(machine=machine_profile("cpu-bf16"), host=host()).render()
    assert text.endswith("\nOK: no known problem found.") and "\nhealthy" not in text
    checks = [{"ok": True, "device": "cpu", "check": "matmul-fp32", "detail": "1 ms"}]
    report = replace(
        run_doctor(machine=machine_profile("cpu-bf16"), host=host()),
        extras={"selftest": {"summary": "1/1 checks passed", "checks": checks, "passed": True}},
    )
    lines = report.render().splitlines()
    assert lines[-1] == "OK: no known problem found." and any("matmul-fp32" in line for line in lines[:-1])
    failed = replace(report, extras={"selftest": {**report.extras["selftest"], "passed": False}})
    assert failed.render().splitlines()[-1].startswith("NOT healthy: the selftest failed")


def test_failed_enumeration_is_a_blocking_finding() -> None:
    m = replace(machine_profile("cpu"), notes=("cuda device enumeration failed: RuntimeError: boom",))
    assert codes(m, host())["probe-failed"] == "error"


def test_ipex_installed_warns() -> None:
    pkgs = dict(HEALTHY_PKGS, **{"intel-extension-for-pytorch": "2.8.10+xpu"})
    assert codes(machine_profile("arc-a770"), host(packages=pkgs)) == {"ipex-installed": "warning"}


def test_render_group_missing_with_no_visible_device() -> None:
    h = host(intel_gpus=("8086:e20b",), dri_exists=True, render_nodes_accessible=False, in_render_group=False)
    found = diagnose(xpu_build_without_devices(), h)
    assert found[0].code == "render-permission" and found[0].severity == "error"
    assert "usermod -aG render" in found[0].fix


def test_render_group_missing_but_device_visible_is_a_warning() -> None:
    h = host(dri_exists=True, render_nodes_accessible=False, in_render_group=False)
    assert codes(machine_profile("arc-b580"), h) == {"render-permission": "warning"}


def test_affinity_mask_selecting_no_device() -> None:
    found = diagnose(xpu_build_without_devices(ZE_AFFINITY_MASK="0.1"), host(intel_gpus=("8086:e20b",)))
    assert found[0].code == "mask-selects-nothing" and found[0].severity == "error"
    assert "xpukit launch" in found[0].fix


def test_xpu_build_with_no_driver_quotes_the_runtime() -> None:
    m = replace(
        xpu_build_without_devices(),
        notes=("Failed to initialize XPU devices. The driver may not be installed",),
    )
    (f,) = diagnose(m, host(intel_gpus=("8086:e20b",)))
    assert f.code == "xpu-no-device" and f.severity == "error"
    assert "Failed to initialize XPU devices" in f.message


def test_old_bitsandbytes_with_xpu() -> None:
    pkgs = dict(HEALTHY_PKGS, bitsandbytes="0.47.0")
    found = codes(machine_profile("arc-a770"), host(packages=pkgs))
    assert found == {"bitsandbytes-old-for-xpu": "error"}
    # The same version is fine on a CPU-only machine without an Intel GPU.
    assert codes(machine_profile("cpu"), host(packages=pkgs)) == {}


def test_lunar_lake_free_memory_note() -> None:
    assert codes(machine_profile("lunar-lake"), host()) == {"free-memory-unknown": "info"}


def test_missing_or_old_transformers() -> None:
    assert codes(machine_profile("cpu"), host(packages={"transformers": "4.57.1"})) == {
        "transformers-old": "error"
    }
    assert codes(machine_profile("cpu"), host(packages={})) == {"transformers-missing": "error"}


def test_errors_sort_first() -> None:
    pkgs = dict(HEALTHY_PKGS, **{"intel-extension-for-pytorch": "2.8.10"})
    found = diagnose(xpu_build_without_devices(ZE_AFFINITY_MASK="7"), host(packages=pkgs))
    assert [f.severity for f in found] == sorted(
        (f.severity for f in found), key=["error", "warning", "info"].index
    )


def test_report_json_round_trip() -> None:
    report = run_doctor(machine=machine_profile("max-1550"), host=host())
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == SCHEMA_VERSION and data["healthy"] is True
    assert MachineFacts.from_dict(data["machine"]) == report.machine
    assert HostFacts(**{**data["host"], "intel_gpus": tuple(data["host"]["intel_gpus"])}) == report.host


def test_render_mentions_every_device() -> None:
    text = run_doctor(machine=machine_profile("lunar-lake"), host=host()).render()
    assert "xpu:0" in text and "free: unknown" in text and "integrated" in text


def test_unhealthy_report_says_so() -> None:
    report = DoctorReport(
        machine=machine_profile("cpu"),
        host=host(packages={}),
        findings=tuple(diagnose(machine_profile("cpu"), host(packages={}))),
    )
    assert not report.healthy and "NOT healthy" in report.render()


def _xpukit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xpukit.cli.main", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_doctor_json_reports_this_machine_truthfully() -> None:
    out = _xpukit("doctor", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    import torch

    assert data["machine"]["torch_version"] == torch.__version__
    assert data["machine"]["compiled"] == [
        b
        for b in ("xpu", "cuda", "mps")
        if (
            (b == "xpu" and torch.xpu._is_compiled())
            or (b == "cuda" and torch.version.cuda)
            or (b == "mps" and torch.backends.mps.is_built())
        )
    ]
    assert (
        data["host"]["packages"]["torch"] == torch.__version__.split("+")[0]
        or data["host"]["packages"]["torch"] == torch.__version__
    )


def test_doctor_exit_code_and_selftest() -> None:
    out = _xpukit("doctor", "--selftest")
    assert out.returncode == 0, out.stderr
    assert "matmul-fp32" in out.stdout and out.stdout.rstrip().splitlines()[-1].startswith("OK")


@pytest.mark.gpu
def test_doctor_selftest_on_gpu() -> None:
    out = _xpukit("doctor", "--selftest", "--json")
    data = json.loads(out.stdout)
    checks = data["selftest"]["checks"]
    gpu = [c for c in checks if c["device"] != "cpu"]
    assert gpu and all(c["ok"] for c in gpu if c["check"] in ("matmul-fp16", "matmul-fp32"))


def test_mixed_integrated_and_discrete_intel_gpus_warn() -> None:
    h = host(intel_gpus=("8086:7d55", "8086:e20b"), intel_igpu_present=True)
    assert codes(machine_profile("arc-b580"), h) == {"mixed-intel-gpus": "warning"}
    assert codes(machine_profile("arc-b580"), host(intel_gpus=("8086:e20b", "8086:e20b"))) == {}


def test_kernels_version_rejected_by_transformers_is_named() -> None:
    reason = (
        "kernels 0.17.2 is installed, but transformers 5.24.0 accepts only kernels>=0.18.2,<0.19 and "
        "treats it as missing"
    )
    found = diagnose(machine_profile("h100"), host(kernels_accepted=False, kernels_reason=reason))
    (f,) = found
    assert (f.code, f.severity) == ("kernels-rejected", "warning")
    assert "0.17.2" in f.message and "not installed" in f.message
    assert codes(machine_profile("h100"), host(kernels_accepted=True)) == {}
    assert codes(machine_profile("h100"), host(kernels_accepted=None)) == {}


def test_unreachable_hub_suggests_offline_mode() -> None:
    found = diagnose(machine_profile("cpu"), host(hub_reachable=False, hub_reason="DNS failed"))
    (f,) = found
    assert f.code == "hub-unreachable" and "HF_HUB_OFFLINE=1" in f.fix
    assert codes(machine_profile("cpu"), host(hub_offline=True, hub_reachable=None)) == {}


def test_real_host_reports_kernels_and_hub_without_network() -> None:
    from xpukit.doctor.host import gather_host

    h = gather_host()  # conftest sets HF_HUB_OFFLINE=1: no network is attempted
    assert h.hub_offline is True and h.hub_reachable is None
    if h.packages.get("kernels"):
        assert h.kernels_accepted is not None and "kernels" in h.kernels_reason


def test_what_the_versions_enable_from_hand_made_facts() -> None:
    from xpukit.doctor.ecosystem import enabled_by_versions

    newest = {
        "transformers": "5.25.0",
        "kernels": "0.19.1",
        "liger-kernel": "0.8.5",
        "triton": "3.9.0",
        "bitsandbytes": "0.50.2",
        "peft": "0.21.2",
        "deepspeed": "0.19.8",
    }
    lines = enabled_by_versions(newest, kernels_accepted=True, kernels_reason="kernels 0.19.1 is installed")
    text = "\n".join(lines)
    assert "Hub kernels: on" in text and "transformers 5.25.0 turns use_kernels on" in text
    assert "liger-kernel 0.8.5 (triton 3.9.0)" in text and "deepspeed 0.19.8" in text
    older = {"transformers": "5.22.2", "kernels": "0.19.1", "bitsandbytes": "0.47.0"}
    reason = "kernels 0.19.1 is installed, but transformers 5.22.2 accepts only kernels>=0.17.2,<0.18"
    text = "\n".join(enabled_by_versions(older, kernels_accepted=False, kernels_reason=reason))
    assert f"Hub kernels: off ({reason})" in text and "turns use_kernels on" not in text
    assert 'liger-kernel: off (needs liger-kernel and triton: pip install "xpukit[liger]")' in text
    assert (
        "no XPU backend before 0.48" in text
        and "no strategy='deepspeed' (pip install \"xpukit[deepspeed]\")" in text
    )


@pytest.mark.parametrize("profile", ["cpu-bf16", "cpu", "laptop-16g"])
def test_doctor_and_the_loader_agree_about_cpu_half_precision(profile: str) -> None:
    """One rule (machine/precision.py slow_precision): doctor's "emulated (slow)" list and the plan's
    "only emulated" warning for dtype='float16' / 'bfloat16' name the same formats on every CPU."""
    from xpukit import plan_load
    from xpukit.doctor.report import _precisions
    from xpukit.machine.profiles import device_profile
    from xpukit.planning.model.reference_models import reference_config

    line = _precisions(device_profile(profile))
    emulated = line.split("emulated (slow): ")[1].split(";")[0].split(", ") if "emulated" in line else []
    for short, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        plan = plan_load(reference_config("qwen3-0.6b"), facts=profile, dtype=dtype)
        warned = any("only emulated" in w for w in plan.warnings)
        assert warned == (short in emulated), (profile, dtype, line, plan.warnings)
    if profile == "cpu-bf16":  # AVX512-FP16 and AMX: fp16 is native there, as doctor says
        assert "fp16" not in emulated
