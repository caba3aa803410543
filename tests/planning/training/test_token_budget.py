"""A token budget per pass (docs/training-plan.md "A token budget per pass"): the plan sizes a pass on the
real tokens a step carries (packing knows them per batch at run time), and a step over the budget is
split by tokens into passes of whole examples, each checkpointed, with the same loss and gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit import plan_load
from xpukit.loading.training.packing import token_groups
from xpukit.planning.model.reference_models import reference_config


def test_token_groups_keep_whole_examples_in_order() -> None:
    assert token_groups([100, 200, 300], None) == [600]
    assert token_groups([100, 200, 300], 600) == [600]
    assert token_groups([100, 200, 300], 350) == [300, 300]
    assert token_groups([500, 20, 20], 100) == [500, 40]  # a longer example is a pass of its own
    assert token_groups([60, 60, 60, 60], 130) == [120, 120]


def test_a_step_over_the_budget_trains_as_the_whole_step(tiny_model: Path) -> None:
    """The packed row split into passes of at most 20 tokens gives the unsplit step's loss and every
    LoRA gradient (float32, CPU), and counts the split."""
    import torch

    from xpukit import load_for_xpu

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (3, 16), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0  # right padding: 11 + 16 + 9 real tokens
    mask[2, :7] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for budget in (None, 20):
        model = load_for_xpu(tiny_model, device="cpu", dtype="float32", seed=0, lora=True)
        packing = model.xpukit_packing
        packing.max_tokens = budget
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads, dict(packing.stats)))
    (loss_a, grads_a, stats_a), (loss_b, grads_b, stats_b) = results
    assert stats_a.get("split_steps", 0) == 0 and stats_b["split_steps"] == 1 and stats_b["split_passes"] == 3
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _plan(profile: str, seq: int, **kw: Any) -> Any:
    kw.setdefault("lora", True)
    config = reference_config("qwen3-8b")
    return plan_load(config, facts=profile, quantize="4bit", batch_size=4, seq_len=seq, **kw)


@pytest.mark.parametrize("profile", ["arc-b580", "arc-a770", "arc-pro-b60"])
@pytest.mark.parametrize("seq", [512, 1024])
def test_intel_cards_keep_the_whole_batch_in_the_graphs(
    profile: str, seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An 8B QLoRA of 4 × 512 and 4 × 1024 on the B580, A770 and Arc Pro B60 (recorded facts, torch
    2.11+ with torch.xpu.graph): the whole batch in one pass, the layers as graphs with the rung that
    fits (their buffers counted), with and without liger-kernel, the Arc allocation cap respected."""
    import xpukit.planning.training.fit as fit

    for liger in (True, False):
        monkeypatch.setattr(fit, "liger_availability", lambda backend, ok=liger: (ok, "injected"))
        plan = _plan(profile, seq)
        training = plan.training
        assert training is not None and training.fits, (profile, seq, liger)
        assert training.micro_batch == 4 and not training.split_by_tokens
        assert training.graphs and plan.decision("layer_graphs").value is True
        assert "torch.xpu.graph" in plan.decision("layer_graphs").reason
        assert training.estimate["graph_buffers"] > 0
        if training.loss == "plain":  # the logits of the whole step are one tensor: under the Arc cap
            from xpukit.planning.training.allocation import logits_bytes

            assert logits_bytes(4, seq, 151936) <= 4 * 2**30


def test_a_budget_too_small_for_the_worst_case_keeps_the_whole_batch_by_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """H200 facts under 7 GB with liger: 4 × 1024 does not fit one pass, even with the input
    embedding in host memory, so the plan keeps the whole batch on the rung that carries the most
    tokens a pass (the eager offloaded one: a split step's eager memory would stay beside the graphs'
    pool) and sizes a pass by tokens; without packing it splits the batch by sequences instead;
    asking for the graphs takes their leanest rung by tokens."""
    import xpukit.planning.training.fit as fit

    monkeypatch.setattr(fit, "liger_availability", lambda backend: (True, "injected"))
    plan = _plan("h200", 1024, max_memory={0: "7GB"})
    training = plan.training
    assert training is not None and training.split_by_tokens and training.micro_batch == 4
    assert 2048 <= (training.pass_tokens or 0) < 4096 and not training.graphs
    assert training.gradient_checkpointing == "offload"
    assert "split by tokens" in plan.decision("micro_batch").reason
    assert training.estimate["peak"] <= training.room
    unpacked = _plan("h200", 1024, max_memory={0: "7GB"}, lora={"packing": False})
    assert unpacked.training is not None and unpacked.training.micro_batch < 4
    graphs = _plan("h200", 1024, max_memory={0: "7GB"}, lora={"graphs": True})
    assert graphs.training is not None and graphs.training.graphs and graphs.training.split_by_tokens
    assert (graphs.training.pass_tokens or 0) < (training.pass_tokens or 0)


def test_host_slots_keep_every_buffer_a_graph_copies_to() -> None:
    """A larger shape gets a larger pinned buffer (for the next power of two of rows); the earlier one
    stays alive, since graphs captured with it write to its addresses at every replay."""
    import torch

    from xpukit.loading.training.graph_offload import HostSlots

    host = HostSlots(pin=False)
    small = host.slots(3, torch.zeros(1, 5, 4))
    assert len(small) == 3 and small[0].shape == (1, 5, 4) and host.buffer.numel() == 3 * 8 * 4
    again = host.slots(3, torch.zeros(1, 8, 4))  # fits the buffer made for 8 rows
    assert again[0].untyped_storage().data_ptr() == small[0].untyped_storage().data_ptr()
    large = host.slots(3, torch.zeros(1, 9, 4))
    assert large[2].shape == (1, 9, 4) and len(host.kept) == 2 and host.buffer.numel() == 3 * 16 * 4
    assert host.bytes == (3 * 8 * 4 + 3 * 16 * 4) * 4
    host.clear()
    assert host.buffer is None and not host.kept and host.bytes == 0
