"""Bad input always gets a clear answer and leaves nothing behind (docs/errors.md "Catalogue").

Every case of the catalogue, through the Python API and the CLI, must raise an ``XpukitError``
subclass (the CLI: exit 1, one line on stderr) whose message names what was asked, what was found
and the fix; ``os.environ`` must be unchanged afterwards; every ``torch.nn.Module`` created during
the call must be gone while the error is still held (a traceback that keeps a half-loaded model alive
is a leak); and for the cases that read weights, the process's RSS must be back within
``RSS_TOLERANCE`` of where it was.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import re
import shutil
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import (
    DeviceSelectionError,
    DeviceUnavailableError,
    InvalidRequestError,
    PlanError,
    RuntimeAlreadyInitializedError,
    XpukitError,
)

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
# Loads here use a ~50 MB model ("mid" below): a leaked copy would show as +50 MB.
RSS_TOLERANCE = 24 * MiB


@dataclass(frozen=True)
class Inputs:
    """The files the cases point at, built once per module."""

    tiny: Path  # the tiny Qwen3
    mid: Path  # a Qwen3 of ~50 MB (fp32): big enough for the RSS check
    no_config: Path
    bad_json: Path
    no_model_type: Path
    unknown_type: Path
    truncated: Path  # mid with model.safetensors cut in half
    truncated_header: Path  # mid with model.safetensors cut to 5 bytes
    gpt2_adapter: Path  # a LoRA adapter trained on the tiny GPT-2
    small_adapter: Path  # a LoRA adapter of the tiny Qwen3 (other shapes than mid)
    bad_value: Path  # the tiny Qwen3 with "hidden_size": "big" in its config.json
    no_weights: Path  # the tiny Qwen3's config.json and tokenizer, no weights


@dataclass(frozen=True)
class Case:
    """One bad input: the call, the error class, and fragments the message must contain."""

    id: str
    call: Callable[[Inputs], object]
    error: type[XpukitError]
    asked: str  # names what was asked
    found: str  # names what was found
    fix: str  # names the fix (or the valid choices)
    loads: bool = False  # reads weights: RSS is checked


def _sel(spec: Any, **kw: Any) -> Callable[[Inputs], object]:
    def call(_: Inputs) -> object:
        from xpukit import select_devices

        return select_devices(spec, **kw)

    return call


def _model(inputs: Inputs, name: str) -> Any:
    """A field of ``inputs``, a built-in reference shape, or the string itself (a path)."""
    from xpukit.planning.model.reference_models import REFERENCE_CONFIGS, reference_config

    if name in Inputs.__dataclass_fields__:
        return getattr(inputs, name)
    return reference_config(name) if name in REFERENCE_CONFIGS else name


def _plan(model: str = "qwen3-8b", **kw: Any) -> Callable[[Inputs], object]:
    def call(inputs: Inputs) -> object:
        from xpukit import plan_load

        return plan_load(_model(inputs, model), **kw)

    return call


def _load(model: str, *, adapter: str | None = None, **kw: Any) -> Callable[[Inputs], object]:
    def call(inputs: Inputs) -> object:
        from xpukit import load_for_xpu

        lora = {"lora": getattr(inputs, adapter)} if adapter else {}
        return load_for_xpu(_model(inputs, model), **kw, **lora)

    return call


def _merge(model: str, adapter: str | None, merge: Any = True, **kw: Any) -> Callable[[Inputs], object]:
    def call(inputs: Inputs) -> object:
        from xpukit import load_for_xpu

        lora = {"lora": getattr(inputs, adapter)} if adapter else {}
        return load_for_xpu(_model(inputs, model), merge=merge, **kw, **lora)

    return call


def _sel_facts(spec: str, profile: str, count: int = 1) -> Callable[[Inputs], object]:
    def call(_: Inputs) -> object:
        from xpukit import select_devices
        from xpukit.machine.profiles import machine_profile

        return select_devices(spec, facts=machine_profile(profile, count))

    return call


def _args(profile: str, **kw: Any) -> Callable[[Inputs], object]:
    def call(_: Inputs) -> object:
        from xpukit import training_args
        from xpukit.machine.profiles import device_profile

        return training_args(facts=device_profile(profile), output_dir="unused", **kw)

    return call


def _apply_after_init(inputs: Inputs) -> object:
    from xpukit import select_devices
    from xpukit.machine import probe

    selection = select_devices("1", backend="cuda")
    original = probe.runtime_initialized
    probe.runtime_initialized = lambda: True  # type: ignore[assignment]
    try:
        selection.apply()
    finally:
        probe.runtime_initialized = original  # type: ignore[assignment]
    return selection


CASES = [
    # --- device specs (select_devices) ----------------------------------------------------------
    Case("select-empty", _sel("", backend="xpu"), DeviceSelectionError, "''", "empty", "'0,2'"),
    Case(
        "select-negative", _sel("-1", backend="xpu"), DeviceSelectionError, "'-1'", "negative", "start at 0"
    ),
    Case(
        "select-open-range", _sel("0-", backend="xpu"), DeviceSelectionError, "'0-'", "cannot read", "Valid"
    ),
    Case(
        "select-falling-range", _sel("3-1", backend="xpu"), DeviceSelectionError, "3-1", "goes down", "'1-3'"
    ),
    Case("select-word", _sel("gpu0", backend="xpu"), DeviceSelectionError, "gpu0", "cannot read", "Valid"),
    Case("select-twice", _sel("0,0", backend="xpu"), DeviceSelectionError, "'0,0'", "listed twice", "once"),
    Case(
        "select-xpu-reorder",
        _sel("2,0", backend="xpu"),
        DeviceSelectionError,
        "2,0",
        "cannot reorder",
        "'0,2'",
    ),
    Case(
        "select-tile-in-flat",
        _sel("0.1", backend="xpu", hierarchy="flat"),
        DeviceSelectionError,
        "'0.1'",
        "FLAT mode",
        "COMPOSITE",
    ),
    Case(
        "select-all-and-more",
        _sel("all,0", backend="xpu"),
        DeviceSelectionError,
        "all,0",
        "cannot be",
        "'all'",
    ),
    Case("select-float", _sel(1.5, backend="xpu"), DeviceSelectionError, "1.5", "got float", "'0,2'"),
    Case(
        "select-comma-in-list", _sel([0, "1,2"], backend="xpu"), DeviceSelectionError, "'1,2'", "comma", "one"
    ),
    Case(
        "select-past-torch-max",
        _sel("99999999999999999999", backend="cuda"),
        DeviceSelectionError,
        "99999999999999999999",
        "past 127",
        "highest index",
    ),
    Case(
        "select-cuda-tile",
        _sel("0.1", backend="cuda"),
        DeviceSelectionError,
        "'0.1'",
        "no 'card.tile'",
        "MIG",
    ),
    Case("select-backend", _sel("0", backend="rocm"), DeviceSelectionError, "'rocm'", "cannot be", "'xpu'"),
    Case(
        "select-hierarchy",
        _sel("0", backend="xpu", hierarchy="weird"),
        DeviceSelectionError,
        "weird",
        "not a",
        "FLAT",
    ),
    Case(
        "select-hierarchy-on-cuda",
        _sel("0", backend="cuda", hierarchy="flat"),
        DeviceSelectionError,
        "'flat'",
        "Intel GPUs only",
        "drop it",
    ),
    Case(
        "select-facts-type",
        _sel("0", facts="arc-b580"),
        DeviceSelectionError,
        "facts",
        "got str",
        "MachineFacts",
    ),
    Case(
        "select-out-of-range",
        _sel_facts("4", "arc-b580", 2),
        DeviceSelectionError,
        "device 4",
        "2 xpu device(s)",
        "Valid indices: 0-1",
    ),
    Case(
        "select-no-accelerator",
        _sel_facts("0", "cpu"),
        DeviceSelectionError,
        "'0'",
        "no XPU or CUDA device",
        "backend='xpu'",
    ),
    Case(
        "apply-after-runtime-init",
        _apply_after_init,
        RuntimeAlreadyInitializedError,
        "CUDA_VISIBLE_DEVICES",
        "already initialised",
        "xpukit launch --devices 1",
    ),
    # --- plan_load: devices --------------------------------------------------------------------
    Case(
        "device-word",
        _plan(facts="h100", device="gpu"),
        InvalidRequestError,
        "'gpu'",
        "not a device",
        "'xpu:1'",
    ),
    Case(
        "device-negative",
        _plan(facts="h100", device="xpu:-1"),
        InvalidRequestError,
        "xpu:-1",
        "not a",
        "Valid",
    ),
    Case(
        "device-index-past",
        _plan(facts="arc-b580", device="xpu:3"),
        DeviceSelectionError,
        "xpu:3",
        "only 1",
        "Fix",
    ),
    Case(
        "device-other-backend",
        _plan(facts="max-1550", device="cuda"),
        DeviceUnavailableError,
        "device='cuda'",
        "no CUDA support",
        "pip install torch",
    ),
    Case(
        "device-xpu-on-cpu-torch",
        _plan("tiny", device="xpu"),
        DeviceUnavailableError,
        "device='xpu'",
        "no XPU support",
        "whl/xpu",
    ),
    Case(
        "load-xpu-plan-on-cpu-torch",
        _load("tiny", facts="arc-b580"),
        DeviceUnavailableError,
        "xpu:0",
        "no XPU support",
        "whl/xpu",
    ),
    Case(
        "facts-unknown",
        _plan(facts="no-such-gpu"),
        InvalidRequestError,
        "no-such-gpu",
        "not name",
        "arc-b580",
    ),
    Case(
        "facts-zero-count",
        _plan(facts="arc-b580x0"),
        InvalidRequestError,
        "arc-b580x0",
        "at least 1",
        "count",
    ),
    Case("facts-type", _plan(facts=42), InvalidRequestError, "facts=42", "must be", "MachineFacts"),
    # --- plan_load: values ---------------------------------------------------------------------
    Case(
        "dtype-int8",
        _plan(facts="h100", dtype="int8"),
        InvalidRequestError,
        "'int8'",
        "not a dtype",
        "quantize=",
    ),
    Case(
        "dtype-number",
        _plan(facts="h100", dtype=16),
        InvalidRequestError,
        "dtype=16",
        "not a dtype",
        "'bfloat16'",
    ),
    Case(
        "attn-unknown",
        _plan(facts="h100", attn="flash"),
        InvalidRequestError,
        "'flash'",
        "not an attention",
        "sdpa",
    ),
    Case(
        "attn-fa3-on-xpu",
        _plan(facts="max-1550", attn="flash_attention_3"),
        InvalidRequestError,
        "flash_attention_3",
        "Hopper/Blackwell only",
        "attn='sdpa'",
    ),
    Case(
        "quantize-3bit",
        _plan(facts="h100", quantize="3bit"),
        InvalidRequestError,
        "'3bit'",
        "not a known",
        "'4bit'",
    ),
    Case(
        "quantize-bool",
        _plan(facts="h100", quantize=True),
        InvalidRequestError,
        "True",
        "not understood",
        "'auto'",
    ),
    Case(
        "quantize-4bit-on-mps",
        _plan(facts="apple-m2", quantize="4bit"),
        InvalidRequestError,
        "quantize='4bit' on mps",
        "no MPS backend",
        "quantize=None",
    ),
    Case(
        "kernels-unknown",
        _plan(facts="h100", kernels="maybe"),
        InvalidRequestError,
        "'maybe'",
        "not understood",
        "False",
    ),
    Case("lora-int", _plan(facts="h100", lora=42), InvalidRequestError, "lora=42", "not understood", "True"),
    Case(
        "lora-unknown-key",
        _plan(facts="h100", lora={"rank": 8}),
        InvalidRequestError,
        "'rank'",
        "unknown keys",
        "lora_alpha",
    ),
    Case("lora-rank-zero", _plan(facts="h100", lora={"r": 0}), InvalidRequestError, "'r': 0", "rank", "16"),
    Case(
        "lora-rank-above-width",
        _plan("tiny", facts="cpu", lora={"r": 100000}),
        InvalidRequestError,
        "'r': 100000",
        "larger than the model's hidden size",
        "r <= ",
    ),
    Case(
        "lora-dropout",
        _plan(facts="h100", lora={"lora_dropout": 1.5}),
        InvalidRequestError,
        "1.5",
        "must be",
        "[0, 1)",
    ),
    Case(
        "lora-targets-match-nothing",
        _plan("tiny", facts="cpu", lora={"target_modules": ["query", "value"]}),
        InvalidRequestError,
        "query,value",
        "match no module",
        "all-linear",
    ),
    Case(
        "lora-adapter-missing",
        _plan(facts="h100", lora="/nonexistent/adapter"),
        InvalidRequestError,
        "/nonexistent/adapter",
        "no such directory",
        "snapshot_download",
    ),
    Case(
        "max-memory-key",
        _plan(facts="h100", max_memory={"gpu0": "1GiB"}),
        InvalidRequestError,
        "'gpu0'",
        "not a device",
        "'cpu'",
    ),
    Case(
        "max-memory-size",
        _plan(facts="h100", max_memory={0: "lots"}),
        InvalidRequestError,
        "'lots'",
        "not a size",
        "'10GiB'",
    ),
    Case(
        "max-memory-empty",
        _plan(facts="h100", max_memory={}),
        InvalidRequestError,
        "max_memory={}",
        "non-empty",
        "'10GiB'",
    ),
    Case(
        "max-memory-list",
        _plan(facts="h100", max_memory=["1GiB"]),
        InvalidRequestError,
        "['1GiB']",
        "must be",
        "'cpu'",
    ),
    Case(
        "max-memory-no-such-device",
        _plan(facts="h100", max_memory={3: "100GiB"}),
        InvalidRequestError,
        "key 3",
        "accelerators: cuda:0",
        "Valid keys here: 0, 'cpu', 'disk'",
    ),
    Case(
        "max-memory-negative",
        _plan(facts="h100", max_memory={0: -5}),
        InvalidRequestError,
        "-5",
        "not a size",
        "finite",
    ),
    Case(
        "headroom-negative",
        _plan(facts="h100", headroom="-1GiB"),
        InvalidRequestError,
        "'-1GiB'",
        "not a size",
        "'10GiB'",
    ),
    Case(
        "headroom-infinite",
        _plan(facts="h100", headroom=float("inf")),
        InvalidRequestError,
        "inf",
        "not a size",
        "finite",
    ),
    Case(
        "headroom-huge",
        _plan(facts="h100", headroom="5000TiB"),
        InvalidRequestError,
        "5000TiB",
        "more than 1 PiB",
        "'10GiB'",
    ),
    Case(
        "headroom-bool",
        _plan(facts="h100", headroom=True),
        InvalidRequestError,
        "True",
        "not a size",
        "'10GiB'",
    ),
    Case(
        "seed-not-int",
        _plan(facts="h100", lora=True, seed="7"),
        InvalidRequestError,
        "'7'",
        "not a seed",
        "seed=7",
    ),
    Case(
        "model-class-typo",
        _plan(facts="h100", model_class="AutoModelForCasualLM"),
        InvalidRequestError,
        "AutoModelForCasualLM",
        "not a transformers model class",
        "Did you mean 'AutoModelForCausalLM'",
    ),
    Case(
        "model-class-int",
        _plan(facts="h100", model_class=42),
        InvalidRequestError,
        "42",
        "no from_pretrained",
        "Pass",
    ),
    # --- conflicting keywords ------------------------------------------------------------------
    Case(
        "dtype-and-torch_dtype",
        _plan(facts="h100", dtype="bfloat16", torch_dtype="float16"),
        InvalidRequestError,
        "torch_dtype='float16'",
        "Both",
        "only dtype=",
    ),
    Case(
        "attn-and-attn_implementation",
        _plan(facts="h100", attn="sdpa", attn_implementation="eager"),
        InvalidRequestError,
        "attn_implementation='eager'",
        "Both",
        "only attn=",
    ),
    Case(
        "quantize-and-quantization_config",
        _plan(facts="h100", quantize="4bit", quantization_config={"load_in_4bit": True}),
        InvalidRequestError,
        "quantization_config=",
        "Both",
        "only quantize=",
    ),
    Case(
        "kernels-and-use_kernels",
        _plan(facts="h100", kernels=True, use_kernels=False),
        InvalidRequestError,
        "kernels=True",
        "Both",
        "only kernels=",
    ),
    Case(
        "load_in_4bit",
        _plan(facts="h100", load_in_4bit=True),
        InvalidRequestError,
        "load_in_4bit",
        "not a",
        "quantize='4bit'",
    ),
    Case(
        "device_map-contradicts-device",
        _plan(facts="h100", device="cpu", device_map="cuda:0"),
        InvalidRequestError,
        "device_map='cuda:0'",
        "disagree",
        "pass one",
    ),
    Case(
        "device_map-dict-contradicts-device",
        _plan(facts="h100", device="cpu", device_map={"": "cuda:0"}),
        InvalidRequestError,
        "device='cpu'",
        "every module on 'cuda:0'",
        "pass one",
    ),
    Case(
        "device_map-type",
        _plan(facts="h100", device_map=3.5),
        InvalidRequestError,
        "3.5",
        "must be",
        "'auto'",
    ),
    Case(
        "device_map-bad-device",
        _plan(facts="h100", device_map={"": "gpu"}),
        InvalidRequestError,
        "'gpu'",
        "not a device",
        "'xpu:0'",
    ),
    # --- the model -----------------------------------------------------------------------------
    Case(
        "path-missing",
        _plan("/nonexistent/model", facts="cpu"),
        InvalidRequestError,
        "/nonexistent/model",
        "does not exist",
        "Hub model id",
    ),
    Case(
        "path-without-config",
        _plan("no_config", facts="cpu"),
        InvalidRequestError,
        "no_config",
        "no config.json",
        "save_pretrained",
    ),
    Case(
        "config-not-json",
        _plan("bad_json", facts="cpu"),
        InvalidRequestError,
        "bad_json",
        "not valid JSON",
        "Fix",
    ),
    Case(
        "config-without-model_type",
        _plan("no_model_type", facts="cpu"),
        InvalidRequestError,
        "no_model_type",
        "no model_type",
        "Fix",
    ),
    Case(
        "config-unknown-model_type",
        _plan("unknown_type", facts="cpu"),
        InvalidRequestError,
        "'blorp'",
        "does not know",
        "pip install -U transformers",
    ),
    Case(
        "adapter-as-model",
        _plan("small_adapter", facts="cpu"),
        InvalidRequestError,
        "small_adapter",
        "is a LoRA adapter",
        "lora=",
    ),
    Case(
        "config-bad-value",
        _plan("bad_value", facts="cpu"),
        InvalidRequestError,
        "hidden_size",
        "refuses",
        "correct that value",
    ),
    Case(
        "weights-missing",
        _load("no_weights", device="cpu"),
        InvalidRequestError,
        "no_weights",
        "no weights",
        "save_pretrained",
    ),
    Case(
        "bare-config-load",
        _load("qwen3-0.6b", facts="cpu"),
        InvalidRequestError,
        "qwen3-0.6b",
        "no weights",
        "directory or Hub id",
    ),
    Case(
        "truncated-safetensors",
        _load("truncated", device="cpu"),
        InvalidRequestError,
        "truncated",
        "model.safetensors",
        "download the model again",
        loads=True,
    ),
    Case(
        "truncated-safetensors-header",
        _load("truncated_header", device="cpu"),
        InvalidRequestError,
        "truncated_header",
        "header too small",
        "save_pretrained",
        loads=True,
    ),
    Case(
        "adapter-of-another-architecture",
        _load("mid", device="cpu", adapter="gpt2_adapter"),
        InvalidRequestError,
        "gpt2_adapter",
        "no such module in the base",
        "pass the base it was trained on",
    ),
    Case(
        "adapter-of-another-size",
        _load("mid", device="cpu", adapter="small_adapter"),
        InvalidRequestError,
        "small_adapter",
        "tensors do not match the base's modules",
        "pass the base it was trained on",
    ),
    Case(
        "trainable-without-adapter",
        _plan(facts="h100", lora=True, trainable=True),
        InvalidRequestError,
        "trainable=True",
        "trainable already",
        "lora='path/to/adapter', trainable=True",
    ),
    # --- merge= (docs/merging.md "Merging an adapter") --------------------------------------------
    Case(
        "merge-without-adapter",
        _merge("tiny", None, device="cpu"),
        InvalidRequestError,
        "merge=True",
        "no lora= was given",
        "lora='path/to/adapter'",
    ),
    Case(
        "merge-into-4bit",
        _merge("tiny", "small_adapter", device="cpu", quantize="4bit"),
        InvalidRequestError,
        "quantize='4bit'",
        "never merges into quantized weights",
        "drop quantize=",
    ),
    Case(
        "merge-adapter-of-another-base",
        _merge("mid", "small_adapter", device="cpu"),
        InvalidRequestError,
        "small_adapter",
        "tensors do not match the base's modules",
        "pass the base it was trained on",
    ),
    Case(
        "merge-trainable",
        _merge("tiny", "small_adapter", device="cpu", trainable=True),
        InvalidRequestError,
        "trainable=True",
        "no adapter left to train",
        "drop merge=",
    ),
    Case(
        "merge-value",
        _merge("tiny", "small_adapter", merge="fp16", device="cpu"),
        InvalidRequestError,
        "merge='fp16'",
        "not understood",
        "'original'",
    ),
    Case(
        "fits-nowhere-without-offload",
        _plan(facts="arc-b580", offload=False),
        PlanError,
        "qwen3-8b",
        "usable",
        "offload=True",
    ),
    Case(
        "fits-nowhere-at-all",
        _plan("llama-3.1-70b", facts="arc-b580", offload=False),
        PlanError,
        "llama-3.1-70b",
        "131.42 GiB",
        "more memory or a smaller model",
    ),
    Case(
        "exceeds-given-max_memory",
        _plan(facts="h100", max_memory={0: "10GiB"}),
        PlanError,
        "qwen3-8b",
        "exceed the max_memory given",
        "quantize='4bit'",
    ),
    # --- training_args -------------------------------------------------------------------------
    Case(
        "train-bf16-and-fp16",
        _args("h100", bf16=True, fp16=True),
        InvalidRequestError,
        "fp16=True",
        "at most one",
        "drop one",
    ),
    Case(
        "train-fp16-without-fp64",
        _args("arc-a770", fp16=True),
        InvalidRequestError,
        "fp16=True",
        "fp64",
        "bf16=True",
    ),
    Case(
        "train-bf16-cpu-without-use_cpu",
        _args("cpu-bf16", bf16=True, use_cpu=False),
        InvalidRequestError,
        "use_cpu=False",
        "refuses bf16",
        "drop use_cpu=False",
    ),
    Case(
        "train-output-dir-twice",
        lambda _: __import__("xpukit").training_args("run-a", output_dir="run-b"),
        InvalidRequestError,
        "'run-a'",
        "output_dir= names another",
        "pass the model first",
    ),
    Case(
        "load-keyword-typo",
        _load("tiny", quantise="4bit"),
        InvalidRequestError,
        "quantise='4bit'",
        "neither xpukit's",
        "did you mean quantize?",
    ),
]

# argv, error fragments (asked, found, fix): each must exit 1 with one error line on stderr.
CLI_CASES = [
    ("plan-unknown-profile", ["plan", "qwen3-8b", "--assume", "nope"], ("'nope'", "not name", "arc-b580")),
    (
        "plan-max-memory-syntax",
        ["plan", "qwen3-8b", "--assume", "h100", "--max-memory", "0:1GiB"],
        ("0:1GiB", "use DEVICE=SIZE", "0=10GiB"),
    ),
    (
        "plan-dtype",
        ["plan", "qwen3-8b", "--assume", "h100", "--dtype", "int3"],
        ("'int3'", "not a dtype", "'bfloat16'"),
    ),
    (
        "plan-headroom",
        ["plan", "qwen3-8b", "--assume", "h100", "--headroom", "much"],
        ("'much'", "not a size", "'10GiB'"),
    ),
    (
        "plan-4bit-on-mps",
        ["plan", "qwen3-8b", "--assume", "apple-m2", "--quantize", "4bit"],
        ("4bit", "no MPS", "quantize=None"),
    ),
    (
        "plan-fa3-on-xpu",
        ["plan", "qwen3-8b", "--assume", "max-1550", "--attn", "flash_attention_3"],
        ("flash_attention_3", "Hopper", "sdpa"),
    ),
    (
        "plan-no-offload",
        ["plan", "qwen3-8b", "--assume", "arc-b580", "--no-offload"],
        ("qwen3-8b", "usable", "offload=True"),
    ),
    (
        "plan-rank",
        ["plan", "qwen3-8b", "--assume", "arc-b580", "--rank", "0/0"],
        ("'0/0'", "W >= 1", "e.g. 1/2"),
    ),
    (
        "plan-train-syntax",
        ["plan", "qwen3-8b", "--assume", "arc-b580", "--train", "4x"],
        ("'4x'", "BATCHxSEQ", "4x512"),
    ),
    (
        "plan-missing-path",
        ["plan", "/nonexistent/dir"],
        ("/nonexistent/dir", "does not exist", "Hub model id"),
    ),
    (
        "launch-twice",
        ["launch", "--devices", "0,0", "--backend", "xpu", "--", "true"],
        ("'0,0'", "twice", "once"),
    ),
    (
        "launch-no-command",
        ["launch", "--devices", "0", "--backend", "xpu"],
        ("command", "no command", "Usage"),
    ),
    (
        "launch-json-without-dry-run",
        ["launch", "--json", "--devices", "0", "--backend", "xpu", "--", "true"],
        ("--json", "without running", "--dry-run"),
    ),
    (
        "launch-no-device",
        ["launch", "--devices", "0", "--", "true"],
        ("'0'", "no XPU or CUDA", "--backend xpu"),
    ),
    (
        "launch-backend",
        ["launch", "--devices", "0", "--backend", "npu", "--", "true"],
        ("'npu'", "cannot be", "'cuda'"),
    ),
    ("demo-xpu-on-cpu-torch", ["demo", "--device", "xpu"], ("device='xpu'", "no XPU support", "whl/xpu")),
    ("demo-device-word", ["demo", "--device", "gpu"], ("'gpu'", "not a device", "'cpu'")),
    (
        "demo-missing-model",
        ["demo", "--model", "/nonexistent/model"],
        ("/nonexistent/model", "does not exist", "Hub"),
    ),
    ("demo-steps", ["demo", "--steps", "0"], ("steps=0", "whole number", "at least 1")),
    ("demo-batch-size", ["demo", "--batch-size", "0"], ("batch_size=0", "whole number", "at least 1")),
    ("demo-learning-rate", ["demo", "--lr", "-1"], ("-1.0", "between 0 and 1", "1e-4")),
    (
        "merge-dtype",
        ["merge", "/nonexistent/base", "/nonexistent/adapter", "/nonexistent/out", "--dtype", "int8"],
        ("'int8'", "not a dtype a merged checkpoint is written in", "bfloat16"),
    ),
    (
        "merge-missing-base",
        ["merge", "/nonexistent/base", "/nonexistent/adapter", "/nonexistent/out"],
        ("/nonexistent/base", "does not exist", "Hub model id"),
    ),
    (
        "export-k-quant",
        ["export", "/nonexistent/model", "/nonexistent/out", "--gguf", "--type", "q4_k_m"],
        ("'q4_k_m'", "gguf package cannot write", "llama-quantize"),
    ),
    (
        "export-type",
        ["export", "/nonexistent/model", "/nonexistent/out", "--gguf", "--type", "int4"],
        ("'int4'", "not a GGUF type", "bf16, f16, q8_0, q4_0"),
    ),
    (
        "export-missing-source",
        ["export", "/nonexistent/model", "/nonexistent/out", "--gguf"],
        ("/nonexistent/model", "does not exist", "Hub model id"),
    ),
]

# Run as real processes too: the installed entry point's exit code and stderr.
SUBPROCESS_CASES = ("launch-twice", "launch-no-command", "plan-missing-path")


# --- inputs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(
    tiny_model: Path, tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Inputs:
    from xpukit import load_for_xpu

    root = tmp_path_factory.mktemp("bad-input")
    mid = tiny_model_factory("qwen3", hidden_size=512, intermediate_size=2048, num_hidden_layers=4)
    (root / "no_config").mkdir()
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text("{not json")
    (root / "no_model_type").mkdir()
    (root / "no_model_type" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (root / "unknown_type").mkdir()
    (root / "unknown_type" / "config.json").write_text(json.dumps({"model_type": "blorp", "hidden_size": 8}))
    weights = (mid / "model.safetensors").read_bytes()
    for name, cut in (("truncated", len(weights) // 2), ("truncated_header", 5)):
        shutil.copytree(mid, root / name)
        (root / name / "model.safetensors").write_bytes(weights[:cut])
    for name, base in (("gpt2_adapter", tiny_model_factory("gpt2")), ("small_adapter", tiny_model)):
        load_for_xpu(base, device="cpu", lora=True).save_pretrained(root / name)
    shutil.copytree(tiny_model, root / "bad_value")
    config = json.loads((root / "bad_value" / "config.json").read_text())
    (root / "bad_value" / "config.json").write_text(json.dumps(config | {"hidden_size": "big"}))
    (root / "no_weights").mkdir()
    for file in tiny_model.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, root / "no_weights" / file.name)
    gc.collect()
    return Inputs(
        tiny=tiny_model,
        mid=mid,
        no_config=root / "no_config",
        bad_json=root / "bad_json",
        no_model_type=root / "no_model_type",
        unknown_type=root / "unknown_type",
        truncated=root / "truncated",
        truncated_header=root / "truncated_header",
        gpt2_adapter=root / "gpt2_adapter",
        small_adapter=root / "small_adapter",
        bad_value=root / "bad_value",
        no_weights=root / "no_weights",
    )


@pytest.fixture(scope="module")
def warmed(inputs: Inputs) -> Iterator[Inputs]:
    """Good loads of the mid model first (imports and allocator pools are not leaks), then every
    object alive is frozen out of the collector, so each case's ``gc.collect()`` scans only its own."""
    from xpukit import load_for_xpu

    for _ in range(2):
        model = load_for_xpu(inputs.mid, device="cpu", lora=True)
        del model
        gc.collect()
    gc.freeze()
    yield inputs
    gc.unfreeze()


@contextlib.contextmanager
def _modules_created() -> Iterator[list[weakref.ref[Any]]]:
    """Weak references to every ``torch.nn.Module`` built inside the block."""
    import torch

    created: list[weakref.ref[Any]] = []
    original = torch.nn.Module.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        created.append(weakref.ref(self))

    torch.nn.Module.__init__ = init  # type: ignore[method-assign]
    try:
        yield created
    finally:
        torch.nn.Module.__init__ = original  # type: ignore[method-assign]


def _alive(created: list[weakref.ref[Any]]) -> list[Any]:
    gc.collect()
    return [m for ref in created if (m := ref()) is not None]


def _models(created: list[weakref.ref[Any]]) -> list[str]:
    """The models (transformers or peft) among the modules still alive."""
    from transformers import PreTrainedModel

    return [
        type(m).__name__
        for m in _alive(created)
        if isinstance(m, PreTrainedModel) or hasattr(m, "peft_config")
    ]


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _says(message: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment.lower() in message.lower(), f"{fragment!r} not in: {message}"


# --- the catalogue -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_python_api_case(case: Case, warmed: Inputs) -> None:
    env = dict(os.environ)
    before = _rss()
    with _modules_created() as created, pytest.raises(XpukitError) as info:
        case.call(warmed)
    error = info.value
    assert type(error) is case.error, f"{type(error).__name__}: {error}"
    _says(str(error), case.asked, case.found, case.fix)
    assert dict(os.environ) == env
    del error
    # No model survives while the error is held; and no module at all is kept alive by the error
    # (its traceback's frames). A module that outlives the error too is a library's import-time
    # singleton (an activation object), built here only because this call first imported it.
    assert not _models(created), f"models alive while the error is held: {_models(created)}"
    held = [(ref, type(ref()).__name__) for ref in created if ref() is not None]
    del info
    gc.collect()
    kept = sorted({name for ref, name in held if ref() is None})
    assert not kept, f"modules kept alive by the error until it was dropped: {kept[:8]}"
    if case.loads:
        grown = _rss() - before
        assert grown < RSS_TOLERANCE, f"RSS grew {grown / MiB:.1f} MiB"


@pytest.mark.parametrize(("name", "argv", "says"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_case(name: str, argv: list[str], says: tuple[str, ...], inputs: Inputs) -> None:
    from xpukit.cli.main import main

    env = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    with _modules_created() as created, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 1, (out.getvalue()[-500:], err.getvalue()[-500:])
    message = err.getvalue()
    assert message.startswith(f"xpukit {argv[0]}: error: ") and "Traceback" not in message
    _says(message, *says)
    assert dict(os.environ) == env
    from transformers import PreTrainedModel

    assert not [m for m in _alive(created) if isinstance(m, PreTrainedModel)]


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_cli_case_in_a_process(name: str) -> None:
    argv, says = next((a, s) for n, a, s in CLI_CASES if n == name)
    proc = subprocess.run(
        [sys.executable, "-m", "xpukit.cli.main", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and not proc.stdout, proc
    assert proc.stderr.startswith(f"xpukit {argv[0]}: error: ") and "Traceback" not in proc.stderr
    _says(proc.stderr, *says)


def test_bf16_where_only_emulated_warns_and_is_kept() -> None:
    """The one case that warns instead: bf16 asked on a GPU that only emulates it (docs/errors.md)."""
    from xpukit import plan_load
    from xpukit.planning.model.reference_models import reference_config

    plan = plan_load(reference_config("qwen3-0.6b"), facts="meteor-lake", dtype="bfloat16")
    assert plan.dtype == "bfloat16" and plan.decision("dtype").source == "user"
    assert any("only emulated" in w and "float16 is native" in w for w in plan.warnings)


def test_the_catalogue_is_big_enough_and_documented() -> None:
    ids = [c.id for c in CASES] + [name for name, _, _ in CLI_CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 60
    table = (ROOT / "docs" / "errors.md").read_text()
    listed = set(re.findall(r"^\| `([\w-]+)` \|", table, re.M))
    assert set(ids) <= listed, sorted(set(ids) - listed)
    assert "bf16-emulated" in listed
