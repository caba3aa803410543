"""Every plan and every doctor finding over a grid of cases, compared with a stored copy.

The planner and the doctor are pure functions of facts, so their whole output can be recorded once and
compared on every run: a change anywhere in deciding shows up here as a readable diff of the decision
that moved (its value, reason, source, rejected alternatives), the warnings, the memory or the
training estimate. A change made on purpose is recorded again, in a commit of its own that says which
decisions changed and why::

    XPUKIT_RECORD=1 python -m pytest -n 0 tests/planning/test_recorded_plans.py

The grid: the reference shapes (:mod:`xpukit.planning.model.reference_models`) × the recorded device
profiles (:mod:`xpukit.machine.profiles`) × requests (inference, 4/8-bit, LoRA and its training
plan, memory budgets, ranks of a launched job, fast decoding, attention and kernels), under
three injected software environments. What is installed on this host never enters: package
versions, the ``kernels`` release transformers accepts, the Hub kernel cache, the Hub's status and
transformers' kernel tables are all injected, so the copy is the same with the pinned extras, with
every extra at its newest release, or with none, on any CPU.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import pkgutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

RECORDED = Path(__file__).resolve().parents[1] / "recorded"
PLANS = RECORDED / "plans.json"
FINDINGS = RECORDED / "doctor.json"
RECORD = os.environ.get("XPUKIT_RECORD") == "1"

SHAPES = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama-3.1-8b", "llama-3.1-70b")
# One machine of every profile (Arc, Max, integrated, NVIDIA, Apple, CPU).
PROFILES = (
    "arc-a770",
    "arc-b580",
    "arc-pro-b60",
    "max-1100",
    "max-1550",
    "lunar-lake",
    "meteor-lake",
    "h100",
    "h200",
    "t4",
    "apple-m2",
    "cpu",
    "cpu-bf16",
)
MULTI = ("max-1550", "arc-b580x2", "h100x2", "h200x4")  # several devices: ranks, sharding

# Requests planned for every shape on every profile.
CORE: dict[str, dict[str, Any]] = {
    "inference": {},
    "quantize=4bit": {"quantize": "4bit"},
    "quantize=8bit": {"quantize": "8bit"},
    "quantize=auto": {"quantize": "auto"},
    "lora": {"lora": True},
    "lora train 4x512": {"lora": True, "batch_size": 4, "seq_len": 512},
    "max_memory 10GB": {"max_memory": {0: "10GB"}},
    "fast_decode": {"fast_decode": True},
}
# Requests planned for two shapes on every profile.
MORE: dict[str, dict[str, Any]] = {
    "quantize=nf4": {"quantize": "nf4"},
    "dtype=float16": {"dtype": "float16"},
    "dtype=float32": {"dtype": "float32"},
    "lora quantize=4bit": {"lora": True, "quantize": "4bit"},
    "lora quantize=8bit": {"lora": True, "quantize": "8bit"},
    "lora train 1x128": {"lora": True, "batch_size": 1, "seq_len": 128},
    "lora train 16x8192": {"lora": True, "batch_size": 16, "seq_len": 8192},
    "lora offload=True": {"lora": True, "offload": True, "max_memory": {0: "4GB", "cpu": "60GB"}},
    "lora max_memory 8GB": {"lora": True, "max_memory": {0: "8GB"}},
    "lora seed=7": {"lora": True, "seed": 7},
    "max_memory 8GB": {"max_memory": {0: "8GB"}},
    "max_memory 12GB": {"max_memory": {0: "12GB"}},
    "max_memory 4GB cpu 30GB": {"max_memory": {0: "4GB", "cpu": "30GB"}},
    "offload=False": {"offload": False},
    "headroom 6GiB": {"headroom": "6GiB"},
    "fast_decode quantize=4bit": {"fast_decode": True, "quantize": "4bit"},
    "fast_decode quantize=8bit": {"fast_decode": True, "quantize": "8bit"},
    "attn=eager": {"attn": "eager"},
    "attn=flex_attention": {"attn": "flex_attention"},
    "attn=flash_attention_2": {"attn": "flash_attention_2"},
    "attn=flash_attention_3": {"attn": "flash_attention_3"},
    "attn=hub kernel": {"attn": "kernels-community/flash-attn2"},
    "attn=flash_attention_2 offload": {"attn": "flash_attention_2", "max_memory": {0: "4GB", "cpu": "60GB"}},
    "kernels=True": {"kernels": True},
    "kernels=False": {"kernels": False},
    "device=cpu": {"device": "cpu"},
    "device_map=cpu": {"device_map": "cpu"},
    "device_map dict": {"device_map": {"": 0}},
    "strategy=ddp lora": {"strategy": "ddp", "lora": True},
    "strategy=fsdp lora": {"strategy": "fsdp", "lora": True},
    "model_class": {"model_class": "AutoModelForSequenceClassification"},
}
MORE_SHAPES = ("qwen3-0.6b", "qwen3-8b")
MORE_PROFILES = ("arc-a770", "arc-b580", "max-1550", "lunar-lake", "h100", "t4", "apple-m2", "cpu")
# Requests for each rank of a launched job: (rank, world size) and plan_load's keywords.
RANKS: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {
    "rank 0/2": ((0, 2), {}),
    "rank 1/2": ((1, 2), {}),
    "rank 1/2 lora": ((1, 2), {"lora": True}),
    "rank 1/2 strategy=ddp lora 4bit": ((1, 2), {"strategy": "ddp", "lora": True, "quantize": "4bit"}),
    "rank 1/2 strategy=fsdp lora 4bit": ((1, 2), {"strategy": "fsdp", "lora": True, "quantize": "4bit"}),
    "rank 3/4 strategy=fsdp lora": ((3, 4), {"strategy": "fsdp", "lora": True}),
}
RANK_SHAPES = ("qwen3-8b", "qwen3-32b", "llama-3.1-70b")
# Requests whose answer turns on the software around the planner (extras, kernels, the cache).
SOFTWARE: dict[str, dict[str, Any]] = {
    name: {**CORE, **MORE}[name]
    for name in (
        "inference",
        "quantize=4bit",
        "quantize=8bit",
        "quantize=auto",
        "quantize=nf4",
        "lora",
        "lora train 4x512",
        "fast_decode",
        "attn=flash_attention_2",
        "attn=hub kernel",
        "kernels=True",
    )
}
SOFTWARE_PROFILES = MORE_PROFILES

# --- the injected software -------------------------------------------------------------------------

# Distribution -> import name, for every optional package xpukit asks about, and the core ones.
MODULES = {
    "torch": "torch",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "huggingface-hub": "huggingface_hub",
    "xpukit": "xpukit",
    "peft": "peft",
    "bitsandbytes": "bitsandbytes",
    "kernels": "kernels",
    "liger-kernel": "liger_kernel",
    "triton": "triton",
    "torchao": "torchao",
    "deepspeed": "deepspeed",
    "matplotlib": "matplotlib",
}
CORE_PACKAGES = {
    "torch": "2.13.0",
    "transformers": "5.0.0",
    "accelerate": "1.12.0",
    "huggingface-hub": "1.2.0",
    "xpukit": "0.0.0",
    "peft": "0.18.0",  # imported for real to check LoRA targets: the planner only builds its LoraConfig
}
EXTRAS = {
    "bitsandbytes": "0.49.0",
    "kernels": "0.11.7",
    "liger-kernel": "0.6.4",
    "triton": "3.5.0",
    "torchao": "0.18.0",
    "deepspeed": "0.18.0",
    "matplotlib": "3.10.0",
}
# The kernels transformers' default mapping names per layer and device type (inference mode).
LAYER_KERNELS = {
    "RMSNorm": {
        "cuda": "kernels-community/liger_kernels",
        "xpu": "kernels-community/rmsnorm",
        "mps": "kernels-community/mlx_rmsnorm",
    },
    "SiLU": {"cuda": "kernels-community/activation"},
    "rotary_pos_emb": {"xpu": "kernels-community/rotary"},
}
ATTENTION_KERNEL_VERSION = 1  # transformers' FLASH_ATTN_KERNEL_VERSIONS entry for every repo
ENVIRONMENTS: dict[str, dict[str, Any]] = {
    # Every extra installed, transformers accepts the kernels release, nothing in the kernel cache.
    "extras": {"packages": {**CORE_PACKAGES, **EXTRAS}, "kernels_accepted": True, "cached": ()},
    # The same with every Hub kernel the planner may name in the local cache.
    "kernels cached": {
        "packages": {**CORE_PACKAGES, **EXTRAS},
        "kernels_accepted": True,
        "cached": (
            "kernels-community/flash-attn2",
            "kernels-community/vllm-flash-attn3",
            *sorted({repo for per in LAYER_KERNELS.values() for repo in per.values()}),
        ),
    },
    # No optional extra at all (peft excepted: the planner imports it for real).
    "no extras": {"packages": dict(CORE_PACKAGES), "kernels_accepted": False, "cached": ()},
}


@contextmanager
def injected(env: dict[str, Any], cache: Path) -> Iterator[None]:
    """The planner sees ``env``'s packages, kernels release, kernel cache and an offline Hub."""
    import xpukit._compat as compat
    import xpukit.hub as hub
    import xpukit.planning.device.attention as attention
    import xpukit.planning.device.layer_kernels as layer_kernels
    from xpukit.planning.device.attention import KernelRef

    packages: dict[str, str] = env["packages"]
    modules = {MODULES[p] for p in packages}

    def installed_version(package: str) -> str | None:
        return packages.get(package)

    def is_installed(module: str) -> bool:
        return module in modules

    accepted = bool(env["kernels_accepted"])
    support = hub.KernelsSupport(
        installed=packages.get("kernels"),
        required=">=0.11.1,<0.12",
        transformers=packages["transformers"],
        accepted=accepted,
        reason=(
            f"kernels {packages['kernels']} is installed (transformers {packages['transformers']} accepts "
            "kernels>=0.11.1,<0.12)"
            if accepted
            else 'the `kernels` package is not installed (pip install "xpukit[kernels]")'
        ),
    )
    status = hub.HubStatus(
        endpoint="https://huggingface.co", offline=True, reachable=False, reason="HF_HUB_OFFLINE is set"
    )

    def mapping_refs(layers: tuple[str, ...], device_type: str) -> list[KernelRef]:
        if not layers or not support.accepted:
            return []
        repos = [LAYER_KERNELS.get(layer, {}).get(device_type) for layer in layers]
        return [KernelRef(repo=repo, version=1) for repo in dict.fromkeys(r for r in repos if r)]

    _import_every_planner_module()  # so every ``from … import`` binding exists before it is replaced
    replacements = {
        compat.installed_version: installed_version,
        compat.is_installed: is_installed,
        hub.kernels_support: lambda: support,
        hub.hub_status: lambda refresh=False: status,
    }
    for repo in env["cached"]:
        root = cache / f"kernels--{repo.replace('/', '--')}"
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / f"v{ATTENTION_KERNEL_VERSION}").write_text("0123abcd")
        (root / "snapshots" / "0123abcd").mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("KERNELS_CACHE", str(cache))
        # Every binding of the real functions, in every xpukit module (``from … import`` copies them).
        for module in [m for name, m in sys.modules.items() if name.startswith("xpukit") and m is not None]:
            for attr, value in list(vars(module).items()):
                if any(value is real for real in replacements):
                    mp.setattr(module, attr, replacements[value])
        mp.setattr(attention, "_kernel_version", lambda repo: ATTENTION_KERNEL_VERSION)
        mp.setattr(layer_kernels, "mapping_refs", mapping_refs)
        yield


def _import_every_planner_module() -> None:
    import xpukit.machine
    import xpukit.planning
    import xpukit.select
    import xpukit.sources

    for package in (xpukit.planning, xpukit.machine, xpukit.select, xpukit.sources):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(info.name)


# --- the plans -----------------------------------------------------------------------------------


def cases() -> Iterator[tuple[str, str, str, str, tuple[int, int] | None, dict[str, Any]]]:
    """``(environment, shape, machine, request name, rank, keywords)`` in the stored order."""
    for shape in SHAPES:
        for profile in PROFILES:
            for name, kw in CORE.items():
                yield "extras", shape, profile, name, None, kw
            if shape in MORE_SHAPES and profile in MORE_PROFILES:
                for name, kw in MORE.items():
                    yield "extras", shape, profile, name, None, kw
    for shape in RANK_SHAPES:
        for profile in MULTI:
            for name, (rank, kw) in RANKS.items():
                yield "extras", shape, profile, name, rank, kw
    for env in ("kernels cached", "no extras"):
        for profile in SOFTWARE_PROFILES:
            for name, kw in SOFTWARE.items():
                yield env, "qwen3-8b", profile, name, None, kw


def plan_record(plan_for: Callable[[], Any]) -> dict[str, Any]:
    """The plan as ``xpukit plan --json`` writes it, or the error that refused the request."""
    from xpukit.errors import XpukitError

    try:
        plan = plan_for()
    except XpukitError as exc:
        return {"error": {"type": type(exc).__name__, "message": str(exc)}}
    return {"plan": plan.to_dict()}


def record_plans(tmp: Path) -> dict[str, Any]:
    """Every case's plan, with the model facts and machines each written once."""
    from xpukit.machine.launch import LaunchFacts
    from xpukit.planning.device.choice import machine_for
    from xpukit.planning.model.reference_models import reference_config
    from xpukit.planning.plan import plan_load

    configs = {shape: reference_config(shape) for shape in SHAPES}
    model_facts: dict[str, Any] = {}
    machines: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    by_env: dict[str, list[tuple[str, str, str, tuple[int, int] | None, dict[str, Any]]]] = {}
    for env, shape, profile, name, rank, kw in cases():
        by_env.setdefault(env, []).append((shape, profile, name, rank, kw))
    for env, env_cases in by_env.items():
        with injected(ENVIRONMENTS[env], tmp / env.replace(" ", "-")):
            for shape, profile, name, rank, kw in env_cases:
                machine = machine_for(profile)[0]
                if rank is not None:
                    machine = replace(machine, launch=LaunchFacts.assumed(*rank))

                def plan_for(shape: str = shape, machine: Any = machine, kw: dict[str, Any] = kw) -> Any:
                    return plan_load(configs[shape], facts=machine, **kw)

                rec = plan_record(plan_for)
                if "plan" in rec:
                    _share(rec["plan"], shape, profile, model_facts, machines)
                plans[f"{env} | {shape} | {profile} | {name}"] = rec
    return {
        "about": "xpukit plan --json for every case of tests/planning/test_recorded_plans.py; model_facts, "
        "machine and device given as '@name' are the entries of the tables below (XPUKIT_RECORD=1 rewrites "
        "this)",
        "environments": ENVIRONMENTS,
        "model_facts": model_facts,
        "machines": machines,
        "plans": plans,
    }


def _share(
    plan: dict[str, Any], shape: str, profile: str, model_facts: dict[str, Any], machines: dict[str, Any]
) -> None:
    """Replace the model facts, machine and device by a reference to one shared copy where equal."""
    if model_facts.setdefault(shape, plan["model_facts"]) == plan["model_facts"]:
        plan["model_facts"] = f"@{shape}"
    machine = plan["machine"]
    if machines.setdefault(profile, machine) == machine:
        plan["machine"] = f"@{profile}"
    devices = [*machine["devices"], machine["cpu"]]
    for i, device in enumerate(devices):
        if device == plan["device"]:
            plan["device"] = f"@machine.devices[{i}]" if i < len(devices) - 1 else "@machine.cpu"
            break


# --- doctor ----------------------------------------------------------------------------------------


def doctor_cases() -> Iterator[tuple[str, Any, Any]]:
    """``(name, machine facts, host facts)``: the setups of tests/doctor/test_doctor.py and every profile."""
    from xpukit.doctor.host import HostFacts
    from xpukit.machine.profiles import machine_profile, profile_names

    healthy = {"torch": "2.13.0", "transformers": "5.22.2", "bitsandbytes": "0.50.2"}

    def host(**kw: Any) -> HostFacts:
        return HostFacts(**{"packages": dict(healthy), **kw})

    def no_devices(**env: str) -> Any:
        return replace(machine_profile("arc-b580"), devices=(), accelerator="cpu", env=env)

    driver_note = ("Failed to initialize XPU devices. The driver may not be installed",)
    old_bnb = dict(healthy, bitsandbytes="0.47.0")
    ipex = dict(healthy, **{"intel-extension-for-pytorch": "2.8.10+xpu"})
    rejected = (
        "kernels 0.17.2 is installed, but transformers 5.24.0 accepts only kernels>=0.18.2,<0.19 and "
        "treats it as missing"
    )
    for name in profile_names():
        yield f"{name}: healthy", machine_profile(name), host()
        yield (
            f"{name}: nothing installed",
            replace(machine_profile(name), torch_version=None),
            host(packages={}),
        )
    yield "arc-b580x2: healthy", machine_profile("arc-b580x2"), host(intel_gpus=("8086:e20b", "8086:e20b"))
    yield (
        "cpu wheel, Intel GPU with driver",
        machine_profile("cpu-bf16"),
        host(intel_gpus=("8086:56a0",), level_zero_loader=True),
    )
    yield "cpu wheel, Intel iGPU without driver", machine_profile("cpu-bf16"), host(intel_gpus=("8086:9a49",))
    yield (
        "cuda with an Intel iGPU",
        machine_profile("h100"),
        host(intel_gpus=("8086:a780",), intel_igpu_present=True, level_zero_loader=True, packages=old_bnb),
    )
    render = {"dri_exists": True, "render_nodes_accessible": True, "in_render_group": False}
    yield "render nodes open, not in group", machine_profile("arc-b580"), host(**render)
    yield (
        "render nodes open, no device, runtime note",
        replace(no_devices(), notes=driver_note),
        host(**render, intel_gpus=("8086:e20b",)),
    )
    yield (
        "selector selects nothing",
        no_devices(ONEAPI_DEVICE_SELECTOR="opencl:*"),
        host(intel_gpus=("8086:e20b",)),
    )
    yield (
        "misspelled and ignored variables",
        replace(
            machine_profile("arc-a770"),
            env={"UR_L0_USE_RELAXED_ALLOCATION_LIMITS": "1", "ZE_FLAT_DEVICE_HIERARCHY": "flat"},
        ),
        host(),
    )
    yield (
        "hierarchy weird",
        replace(machine_profile("arc-b580"), env={"ZE_FLAT_DEVICE_HIERARCHY": "weird"}),
        host(),
    )
    masks = [
        ("ZE_AFFINITY_MASK", "garbage"),
        ("ZE_AFFINITY_MASK", "0,GPU-12ab"),
        ("ZE_AFFINITY_MASK", "0.1,2"),
        ("CUDA_VISIBLE_DEVICES", "banana"),
        ("CUDA_VISIBLE_DEVICES", "0,x"),
        ("CUDA_VISIBLE_DEVICES", "1,GPU-8932f937"),
        ("CUDA_VISIBLE_DEVICES", "-1"),
        ("CUDA_VISIBLE_DEVICES", ""),
    ]
    for variable, value in masks:
        profile = "arc-b580" if variable.startswith("ZE") else "h100"
        yield f"{variable}={value!r}", replace(machine_profile(profile), env={variable: value}), host()
    yield (
        "enumeration failed",
        replace(machine_profile("cpu"), notes=("cuda device enumeration failed: RuntimeError: boom",)),
        host(),
    )
    yield "ipex installed", machine_profile("arc-a770"), host(packages=ipex)
    yield (
        "render group missing, no device",
        no_devices(),
        host(
            intel_gpus=("8086:e20b",), dri_exists=True, render_nodes_accessible=False, in_render_group=False
        ),
    )
    yield (
        "render group missing, device visible",
        machine_profile("arc-b580"),
        host(dri_exists=True, render_nodes_accessible=False, in_render_group=False),
    )
    yield "affinity mask selects nothing", no_devices(ZE_AFFINITY_MASK="0.1"), host(intel_gpus=("8086:e20b",))
    yield "xpu build, no driver", replace(no_devices(), notes=driver_note), host(intel_gpus=("8086:e20b",))
    yield "old bitsandbytes with xpu", machine_profile("arc-a770"), host(packages=old_bnb)
    yield "old bitsandbytes on cpu", machine_profile("cpu"), host(packages=old_bnb)
    yield "old transformers", machine_profile("cpu"), host(packages={"transformers": "4.57.1"})
    yield (
        "errors sort first",
        no_devices(ZE_AFFINITY_MASK="7"),
        host(packages=dict(healthy, **{"intel-extension-for-pytorch": "2.8.10"})),
    )
    yield (
        "mixed integrated and discrete",
        machine_profile("arc-b580"),
        host(intel_gpus=("8086:7d55", "8086:e20b"), intel_igpu_present=True),
    )
    yield "kernels rejected", machine_profile("h100"), host(kernels_accepted=False, kernels_reason=rejected)
    yield "kernels accepted", machine_profile("h100"), host(kernels_accepted=True)
    yield "hub unreachable", machine_profile("cpu"), host(hub_reachable=False, hub_reason="DNS failed")
    yield "hub offline", machine_profile("cpu"), host(hub_offline=True, hub_reachable=None)


def record_findings() -> dict[str, Any]:
    """Every doctor case's findings, in the order diagnose returns them."""
    from xpukit.doctor.checks import diagnose

    out: dict[str, Any] = {}
    for name, machine, host in doctor_cases():
        out[name] = [
            {"severity": f.severity, "code": f.code, "message": f.message, "fix": f.fix}
            for f in diagnose(machine, host)
        ]
    return {
        "about": "doctor's findings for every case of tests/planning/test_recorded_plans.py",
        "findings": out,
    }


# --- comparing -----------------------------------------------------------------------------------


def dumps(data: Any) -> str:
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def compare(path: Path, data: dict[str, Any]) -> None:
    """Write the copy (XPUKIT_RECORD=1) or fail with the entries that differ from it."""
    text = dumps(data)
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"{path} is missing: record it with XPUKIT_RECORD=1 (see the module docstring)"
    stored = path.read_text(encoding="utf-8")
    if stored == text:
        return
    old = json.loads(stored)
    changed: list[str] = []
    for section in sorted(set(old) | set(data)):
        a, b = old.get(section), data.get(section)
        if isinstance(a, dict) and isinstance(b, dict) and section != "environments":
            changed += [f"{section}: {k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(section)
    first = changed[0].split(": ", 1) if changed else []
    diff = ""
    if len(first) == 2:
        before, after = old.get(first[0], {}).get(first[1]), data.get(first[0], {}).get(first[1])
        diff = "".join(
            difflib.unified_diff(
                dumps(before).splitlines(True), dumps(after).splitlines(True), "stored", "now", n=2
            )
        )
    pytest.fail(
        f"{len(changed)} entries of {path.name} changed (first 20 below). If the change is meant, record "
        f"the copy again (XPUKIT_RECORD=1) in a commit of its own saying which decisions changed and why.\n"
        + "\n".join(changed[:20])
        + f"\n\n{changed[0] if changed else 'the file text'}:\n{diff}"
    )


def test_recorded_plans(tmp_path: Path) -> None:
    compare(PLANS, record_plans(tmp_path))


def test_recorded_doctor_findings() -> None:
    compare(FINDINGS, record_findings())
