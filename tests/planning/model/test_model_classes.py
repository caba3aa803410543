"""Every AutoModel class loads as the class its checkpoint names, with the LoRA task of that class.

Tiny random checkpoints of each kind are saved locally (no Hub): BERT for sequence and token
classification and as a base (embedding) model, T5 for seq2seq, Qwen2-VL for image-text-to-text.
Each loads in 4-bit with LoRA and takes one ``Trainer`` step; the plan's size estimate equals
``get_memory_footprint()``; a class that cannot take every weight of the checkpoint is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from xpukit import load_for_xpu, plan_load, training_args
from xpukit.errors import InvalidRequestError

pytest.importorskip("peft")

_BERT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 1,  # one layer of each kind keeps the 4-bit steps short on a CPU
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
_VLM_TEXT = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
    "bos_token_id": 0,
    "eos_token_id": 1,
}
_VLM_VISION = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2}

# kind: (model class, config class, config keywords, Auto class expected, peft task)
KINDS: dict[str, tuple[str, str, dict[str, Any], str, str]] = {
    "seq-cls": (
        "BertForSequenceClassification",
        "BertConfig",
        {**_BERT, "num_labels": 3},
        "AutoModelForSequenceClassification",
        "SEQ_CLS",
    ),
    "token-cls": (
        "BertForTokenClassification",
        "BertConfig",
        {**_BERT, "num_labels": 5},
        "AutoModelForTokenClassification",
        "TOKEN_CLS",
    ),
    "embedding": ("BertModel", "BertConfig", dict(_BERT), "AutoModel", "FEATURE_EXTRACTION"),
    "seq2seq": (
        "T5ForConditionalGeneration",
        "T5Config",
        {
            "vocab_size": 128,
            "d_model": 32,
            "d_kv": 16,
            "d_ff": 64,
            "num_layers": 1,
            "num_heads": 2,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
        },
        "AutoModelForSeq2SeqLM",
        "SEQ_2_SEQ_LM",
    ),
    "vlm": (
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLConfig",
        {
            "vision_config": _VLM_VISION,
            "text_config": _VLM_TEXT,
            "image_token_id": 250,
            "video_token_id": 251,
            "vision_start_token_id": 252,
        },
        "AutoModelForImageTextToText",
        "CAUSAL_LM",
    ),
}


def _build(kind: str, root: Path) -> Path:
    import torch
    import transformers

    model_class, config_class, config, _, _ = KINDS[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    path = root / kind
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def task_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``task_model(kind) -> Path``: a tiny random checkpoint of that kind, built on first use."""
    root = tmp_path_factory.mktemp("task-models")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = _build(kind, root)
        return built[kind]

    return get


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_plan_takes_the_class_and_lora_task_from_the_checkpoint(task_model: Any, kind: str) -> None:
    _, _, _, auto_class, task = KINDS[kind]
    plan = plan_load(task_model(kind), device="cpu", quantize="4bit", lora=True)
    decision = plan.decision("model_class")
    assert plan.model_class == decision.value == auto_class and decision.source == "auto"
    assert KINDS[kind][0] in decision.reason  # the architecture the config names
    assert plan.lora.config["task_type"] == task
    if kind in {"seq-cls", "token-cls"}:
        assert plan.lora.config["modules_to_save"] == ["classifier"]
        assert "classifier" in plan.quantization_config["llm_int8_skip_modules"]
    else:
        assert "modules_to_save" not in plan.lora.config or plan.lora.config["modules_to_save"] is None
    if kind == "vlm":
        assert plan.model_facts.language_model == "model.language_model"
        assert plan.lora.config["target_modules"].startswith(r"model\.language_model\.")
    assert task in plan.lora.reason or kind == "vlm"


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("quantize", [None, "4bit"])
def test_size_estimate_equals_the_loaded_footprint(task_model: Any, kind: str, quantize: str | None) -> None:
    if quantize:
        pytest.importorskip("bitsandbytes")
    model = load_for_xpu(task_model(kind), device="cpu", quantize=quantize)
    assert type(model).__name__ == KINDS[kind][0]
    # get_memory_footprint counts parameters and buffers, as the estimate does (the vision tower too).
    assert model.xpukit_plan.memory.weights == model.get_memory_footprint()


def _batch(kind: str) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (4, 12), generator=gen)
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "seq-cls":
        batch["labels"] = torch.tensor([0, 1, 2, 1])
    elif kind == "token-cls":
        batch["labels"] = torch.randint(0, 5, (4, 12), generator=gen)
    elif kind in {"seq2seq", "vlm"}:
        batch["labels"] = ids.clone()
    else:  # embedding: regress the first token's vector onto a fixed target (compute_loss_func)
        batch["labels"] = torch.randn(4, 32, generator=gen)
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_trains_one_step_in_4bit_with_lora(task_model: Any, kind: str, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import Trainer, default_data_collator

    model = load_for_xpu(task_model(kind), device="cpu", quantize="4bit", lora=True)
    assert type(model).__name__.startswith("PeftModelFor")
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if kind in {"seq-cls", "token-cls"}:
        assert any("classifier.modules_to_save" in n for n in trainable)  # the head trains in full
    if kind == "vlm":
        assert all(".language_model." in n for n in trainable)  # the vision tower stays frozen
    batch = _batch(kind)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    loss_func = None
    if kind == "embedding":

        def loss_func(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
            return torch.nn.functional.mse_loss(outputs.last_hidden_state[:, 0].float(), labels.float())

    args = training_args(
        model,
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=kind != "embedding",  # BertModel.forward takes no labels: keep them
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=default_data_collator,
        compute_loss_func=loss_func,
    )
    trainer.train()
    loss = trainer.state.log_history[0]["loss"]
    assert loss == loss and loss > 0  # a finite, real loss
    changed = [n for n, p in model.named_parameters() if n in trainable and not torch.equal(p, trainable[n])]
    assert any("lora_B" in n for n in changed)
    if kind in {"seq-cls", "token-cls"}:
        assert any("classifier.modules_to_save" in n for n in changed)


def _models_in(tb: Any) -> list[str]:
    """Models still referenced by the frames of a traceback (which would keep their weights alive)."""
    from transformers import PreTrainedModel

    found = []
    while tb is not None:
        found += [k for k, v in tb.tb_frame.f_locals.items() if isinstance(v, PreTrainedModel)]
        tb = tb.tb_next
    return found


def test_a_class_that_drops_weights_of_the_base_model_is_refused(task_model: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        load_for_xpu(task_model("seq-cls"), device="cpu", model_class="AutoModelForCausalLM")
    text = str(info.value)
    assert "bert.pooler.dense.weight" in text and "classifier.weight" in text and "not returned" in text
    assert "model_class='AutoModelForSequenceClassification'" in text  # the class that takes them all
    assert _models_in(info.tb) == []  # the half-right model was dropped before raising


def test_a_checkpoint_whose_config_names_another_class_is_refused(task_model: Any, tmp_path: Path) -> None:
    import json
    import shutil

    path = tmp_path / "mislabelled"
    shutil.copytree(task_model("seq-cls"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    with pytest.raises(InvalidRequestError, match=r"AutoModel cannot take 2 weight\(s\).*classifier\.bias"):
        load_for_xpu(path, device="cpu")  # xpukit's own choice never drops a weight


def test_a_head_the_named_class_replaces_is_a_recorded_note(task_model: Any, tiny_models: Any) -> None:
    # A causal LM as a classifier (a reward model): its LM head is replaced by the new score head.
    model = load_for_xpu(
        tiny_models["llama"], device="cpu", model_class="AutoModelForSequenceClassification", num_labels=1
    )
    notes = [e.actual for e in model.xpukit_plan.events if e.what == "weights"]
    assert notes[0].startswith("not loaded: lm_head.weight, the head of LlamaForCausalLM")
    assert notes[1] == "newly initialised: score.weight"
    base = load_for_xpu(task_model("seq-cls"), device="cpu", model_class="AutoModel")  # embeddings
    assert type(base).__name__ == "BertModel"
    assert [e.actual for e in base.xpukit_plan.events if e.what == "weights"] == [
        "not loaded: classifier.bias, classifier.weight, the head of BertForSequenceClassification; "
        "model_class=AutoModel replaces it"
    ]


def test_model_class_name_for_a_classifier_with_lora(task_model: Any) -> None:
    # Before: AttributeError 'BertForSequenceClassification' has no 'prepare_inputs_for_generation'.
    model = load_for_xpu(
        task_model("seq-cls"), device="cpu", model_class="AutoModelForSequenceClassification", lora=True
    )
    assert type(model).__name__ == "PeftModelForSequenceClassification"
    decision = model.xpukit_plan.decision("model_class")
    assert decision.source == "user" and decision.value == "AutoModelForSequenceClassification"
    assert model.xpukit_plan.lora.config["modules_to_save"] == ["classifier"]  # peft extends its copy


def test_a_base_checkpoint_as_a_classifier_records_the_new_head(task_model: Any) -> None:
    path = task_model("embedding")
    model = load_for_xpu(path, device="cpu", model_class="AutoModelForSequenceClassification")
    assert type(model).__name__ == "BertForSequenceClassification"
    notes = [e.actual for e in model.xpukit_plan.events if e.what == "weights"]
    assert notes == ["newly initialised: classifier.bias, classifier.weight"]
    assert "BertModel" in model.xpukit_plan.decision("model_class").reason


def test_lora_settings_the_user_gave_are_kept_and_a_wrong_task_is_refused(task_model: Any) -> None:
    path = task_model("seq-cls")
    plan = plan_load(path, device="cpu", lora={"modules_to_save": ["classifier", "bert.pooler"]})
    assert plan.lora.config["modules_to_save"] == ["classifier", "bert.pooler"]
    assert plan.lora.config["task_type"] == "SEQ_CLS"
    with pytest.raises(InvalidRequestError, match=r"task_type='CAUSAL_LM' does not fit .*'SEQ_CLS'"):
        plan_load(path, device="cpu", lora={"task_type": "CAUSAL_LM"})


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_vlm_configs_put_lora_on_the_language_model_only(family: str) -> None:
    import transformers as t

    text = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    if family == "llava":
        config = t.LlavaConfig(
            vision_config=t.CLIPVisionConfig(**vision),
            text_config=t.LlamaConfig(**text),
            architectures=["LlavaForConditionalGeneration"],
        )
    else:
        config = t.Gemma3Config(
            vision_config=t.SiglipVisionConfig(**vision),
            text_config=t.Gemma3TextConfig(**text),
            mm_tokens_per_image=4,
            architectures=["Gemma3ForConditionalGeneration"],
        )
    plan = plan_load(config, device="cpu", lora=True)
    assert plan.model_class == "AutoModelForImageTextToText"
    targets = plan.lora.config["target_modules"]
    import re

    matched = [n for n in plan.model_facts.module_names if re.fullmatch(targets, n)]
    assert matched and all(n.startswith("model.language_model.") for n in matched)
    assert any("vision" in n for n in plan.model_facts.module_names)  # sized with its vision tower


def test_a_config_without_architectures_keeps_the_causal_lm_default() -> None:
    from xpukit.planning.model.reference_models import reference_config

    config = reference_config("qwen3-0.6b")
    config.architectures = None  # a config built in code
    plan = plan_load(config, facts="arc-b580")
    assert plan.model_class == "AutoModelForCausalLM"
    assert plan.decision("model_class").reason.startswith("the config names no architecture")


def test_a_built_in_shape_names_its_architecture_as_the_hub_config_does() -> None:
    from xpukit.planning.model.reference_models import reference_config

    plan = plan_load(reference_config("qwen3-8b"), facts="arc-b580")  # it said "names no architecture"
    assert plan.model_class == "AutoModelForCausalLM"
    assert plan.decision("model_class").reason.startswith("the config's architectures names Qwen3ForCausalLM")
