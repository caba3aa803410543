"""training_args: the keyword rules per device (recorded profiles), real TrainingArguments on this CPU,
and a real QLoRA Trainer run whose loss falls."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.machine.profiles import device_profile, machine_profile
from xpukit.training.arguments import training_args
from xpukit.training.keywords import TrainingContext, training_kwargs

# ---------------------------------------------------------------------------------------------
# training_kwargs: pure, over recorded device profiles
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "bf16", "fp16", "use_cpu"),
    [
        ("max-1550", True, False, None),
        ("arc-a770", True, False, None),  # Alchemist has native bf16 (XMX); only fp16 is out (no fp64)
        ("meteor-lake", False, True, None),  # bf16 only emulated; fp64 present, so fp16 + GradScaler
        ("lunar-lake", True, False, None),
        ("h100", True, False, None),
        ("t4", False, True, None),  # compute capability 7.5
        ("apple-m2", False, False, None),
        ("cpu", False, False, True),
        ("cpu-bf16", True, False, True),
    ],
)
def test_precision_and_cpu_per_profile(profile: str, bf16: bool, fp16: bool, use_cpu: bool | None) -> None:
    kw = training_kwargs(device_profile(profile), output_dir="out")
    assert (kw["bf16"], kw["fp16"], kw.get("use_cpu")) == (bf16, fp16, use_cpu)
    assert kw["report_to"] == "none" and kw["output_dir"] == "out"
    assert "ddp_backend" not in kw  # single process: setting it crashes TrainingArguments
    assert kw["optim"] == "adamw_torch"


def test_no_bf16_no_fp64_trains_in_fp32() -> None:
    # An Alchemist-like GPU without native bf16 must not get fp16: its GradScaler needs fp64.
    no_bf16 = replace(device_profile("arc-a770"), native_bf16=False)
    kw = training_kwargs(no_bf16)
    assert kw["bf16"] is False and kw["fp16"] is False


@pytest.mark.parametrize(
    ("profile", "torch_version", "backend"),
    [
        ("max-1550", "2.8.0+xpu", "xccl"),
        ("arc-b580", "2.13.0", "xccl"),
        ("max-1550", "2.7.1+xpu", None),  # no xccl before torch 2.8: left to accelerate
        ("h100", "2.13.0", "nccl"),
        ("cpu", "2.13.0", "gloo"),
        ("apple-m2", "2.13.0", "gloo"),
    ],
)
def test_ddp_backend_only_when_distributed(profile: str, torch_version: str, backend: str | None) -> None:
    device = device_profile(profile)
    single = training_kwargs(device, context=TrainingContext(world_size=1, torch_version=torch_version))
    assert "ddp_backend" not in single
    multi = training_kwargs(device, context=TrainingContext(world_size=2, torch_version=torch_version))
    assert multi.get("ddp_backend") == backend


@pytest.mark.parametrize(
    ("profile", "bnb", "optim"),
    [
        ("h100", "0.48.0", "paged_adamw_8bit"),
        ("h100", None, "adamw_torch"),
        ("max-1550", "0.50.2", "paged_adamw_8bit"),
        ("max-1550", "0.49.1", "adamw_torch"),  # paged optimizers on XPU from bitsandbytes 0.50
        ("cpu-bf16", "0.50.2", "adamw_torch"),  # never on CPU/MPS
        ("apple-m2", "0.50.2", "adamw_torch"),
    ],
)
def test_optimizer_for_quantised_models_under_memory_pressure(
    profile: str, bnb: str | None, optim: str
) -> None:
    """Checkpointing and no plan that fits (a model xpukit did not load): the paged 8-bit optimizer
    saves its few hundred MB."""
    ctx = TrainingContext(quantized=True, bitsandbytes_version=bnb, gradient_checkpointing=True)
    assert training_kwargs(device_profile(profile), context=ctx)["optim"] == optim
    not_quantised = TrainingContext(quantized=False, bitsandbytes_version=bnb)
    assert training_kwargs(device_profile(profile), context=not_quantised)["optim"] == "adamw_torch"


@pytest.mark.parametrize(
    ("profile", "optim"),
    [("h100", "adamw_torch_fused"), ("max-1550", "adamw_torch_fused"), ("cpu-bf16", "adamw_torch")],
)
def test_a_quantised_model_with_room_takes_the_fused_adamw(profile: str, optim: str) -> None:
    ctx = TrainingContext(quantized=True, bitsandbytes_version="0.50.2", gradient_checkpointing=False)
    assert training_kwargs(device_profile(profile), context=ctx)["optim"] == optim


def test_gradient_checkpointing_is_non_reentrant() -> None:
    from_model = training_kwargs(device_profile("h100"), context=TrainingContext(gradient_checkpointing=True))
    assert from_model["gradient_checkpointing"] is True
    assert from_model["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    from_user = training_kwargs(device_profile("h100"), gradient_checkpointing=True)
    assert from_user["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    theirs = training_kwargs(
        device_profile("h100"),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )
    assert theirs["gradient_checkpointing_kwargs"] == {"use_reentrant": True}
    assert "gradient_checkpointing_kwargs" not in training_kwargs(device_profile("h100"))


def test_user_keywords_win() -> None:
    kw = training_kwargs(
        device_profile("h100"),
        context=TrainingContext(quantized=True, bitsandbytes_version="0.50.2", world_size=4),
        optim="adamw_torch_fused",
        report_to="wandb",
        ddp_backend="gloo",
        learning_rate=1e-4,
    )
    assert (kw["optim"], kw["report_to"], kw["ddp_backend"], kw["learning_rate"]) == (
        "adamw_torch_fused",
        "wandb",
        "gloo",
        1e-4,
    )
    # A mixed precision named by the user replaces xpukit's choice instead of joining it.
    fp16 = training_kwargs(device_profile("h100"), fp16=True)
    assert fp16["fp16"] is True and fp16["bf16"] is False
    bf16 = training_kwargs(device_profile("t4"), bf16=True)  # emulated there: allowed with a warning
    assert bf16["bf16"] is True and bf16["fp16"] is False


def test_impossible_combinations_are_refused_with_the_fix() -> None:
    with pytest.raises(InvalidRequestError, match="at most one mixed precision"):
        training_kwargs(device_profile("h100"), bf16=True, fp16=True)
    with pytest.raises(InvalidRequestError, match=r"fp64.*Fix: drop fp16=True \(xpukit picks bfloat16\)"):
        training_kwargs(device_profile("arc-a770"), fp16=True)
    with pytest.raises(InvalidRequestError, match="Fix: drop use_cpu=False"):
        training_kwargs(device_profile("cpu-bf16"), bf16=True, use_cpu=False)
    # use_cpu=False alone on a CPU: xpukit drops its own bf16 rather than let transformers raise.
    kw = training_kwargs(device_profile("cpu-bf16"), use_cpu=False)
    assert kw["use_cpu"] is False and kw["bf16"] is False


def test_device_from_the_models_plan() -> None:
    from xpukit.training.arguments import _training_device

    plan_device = device_profile("max-1550")
    model = SimpleNamespace(xpukit_plan=SimpleNamespace(device=plan_device, dtype="bfloat16"))
    assert _training_device(model, None, use_cpu=False) is plan_device
    cpu = _training_device(model, machine_profile("max-1550"), use_cpu=True)
    assert cpu.backend == "cpu"


def test_device_missing_from_facts_is_refused() -> None:
    import torch

    from xpukit.training.arguments import _training_device

    class OnCuda(torch.nn.Module):
        def parameters(self, recurse: bool = True) -> Any:
            yield torch.empty(1, device="meta")  # meta tensors are skipped
            yield SimpleNamespace(device=torch.device("cuda", 1))

    with pytest.raises(InvalidRequestError, match=r"on cuda:1.*found: cuda:0"):
        _training_device(OnCuda(), machine_profile("h100"), use_cpu=False)


@pytest.mark.parametrize(
    ("profile", "dtype", "bf16", "fp16"),
    [
        ("arc-a770", "float16", False, False),  # 4-bit computes fp16 (bnb < 0.50); no fp64: fp32
        ("h100", "float16", False, True),  # dtype="float16" on an H100: fp16, not bf16 autocast
        ("meteor-lake", "float16", False, True),  # fp64 present: fp16 + GradScaler
        ("apple-m2", "float16", False, False),  # no fp64 on MPS
        ("h100", "float32", False, False),
        ("cpu-bf16", "float32", False, False),
        ("t4", "bfloat16", True, False),  # asked for at load: emulated there, but what the model computes in
        ("max-1550", "torch.bfloat16", True, False),
    ],
)
def test_precision_follows_the_load_dtype(profile: str, dtype: str, bf16: bool, fp16: bool) -> None:
    kw = training_kwargs(device_profile(profile), context=TrainingContext(compute_dtype=dtype))
    assert (kw["bf16"], kw["fp16"]) == (bf16, fp16)


def test_load_dtype_comes_from_the_plan_and_user_keywords_still_win() -> None:
    from xpukit.training.arguments import _context

    arc = device_profile("arc-a770")
    model = SimpleNamespace(xpukit_plan=SimpleNamespace(device=arc, dtype="float16"))
    context = _context(model, None)
    assert context.compute_dtype == "float16"
    kw = training_kwargs(arc, context=context)
    assert kw["bf16"] is False and kw["fp16"] is False  # not the bf16 the Arc A770 would get unloaded
    h100 = TrainingContext(compute_dtype="float16")
    assert training_kwargs(device_profile("h100"), context=h100, bf16=True)["fp16"] is False
    with pytest.raises(InvalidRequestError, match=r"xpukit picks float32"):
        training_kwargs(arc, context=context, fp16=True)  # still no GradScaler without fp64
    assert _context(SimpleNamespace(), None).compute_dtype is None  # not loaded by xpukit


def test_real_training_args_follow_the_plans_dtype(tmp_path: Path) -> None:
    # An AMX CPU would train in bf16; a model loaded there in float32 must not get bf16 autocast.
    model = SimpleNamespace(xpukit_plan=SimpleNamespace(device=device_profile("cpu-bf16"), dtype="float32"))
    args = training_args(model, output_dir=str(tmp_path))
    assert args.bf16 is False and args.fp16 is False and args.use_cpu is True


@pytest.mark.parametrize("backend_profile", ["max-1550", "h100"])
def test_a_card_other_than_0_is_refused_in_a_single_process(
    backend_profile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    second = replace(device_profile(backend_profile), index=1)
    fix = r"xpukit launch --devices 1 -- python train\.py"
    with pytest.raises(InvalidRequestError, match=rf"on {second.backend}:1.*{fix}"):
        training_kwargs(second, context=TrainingContext(world_size=1))
    # Distributed: each rank has its own card, so another index is fine.
    assert "ddp_backend" in training_kwargs(
        second, context=TrainingContext(world_size=2, torch_version="2.13.0")
    )
    # Through training_args: the plan's device, and the parameters' device, both count.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    planned = SimpleNamespace(xpukit_plan=SimpleNamespace(device=second, dtype="bfloat16"))
    with pytest.raises(InvalidRequestError, match=fix):
        training_args(planned, output_dir="out")
    monkeypatch.setenv("WORLD_SIZE", "1")

    class OnCard1:
        def parameters(self) -> Any:
            import torch

            yield SimpleNamespace(device=torch.device(second.backend, 1))

    machine = machine_profile(backend_profile, 2)
    with pytest.raises(InvalidRequestError, match=fix):
        training_args(OnCard1(), facts=machine, output_dir="out")
    # Device 0 of the same machine is accepted by the rule.
    assert training_kwargs(machine.devices[0], context=TrainingContext())["report_to"] == "none"


# ---------------------------------------------------------------------------------------------
# Real TrainingArguments on this CPU
# ---------------------------------------------------------------------------------------------


def test_real_training_args_on_this_machine(tmp_path: Path) -> None:
    from xpukit.machine.precision import training_precision
    from xpukit.machine.probe import detect

    facts = detect()
    device = facts.devices[0] if facts.devices else facts.cpu  # here: the CPU
    args = training_args(output_dir=str(tmp_path))  # no model, no facts: detected
    want = training_precision(device)
    assert (args.bf16, args.fp16) == (want.bf16, want.fp16)
    assert args.use_cpu is (device.backend == "cpu") and args.device.type == device.backend
    assert args.ddp_backend is None and args.report_to == []


@pytest.mark.parametrize(("profile", "bf16"), [("cpu-bf16", True), ("cpu", False)])
def test_real_training_args_for_cpu_profiles(tmp_path: Path, profile: str, bf16: bool) -> None:
    args = training_args(
        facts=machine_profile(profile), output_dir=str(tmp_path), per_device_train_batch_size=2
    )
    assert args.use_cpu is True and args.bf16 is bf16 and args.per_device_train_batch_size == 2


def test_user_bf16_on_a_cpu_without_use_cpu_gets_it_added(tmp_path: Path) -> None:
    # transformers alone raises "Your setup doesn't support bf16/gpu" here.
    args = training_args(facts=machine_profile("cpu"), output_dir=str(tmp_path), bf16=True)
    assert args.bf16 is True and args.use_cpu is True


def test_a_string_first_is_the_output_directory_never_dropped(tmp_path: Path) -> None:
    # As TrainingArguments("out") takes it; before, the string was taken as the model and dropped.
    out = str(tmp_path / "my-run-dir")
    args = training_args(out, facts=machine_profile("cpu"), max_steps=5)
    assert args.output_dir == out and args.max_steps == 5 and args.use_cpu is True
    assert training_args(tmp_path, facts=machine_profile("cpu")).output_dir == str(tmp_path)
    with pytest.raises(InvalidRequestError, match=r"output_dir= names another\. Fix: pass the model first"):
        training_args(out, facts=machine_profile("cpu"), output_dir="other")


# ---------------------------------------------------------------------------------------------
# A real QLoRA run: 4-bit + LoRA + Trainer with training_args, loss falls
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_qlora_trainer_loss_falls(tiny_model: Path, tmp_path: Path, train_losses: Any) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        BitsAndBytesConfig,
    )

    from xpukit.demo.tiny import corpus_lines
    from xpukit.loading.lora import apply_lora
    from xpukit.machine.probe import cpu_facts
    from xpukit.planning.training.lora_request import resolve_lora

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=bnb, dtype=torch.bfloat16, device_map="cpu"
    )
    request = resolve_lora(True, quantized=True)
    assert request is not None
    model, _ = apply_lora(model, request, compute_dtype="bfloat16", quantized=True, device=cpu_facts())

    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = [tok(line, truncation=True, max_length=32) for line in corpus_lines()]
    args = training_args(
        model,
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=12,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    assert args.use_cpu and args.gradient_checkpointing  # the model has it on: the args say so
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.optim == "adamw_torch"  # no paged optimizers on CPU
    losses = train_losses(model, args, tok, data)
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.2, losses


def test_repacked_4bit_weights_of_a_users_peft_model_are_restored(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/known-issues.md "bitsandbytes: CPU repacking of 4-bit weights": the user's own get_peft_model,
    then generate() on a 4-bit CPU model, repacks
    the weights into a layout without backward; training_args must give the layout back."""
    import logging

    import bitsandbytes as bnb
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from xpukit.demo.tiny import corpus_lines

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    base = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
    )
    layers = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not all(getattr(m, "support_avx512bf16_for_cpu", False) for m in layers):
        pytest.skip("bitsandbytes repacks only on CPUs with avx512_bf16; this one has none")
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(base, config)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    batch = dict(tok(corpus_lines()[:4], return_tensors="pt", padding=True, max_length=24, truncation=True))
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.eval()
    model.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=2, do_sample=False)

    def repacked() -> int:
        return sum(bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False)) for m in layers)

    assert repacked() == len(layers) > 0, "generate() should have repacked the 4-bit layers"

    with caplog.at_level(logging.WARNING, logger="xpukit.training.arguments"):
        training_args(model, output_dir=str(tmp_path))
    assert repacked() == 0
    assert not any(m.support_avx512bf16_for_cpu for m in layers)  # evaluation cannot repack again
    assert any(
        "repacked by bitsandbytes" in r.getMessage() and "apply_lora" in r.getMessage()
        for r in caplog.records
    )

    model.train()
    model(**batch).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}
    zero = [n for n, g in grads.items() if g is None or not g.abs().sum() > 0]
    assert len(grads) == len(layers) and not zero, f"zero LoRA gradients: {zero}"


@pytest.mark.gpu
def test_qlora_trainer_on_the_gpu(tiny_model: Path, tmp_path: Path, train_losses: Any) -> None:
    """On CUDA/XPU: bf16 (or fp16) from the device, the paged 8-bit optimizer, a few real steps."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        BitsAndBytesConfig,
    )

    from xpukit.demo.tiny import corpus_lines
    from xpukit.loading.lora import apply_lora
    from xpukit.machine.precision import training_precision
    from xpukit.machine.probe import detect
    from xpukit.planning.training.lora_request import resolve_lora

    facts = detect()
    device = facts.devices[0]
    want = training_precision(device)
    dtype = getattr(torch, want.name)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=bnb, dtype=dtype, device_map=device.torch_device
    )
    request = resolve_lora(True, quantized=True)
    assert request is not None
    model, _ = apply_lora(model, request, compute_dtype=want.name, quantized=True, device=device)
    args = training_args(
        model,
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=8,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    assert (args.bf16, args.fp16, args.use_cpu) == (want.bf16, want.fp16, False)
    assert args.optim == "paged_adamw_8bit" and args.device.type == device.backend
    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = [tok(line, truncation=True, max_length=32) for line in corpus_lines()]
    losses = train_losses(model, args, tok, data)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


@pytest.mark.parametrize(
    ("profile", "flag", "slow"),
    [
        ("cpu", "bf16", True),  # no avx512_bf16/AMX: emulated
        ("cpu-bf16", "bf16", False),
        ("cpu-bf16", "fp16", False),  # Sapphire Rapids computes fp16 (AVX512-FP16), as doctor says
        ("cpu", "fp16", True),  # no AVX512-FP16/AMX-FP16: emulated
        ("t4", "bf16", True),
        ("h100", "bf16", False),
        ("t4", "fp16", False),
    ],
)
def test_a_slow_precision_warns_as_load_for_xpu_does(
    profile: str, flag: str, slow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from xpukit.planning.device.choice import decide_dtype

    device = device_profile(profile)
    with caplog.at_level(logging.WARNING, logger="xpukit.training.keywords"):
        training_kwargs(device, **{flag: True})
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    _, load_said = decide_dtype({"bf16": "bfloat16", "fp16": "float16"}[flag], device)
    assert bool(said) == slow == bool(load_said)
    if slow:
        assert said == [f"training_args({flag}=True): {load_said[0].removeprefix('dtype=')}"]
        assert "only emulated (slow)" in said[0]


@pytest.mark.parametrize(
    "keywords",
    [
        {"per_device_train_batch_size": -1},
        {"per_device_train_batch_size": 0},
        {"per_device_train_batch_size": 2.5},
        {"gradient_accumulation_steps": 0},
    ],
)
def test_a_batch_size_that_is_not_positive_is_refused_before_output_dir(
    keywords: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(InvalidRequestError, match=r"not a positive int.*Fix"):
        training_args(facts=device_profile("cpu"), output_dir=str(out), **keywords)
    assert not out.exists()


def test_a_quantized_model_loaded_to_run_is_refused_with_the_qlora_fix(tmp_path: Path) -> None:
    """A model with quantized weights and no adapters (loaded to run) cannot be fine-tuned: refused in
    training_args, before output_dir is made; with adapters it passes."""
    out = tmp_path / "out"
    linear = SimpleNamespace(requires_grad=True)
    quantized = SimpleNamespace(is_quantized=True, quantization_method="torchao", parameters=lambda: [linear])
    with pytest.raises(InvalidRequestError, match=r"torchao weights and no adapters.*lora=True"):
        training_args(quantized, facts=device_profile("cpu"), output_dir=str(out))
    assert not out.exists()
    adapters = SimpleNamespace(**vars(quantized), peft_config={"default": None})
    args = training_args(adapters, facts=device_profile("cpu"), output_dir=str(out))
    assert args.output_dir == str(out)


def test_a_real_int4_load_to_run_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    from xpukit import load_for_xpu

    model = load_for_xpu(tiny_model, device="cpu", quantize="4bit")
    out = tmp_path / "out"
    with pytest.raises(InvalidRequestError, match=r"no adapters.*lora=True"):
        training_args(model, output_dir=str(out), max_steps=1)
    assert not out.exists()


@pytest.mark.parametrize(
    ("profile", "keywords", "expected"),
    [
        ("h100", {}, False),  # a GPU in bf16: the per-step wait goes
        ("max-1550", {}, False),
        ("t4", {}, None),  # fp16 with GradScaler: it waits each step anyway, transformers' default kept
        ("h100", {"fp16": True}, None),
        ("cpu-bf16", {}, None),  # the CPU runs synchronously
        ("h100", {"logging_nan_inf_filter": True}, True),  # the user's value wins
    ],
)
def test_the_loss_filter_is_off_on_a_gpu_without_gradscaler(
    profile: str, keywords: dict[str, Any], expected: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="xpukit.training.keywords"):
        kw = training_kwargs(device_profile(profile), **keywords)
    assert kw.get("logging_nan_inf_filter") is expected
    if expected is False:
        assert "logging_nan_inf_filter=False" in caplog.text and "Why the loss filter is off" in caplog.text
