"""TRL's configs from ``training_args(..., config_class=...)``: xpukit's decisions inside TRL's classes.

TRL's configs default to ``bf16=not fp16`` (on): built as TRL's docs teach on a CPU-only machine
they raise ``Your setup doesn't support bf16/gpu``. Built by xpukit they carry its precision
decision explicitly. Recorded XPU profiles check the keywords without the hardware.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit import load_for_xpu, training_args
from xpukit.errors import InvalidRequestError
from xpukit.machine.profiles import device_profile
from xpukit.training.config_class import config_kwargs

trl = pytest.importorskip("trl")

NATIVE = {"native-bf16": True, "no-bf16": False}
# A keyword of each config's own (not a TrainingArguments field), to see it pass through.
OWN = {"SFTConfig": "max_length", "DPOConfig": "max_length", "GRPOConfig": "max_completion_length"}


@pytest.mark.slow
def test_sft_trainer_trains_4bit_lora_with_an_sft_config_from_xpukit(
    tiny_model: Path, cpu_kind: str, tmp_path: Path
) -> None:
    pytest.importorskip("bitsandbytes")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = load_for_xpu(tiny_model, device="cpu", quantize="4bit", lora=True)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    args = training_args(
        model,
        config_class=SFTConfig,
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=32,
    )
    assert type(args) is SFTConfig
    assert (args.bf16, args.fp16, args.use_cpu) == (NATIVE[cpu_kind], False, True)
    assert args.max_length == 32 and args.report_to == []  # TRL's own keyword, and xpukit's "none"
    # SFTConfig turns gradient checkpointing on by default; the plan's choice wins (the tiny model
    # fits without it), and when it is on xpukit's rule makes it non-reentrant.
    assert args.gradient_checkpointing is bool(model.xpukit_plan.training.gradient_checkpointing)
    if args.gradient_checkpointing:
        assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    data = Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog"] * 16})
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("config", ["SFTConfig", "DPOConfig", "GRPOConfig"])
@pytest.mark.parametrize(
    ("profile", "bf16", "fp16"),
    [("meteor-lake", False, True), ("arc-b580", True, False), ("lunar-lake", True, False)],
)
def test_trl_configs_on_recorded_xpu_profiles(config: str, profile: str, bf16: bool, fp16: bool) -> None:
    cls = getattr(trl, config)
    device = device_profile(profile)
    kwargs = config_kwargs(cls, device, output_dir="out", **{OWN[config]: 256})
    # Both named, so TRL's `bf16 = not fp16` default never decides.
    assert (kwargs["bf16"], kwargs["fp16"]) == (bf16, fp16)
    assert kwargs[OWN[config]] == 256 and "use_cpu" not in kwargs
    assert _checkpointing_kwargs(kwargs) == {"use_reentrant": False}  # TRL's default is on
    # The user's choice of precision still wins, and a failing one is refused as for TrainingArguments.
    assert config_kwargs(cls, device, output_dir="out", bf16=False)["bf16"] is False
    off = config_kwargs(cls, device, output_dir="out", gradient_checkpointing=False)
    assert _checkpointing_kwargs(off) is None


def _checkpointing_kwargs(kwargs: dict[str, Any]) -> Any:
    """The checkpointing keywords xpukit passes, under the name the installed transformers uses
    (``activation_checkpointing_kwargs`` from 5.25, ``gradient_checkpointing_kwargs`` before)."""
    return kwargs.get("activation_checkpointing_kwargs", kwargs.get("gradient_checkpointing_kwargs"))


@pytest.mark.parametrize("config", ["SFTConfig", "DPOConfig", "GRPOConfig"])
def test_trl_configs_build_on_the_cpu(config: str, cpu_kind: str, tmp_path: Path) -> None:
    cls = getattr(trl, config)
    args = training_args(facts=device_profile("cpu"), config_class=cls, output_dir=str(tmp_path))
    assert type(args) is cls and args.use_cpu and args.fp16 is False
    plain = config_kwargs(cls, device_profile("cpu"), output_dir=str(tmp_path))
    assert plain["bf16"] is device_profile("cpu").native_bf16


def test_transformers_subclasses_work_too(tmp_path: Path) -> None:
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    args = training_args(
        facts=device_profile("cpu"),
        config_class=Seq2SeqTrainingArguments,
        output_dir=str(tmp_path),
        predict_with_generate=True,
    )
    assert type(args) is Seq2SeqTrainingArguments and args.predict_with_generate
    default = training_args(facts=device_profile("cpu"), output_dir=str(tmp_path))
    assert type(default) is TrainingArguments and default.gradient_checkpointing is False
    assert _checkpointing_kwargs(config_kwargs(None, device_profile("cpu"), output_dir="o")) is None


@pytest.mark.parametrize(
    ("config_class", "match"),
    [
        (dict, r"config_class=dict.*not a transformers\.TrainingArguments subclass"),
        ("SFTConfig", r"config_class='SFTConfig'.*pass the class"),
        (lambda: trl.SFTConfig, r"not a transformers\.TrainingArguments subclass"),
    ],
)
def test_a_class_that_is_not_training_arguments_is_refused(config_class: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        training_args(facts=device_profile("cpu"), config_class=config_class, output_dir="o")


def test_a_keyword_the_class_lacks_is_refused_with_the_closest(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match=r"'max_lenght' \(did you mean 'max_length'\?\)"):
        config_kwargs(trl.SFTConfig, device_profile("arc-b580"), output_dir="o", max_lenght=64)
    with pytest.raises(InvalidRequestError, match="max_length"):  # TRL's keyword, not TrainingArguments'
        training_args(facts=device_profile("cpu"), output_dir=str(tmp_path), max_length=64)


def test_xpukit_checkpointing_keywords_raise_no_deprecation_warning(tmp_path: Any) -> None:
    """transformers 5.25 renamed gradient_checkpointing to activation_checkpointing (the old name warns):
    xpukit's own keyword goes under the name the installed class has; a user's own old name stays."""
    import dataclasses
    import warnings

    from transformers import TrainingArguments

    from xpukit.training.config_class import build_config

    keywords = {"output_dir": str(tmp_path), "use_cpu": True, "gradient_checkpointing": True}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        args = build_config(TrainingArguments, keywords, {})
    assert args.gradient_checkpointing is True
    assert not [w for w in seen if "gradient_checkpointing" in str(w.message)]
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        assert args.activation_checkpointing is True
        kept = build_config(TrainingArguments, dict(keywords), {"gradient_checkpointing": True})
        assert kept.gradient_checkpointing is True  # the user's name, passed as given
