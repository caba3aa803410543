"""Packing: a padded training batch runs as one row of its real tokens (decision and act, on the CPU).

The proof is numerical, in float32 on tiny random models of several architectures: the packed batch
gives each example what it gives alone (loss and every LoRA gradient), with right and left padding,
bucket padding at the end, gradient accumulation through ``Trainer``, and TRL's ``SFTTrainer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

ARCHS = ["qwen3", "llama", "mistral", "gemma", "phi3"]


# ---- the decision (pure) ---------------------------------------------------------------------------


def test_on_for_lora_training_with_a_bucket_only_where_the_layers_run_as_graphs() -> None:
    args: dict[str, Any] = {"quantize": "4bit", "lora": True, "batch_size": 4, "seq_len": 512}
    graphed = plan_load(reference_config("qwen3-8b"), facts="h200", **args)
    assert graphed.decision("layer_graphs").value is True
    packing = graphed.decision("packing")
    assert packing.value == 256 and packing.source == "auto"
    assert "real tokens" in packing.reason and "multiple of 256" in packing.reason
    eager = plan_load(reference_config("qwen3-8b"), facts="h200", **(args | {"lora": {"graphs": False}}))
    assert eager.decision("packing").value == 1 and "multiple of" not in eager.decision("packing").reason
    assert all(d.name != "packing" for d in plan_load(reference_config("qwen3-8b"), facts="h200").decisions)


def test_the_user_turns_it_off_or_insists_and_a_model_without_rotary_positions_is_refused(
    tiny_models: Any,
) -> None:
    off = plan_load(tiny_models["qwen3"], facts="cpu", lora={"packing": False}).decision("packing")
    assert (off.value, off.source) == (False, "user")
    on = plan_load(tiny_models["qwen3"], facts="cpu", lora={"packing": True}).decision("packing")
    assert (on.value, on.source) == (1, "user") and "'packing': True} given" in on.reason
    gpt2 = plan_load(tiny_models["gpt2"], facts="cpu", lora=True).decision("packing")
    assert gpt2.value is False and "no rotary position embeddings" in gpt2.reason
    with pytest.raises(InvalidRequestError, match=r"'packing': True.*no rotary.*Fix"):
        plan_load(tiny_models["gpt2"], facts="cpu", lora={"packing": True})
    with pytest.raises(InvalidRequestError, match="must be True or False"):
        plan_load(tiny_models["qwen3"], facts="cpu", lora={"packing": "yes"})


# ---- the act: numbers --------------------------------------------------------------------------------


def _alone(model: Any, ids: Any, mask: Any, labels: Any) -> Any:
    """The mean loss over every example run alone (no padding), weighted by its targets."""
    total, count = 0.0, 0
    for row in range(ids.shape[0]):
        keep = mask[row].bool()
        x, y = ids[row][keep][None], labels[row][keep][None]
        n = int((y[:, 1:] != -100).sum())
        total = total + model(input_ids=x, labels=y).loss * n
        count += n
    return total / count


@pytest.mark.parametrize("arch", [*ARCHS, "gemma-sliding"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_batch_gives_each_example_what_it_gives_alone(
    tiny_models: Any, sliding_gemma: Path, arch: str, side: str, lora_case: Any
) -> None:
    from xpukit.loading.training.packing import install_packing

    lengths = list(lora_case.lengths)
    path = sliding_gemma if arch == "gemma-sliding" else tiny_models[arch]
    ids, mask, labels = lora_case.batch(side)
    alone = lora_case.model(path)
    want_loss = _alone(alone, ids, mask, labels)
    want_loss.backward()
    packed = lora_case.model(path)
    install_packing(packed, bucket=16)
    out = packed(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    lora_case.assert_same(out.loss, want_loss, lora_case.grads(packed), lora_case.grads(alone))
    stats = packed.xpukit_packing.stats
    real = sum(lengths)
    assert stats["packed"] == 1 and stats["tokens"] == real
    assert stats["padding_removed"] == len(lengths) * max(lengths) - real
    assert stats["bucket_padding"] == -real % 16
    assert tuple(out.logits.shape) == (*ids.shape, alone.config.vocab_size)


def test_right_padded_batch_gives_the_padded_batchs_loss_gradients_and_logits(
    tiny_models: Any, lora_case: Any
) -> None:
    """With right padding the padded batch itself is the reference (its targets are the real ones)."""
    from xpukit.loading.training.packing import install_packing

    ids, mask, labels = lora_case.batch("right")
    padded = lora_case.model(tiny_models["qwen3"])
    want = padded(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    packed = lora_case.model(tiny_models["qwen3"])
    install_packing(packed)
    out = packed(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(23))
    again = padded(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(23))
    torch.testing.assert_close(out.loss, again.loss, rtol=1e-5, atol=1e-6)  # a sum over the given count
    packed.zero_grad()
    out = packed(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    lora_case.assert_same(out.loss, want.loss, lora_case.grads(packed), lora_case.grads(padded))
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], want.logits[real], rtol=1e-4, atol=1e-4)
    assert tuple(out.logits.shape) == tuple(want.logits.shape)


def test_calls_that_cannot_be_packed_run_unchanged_with_the_reason(tiny_models: Any, lora_case: Any) -> None:
    from xpukit.loading.training.packing import install_packing

    model = lora_case.model(tiny_models["qwen3"])
    install_packing(model)
    ids, mask, labels = lora_case.batch("right")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, labels=labels)
    model(input_ids=ids, attention_mask=mask)
    model.eval()  # a decode step with a filled cache
    with torch.no_grad():
        past = model(input_ids=ids[:1, :4], use_cache=True).past_key_values
    model.train()
    model(input_ids=ids[:1, 4:5], past_key_values=past, use_cache=True)
    holes = mask.clone()
    holes[1, 2] = 0
    model(input_ids=ids, attention_mask=holes, labels=labels.masked_fill(holes == 0, -100))
    passed = model.xpukit_packing.passed
    assert passed["no grad (evaluation, generate)"] == 2 and passed["a filled KV cache"] == 1
    assert passed["an attention mask with gaps (not one run of ones per row)"] == 1
    assert model.xpukit_packing.stats["packed"] == 1  # the call without labels: the layers do not need them


def test_an_already_flattened_batch_is_only_padded_to_its_bucket(tiny_models: Any, lora_case: Any) -> None:
    """TRL's padding_free collator gives one row with positions restarting per example."""
    from xpukit.loading.training.packing import install_packing

    lengths = list(lora_case.lengths)
    ids, mask, labels = lora_case.batch("right")
    keep = mask.bool()
    flat_ids, flat_labels = ids[keep][None], labels[keep][None].clone()
    starts = torch.cumsum(torch.tensor(lengths), 0) - torch.tensor(lengths)
    flat_labels[0, starts] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    plain = lora_case.model(tiny_models["llama"])
    # use_cache=False: with a cache transformers does not build per-example masks from the positions
    want = plain(input_ids=flat_ids, labels=flat_labels, position_ids=positions, use_cache=False)
    packed = lora_case.model(tiny_models["llama"])
    install_packing(packed, bucket=32)
    out = packed(input_ids=flat_ids, labels=flat_labels, position_ids=positions)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert tuple(out.logits.shape[:2]) == tuple(flat_ids.shape)
    stats = packed.xpukit_packing.stats
    assert stats["flattened_input"] == 1 and stats["bucket_padding"] == 32 - sum(lengths)


def _examples(n: int, seed: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (n,), generator=gen).tolist()
    return [{"input_ids": torch.randint(5, 500, (k,), generator=gen).tolist()} for k in lengths]


def test_trainer_with_gradient_accumulation_trains_the_same_with_and_without_packing(
    tiny_model: Path, tmp_path: Path, train_losses: Any
) -> None:
    """Trainer counts the targets over the accumulated padded batches (num_items_in_batch): packed
    micro-batches give the same logged losses and the same trained adapter."""
    from transformers import PreTrainedTokenizerFast

    from xpukit import load_for_xpu, training_args

    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model)
    tok.pad_token = tok.pad_token or tok.eos_token
    data = _examples(24, seed=5)
    runs = []
    for packing in (False, True):
        model = load_for_xpu(tiny_model, device="cpu", dtype="float32", seed=0, lora={"packing": packing})
        args = training_args(
            model,
            output_dir=str(tmp_path / str(packing)),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=3,
            learning_rate=5e-3,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            data_seed=0,
            report_to=[],
        )
        runs.append((model, train_losses(model, args, tok, data)))
    (plain, plain_losses), (packed, packed_losses) = runs
    assert len(plain_losses) == 3
    torch.testing.assert_close(torch.tensor(packed_losses), torch.tensor(plain_losses), rtol=1e-4, atol=1e-5)
    assert not hasattr(plain, "xpukit_packing") or plain.xpukit_packing.stats["packed"] == 0
    assert packed.xpukit_packing.stats["packed"] == 6  # 3 steps x 2 micro-batches
    assert packed.xpukit_packing.stats["padding_removed"] > 0
    want = {n: p.detach() for n, p in plain.named_parameters() if p.requires_grad}
    for name, param in packed.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.detach(), want[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padding_free", [False, True])
def test_sft_trainer_packs_padded_batches_and_buckets_flattened_ones(
    tiny_model: Path, tmp_path: Path, padding_free: bool
) -> None:
    """TRL's SFTTrainer reads the logits for its token accuracy: they come back in the batch's shape."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from xpukit import load_for_xpu, training_args

    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = load_for_xpu(tiny_model, device="cpu", dtype="float32", seed=0, lora=True)
    args = training_args(
        model,
        config_class=SFTConfig,
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to=[],
        padding_free=padding_free,
        max_length=None if padding_free else 64,
    )
    data = Dataset.from_list(_examples(8, seed=7))
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all("mean_token_accuracy" in h for h in logged)
    stats = model.xpukit_packing.stats
    assert stats["packed"] == 2
    assert stats["flattened_input" if padding_free else "padding_removed"] > 0


def test_packing_under_gradient_checkpointing_gives_the_unpacked_loss_and_gradients(
    tiny_model: Path, lora_case: Any
) -> None:
    """The checkpointed layers recompute inside backward on the packed row (the budget rungs)."""
    from xpukit import load_for_xpu

    ids, mask, labels = lora_case.batch("right")
    results = []
    for packing in (False, True):
        model = load_for_xpu(
            tiny_model,
            device="cpu",
            dtype="float32",
            seed=0,
            lora={"packing": packing, "gradient_checkpointing": True},
        )
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append((out.loss.detach(), lora_case.grads(model)))
    (want_loss, want), (loss, grads) = results
    lora_case.assert_same(loss, want_loss, grads, want)


@pytest.mark.parametrize(
    ("tokens", "captured", "full", "want"),
    [
        (100, [], False, 256),  # the next bucket
        (300, [256, 1024], False, 512),  # room for more shapes: its own bucket
        (300, [256, 1024], True, 1024),  # no room: the shortest captured shape that holds it
        (300, [512, 1024], True, 512),
        (200, [256, 1024], True, 256),  # its own bucket is captured
        (1100, [256, 1024], True, 1280),  # nothing captured holds it: its bucket (it runs eagerly)
    ],
)
def test_a_packed_row_takes_a_captured_shape_once_no_more_are_captured(
    tokens: int, captured: list[int], full: bool, want: int
) -> None:
    """A row pads to a multiple of the bucket; once the graphs keep all the shapes they can, a row
    whose bucket is not captured takes a longer captured shape, so it replays instead of running
    eagerly beside the graphs' memory (docs/training-plan.md "Packing: no compute on padding")."""
    from xpukit.loading.training.packing import padded_length

    assert padded_length(tokens, captured, 256, full=full) == want
    assert padded_length(tokens, captured, 1, full=full) == tokens  # no bucket: not padded


@pytest.mark.parametrize("mask", ["ones", "none"])
def test_a_batch_without_padding_runs_as_it_is(tiny_models: Any, mask: str, lora_case: Any) -> None:
    """Several rows and no padding: nothing to remove, so the rows keep plain causal attention (no
    per-example mask); the loss and gradients are the unwrapped model's."""
    from xpukit.loading.training.packing import install_packing

    ids = torch.randint(3, 500, (3, 10), generator=torch.Generator().manual_seed(1))
    extra = {"attention_mask": torch.ones_like(ids)} if mask == "ones" else {}
    plain = lora_case.model(tiny_models["qwen3"])
    want = plain(input_ids=ids, labels=ids, **extra).loss
    want.backward()
    model = lora_case.model(tiny_models["qwen3"])
    install_packing(model, bucket=16)
    out = model(input_ids=ids, labels=ids, **extra)
    out.loss.backward()
    lora_case.assert_same(out.loss, want, lora_case.grads(model), lora_case.grads(plain))
    assert out.past_key_values is None  # a training pass fills no KV cache
    assert model.xpukit_packing.passed == {"no padding: the rows run as they are": 1}
    assert model.xpukit_packing.stats["packed"] == 0
