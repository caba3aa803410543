"""Packed rows without a mask: the ``packed_attention`` decision and the ``xpukit_varlen`` attention.

The decision is a table of hand-made facts. The act runs here on the CPU in float32, where torch's
``varlen_attn`` cannot run, so every packed call takes the reference path (SDPA with the
block-diagonal mask of the row's boundaries): what is proven is the plumbing (boundaries through
packing, the decoder and the layers to the attention; no mask built; other calls on SDPA) and the
numbers against the masked packed row. ``test_varlen_attention_gpu.py`` checks ``varlen_attn``
itself on CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit.machine.facts import DeviceFacts
from xpukit.planning.training.packed_attention import decide_packed_attention
from xpukit.planning.vocabulary import Decision

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

GIB = 1 << 30


# ---- the decision (pure) ---------------------------------------------------------------------------


def _device(
    backend: str = "cuda", *, cc: tuple[int, int] | None = (9, 0), family: str = "nvidia"
) -> DeviceFacts:
    return DeviceFacts(
        backend=backend,  # type: ignore[arg-type]
        index=0,
        name=f"a {family} {backend} device",
        family=family,
        total_memory=80 * GIB,
        free_memory=None,
        native_bf16=True,
        compute_capability=cc,
    )


PACKING = Decision(name="packing", value=256, reason="packed")
SDPA = Decision(name="attn_implementation", value="sdpa", reason="chosen")


@pytest.mark.parametrize(
    ("device", "dtype", "torch_version", "attention", "value", "said"),
    [
        (_device(), "bfloat16", "2.13.0", SDPA, "varlen", "varlen_attn"),
        (_device(cc=(8, 0)), "float16", "2.10.0+cu128", SDPA, "varlen", "no mask is built"),
        (
            _device(),
            "bfloat16",
            "2.13.0",
            Decision(name="attn_implementation", value="sdpa", reason="", source="user"),
            "mask",
            "attn='sdpa' given",
        ),
        (_device("xpu", cc=None, family="arc-b"), "bfloat16", "2.13.0", SDPA, "mask", "not XPU"),
        (_device(cc=(9, 4), family="amd"), "bfloat16", "2.13.0", SDPA, "mask", "AMD GPUs (ROCm)"),
        (_device("mps", cc=None, family="apple"), "float16", "2.13.0", SDPA, "mask", "not MPS"),
        (_device("cpu", cc=None, family="cpu"), "bfloat16", "2.13.0", SDPA, "mask", "NotImplementedError"),
        (_device(cc=(7, 5)), "float16", "2.13.0", SDPA, "mask", "compute capability 7.5"),
        (_device(), "float32", "2.13.0", SDPA, "mask", "dtype is float32"),
        (_device(), "bfloat16", "2.9.1", SDPA, "mask", "torch 2.10; this is torch 2.9.1"),
    ],
)
def test_varlen_only_for_xpukits_sdpa_on_cuda_from_cc_8_in_half_precision_from_torch_2_10(
    device: DeviceFacts, dtype: str, torch_version: str, attention: Decision, value: str, said: str
) -> None:
    decision = decide_packed_attention(
        PACKING, attention, device=device, dtype=dtype, torch_version=torch_version
    )
    assert decision is not None and decision.name == "packed_attention"
    assert decision.value == value and said in decision.reason
    assert decision.source == ("user" if attention.source == "user" else "auto")
    assert decision.rejected and decision.rejected[0][0] == ("mask" if value == "varlen" else "varlen")


def test_no_decision_without_packing_or_without_sdpa() -> None:
    def decide(packing: Decision | None, attention: Decision) -> Decision | None:
        return decide_packed_attention(
            packing, attention, device=_device(), dtype="bfloat16", torch_version="2.13.0"
        )

    assert decide(None, SDPA) is None
    assert decide(Decision(name="packing", value=False, reason="off"), SDPA) is None
    for other in ("eager", "flash_attention_2", "kernels-community/flash-attn2"):
        assert decide(PACKING, Decision(name="attn_implementation", value=other, reason="")) is None


def test_the_plan_decides_it_after_packing() -> None:
    from xpukit.planning.model.reference_models import reference_config
    from xpukit.planning.plan import plan_load

    args: dict[str, Any] = {"quantize": "4bit", "lora": True}
    plan = plan_load(reference_config("qwen3-8b"), facts="h200", **args)
    names = [d.name for d in plan.decisions]
    assert names.index("packed_attention") == names.index("packing") + 1
    assert plan.decision("packed_attention").value == "varlen"
    given = plan_load(reference_config("qwen3-8b"), facts="h200", attn="sdpa", **args)
    assert (given.decision("packed_attention").value, given.decision("packed_attention").source) == (
        "mask",
        "user",
    )
    off = plan_load(reference_config("qwen3-8b"), facts="h200", **(args | {"lora": {"packing": False}}))
    assert all(d.name != "packed_attention" for d in off.decisions)


# ---- boundaries, the mask and varlen_attn's keywords ---------------------------------------------


def test_boundaries_count_the_tail_as_an_example_and_pad_to_a_multiple_of_the_slots() -> None:
    from xpukit.loading.training.varlen_attention import SLOTS, boundaries

    cu = boundaries([5, 11, 3, 8, 5])
    assert cu.dtype == torch.int32 and SLOTS == 8
    assert cu.tolist() == [0, 5, 16, 19, 27, 32, 32, 32, 32]
    assert boundaries([1] * 8).numel() == 9 and boundaries([1] * 9).numel() == 17
    assert boundaries([7, 1], slots=4).tolist() == [0, 7, 8, 8, 8]


def _loop_mask(lengths: list[int], window: int | None) -> Any:
    """The block-diagonal causal mask, one token pair at a time."""
    total = sum(lengths)
    owner = [i for i, n in enumerate(lengths) for _ in range(n)]
    mask = torch.zeros(total, total, dtype=torch.bool)
    for q in range(total):
        for k in range(total):
            mask[q, k] = owner[q] == owner[k] and k <= q and (window is None or q - k < window)
    return mask


@pytest.mark.parametrize("window", [None, 3])
def test_block_mask_is_the_block_diagonal_causal_mask(window: int | None) -> None:
    from xpukit.loading.training.varlen_attention import block_mask, boundaries

    lengths = [4, 1, 6, 0, 3, 2]
    mask = block_mask(boundaries(lengths), sum(lengths), window)
    assert tuple(mask.shape) == (1, 1, 16, 16)
    assert torch.equal(mask[0, 0], _loop_mask(lengths, window))


def test_keywords_follow_the_signature_of_varlen_attn() -> None:
    from xpukit.loading.training.varlen_attention import keywords

    old = frozenset(
        {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "return_aux"}
    )
    new = old - {"is_causal"} | {"scale", "window_size", "enable_gqa"}
    assert keywords(window=None, scale=None, gqa=True, parameters=old) == {"is_causal": True}
    assert "sliding window" in str(keywords(window=4, scale=None, gqa=False, parameters=old))
    assert "scale" in str(keywords(window=None, scale=0.5, gqa=False, parameters=old))
    assert keywords(window=None, scale=None, gqa=False, parameters=new) == {"window_size": (-1, 0)}
    assert keywords(window=4, scale=0.5, gqa=True, parameters=new) == {
        "window_size": (3, 0),
        "scale": 0.5,
        "enable_gqa": True,
    }
    installed = keywords(window=None, scale=None, gqa=True)  # torch 2.13 here: window_size, enable_gqa
    assert installed == {"window_size": (-1, 0), "enable_gqa": True}


def test_varlen_attn_raises_on_the_cpu_and_the_call_takes_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the device check out of the way the call reaches varlen_attn, which has no CPU kernel on
    torch 2.13 (NotImplementedError, docs/known-issues.md "torch: varlen_attn"): the reference runs,
    counted with that reason."""
    from xpukit.loading.training import varlen_attention as va

    monkeypatch.setattr(va, "_why_reference", lambda *a: None)
    monkeypatch.setattr(va, "FALLBACKS", va.FALLBACKS.__class__())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    module = torch.nn.Module()
    cu = va.boundaries([5, 7])
    out, _ = va.varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=12)
    want, _ = va.reference_attention(module, q, k, v, cu)
    torch.testing.assert_close(out, want)
    if va.FALLBACKS:  # a torch with a CPU kernel computes the same numbers instead
        assert list(va.FALLBACKS) == [next(r for r in va.FALLBACKS if "NotImplementedError" in r)]


# ---- the act: a packed row with its boundaries ---------------------------------------------------


def _lora_model(case: Any, path: Path, *, varlen: bool = False, bucket: int = 16, **packing: Any) -> Any:
    """``case.model(path)`` packed into ``bucket``-token rows, with the row's boundaries and the
    ``xpukit_varlen`` attention where ``varlen``."""
    from xpukit.loading.training.packing import install_packing
    from xpukit.loading.training.varlen_attention import use_varlen

    model = case.model(path)
    if varlen:
        use_varlen(model)
    install_packing(model, bucket=bucket, varlen=varlen, **packing)
    return model


class _MaskSpy:
    """Counts calls of transformers' ``sdpa_mask`` made through ``xpukit_varlen``'s mask function."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import transformers.masking_utils as masking

        self.calls = 0
        original = masking.sdpa_mask

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(masking, "sdpa_mask", spy)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma", "gemma-sliding"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_packed_row_with_boundaries_trains_as_the_masked_row_without_a_mask(
    tiny_models: Any,
    sliding_gemma: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    side: str,
    lora_case: Any,
) -> None:
    from xpukit.loading.training import varlen_attention as va

    lengths = list(lora_case.lengths)
    path = sliding_gemma if arch == "gemma-sliding" else tiny_models[arch]
    ids, mask, labels = lora_case.batch(side)
    masked = _lora_model(lora_case, path)
    want = masked(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    model = _lora_model(lora_case, path, varlen=True)
    assert model.config._attn_implementation == va.NAME
    monkeypatch.setattr(va, "FALLBACKS", va.FALLBACKS.__class__())
    spy = _MaskSpy(monkeypatch)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert spy.calls == 0  # no mask built for the packed row
    lora_case.assert_same(out.loss, want.loss, lora_case.grads(model), lora_case.grads(masked))
    layers = model.config.num_hidden_layers
    assert dict(va.FALLBACKS) == {"not CUDA (cpu)": layers}  # every layer's attention took the reference
    stats = model.xpukit_packing.stats
    assert stats["varlen"] == stats["packed"] == 1 and stats["bucket_padding"] == -sum(lengths) % 16


def test_evaluation_and_generate_run_sdpa_with_its_masks(
    tiny_models: Any, monkeypatch: pytest.MonkeyPatch, lora_case: Any
) -> None:
    path = tiny_models["qwen3"]
    ids, mask, _ = lora_case.batch("left")
    plain, model = _lora_model(lora_case, path), _lora_model(lora_case, path, varlen=True)
    spy = _MaskSpy(monkeypatch)
    for each in (plain, model):
        each.eval()
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert spy.calls > 0  # outside a packed call the mask is SDPA's
        kwargs: dict[str, Any] = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        tokens = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert torch.equal(tokens, plain.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert model.xpukit_packing.stats["varlen"] == 0


def test_a_step_split_by_tokens_gives_each_pass_its_boundaries(tiny_models: Any, lora_case: Any) -> None:
    path = tiny_models["llama"]
    ids, mask, labels = lora_case.batch("right")
    masked = _lora_model(lora_case, path, max_tokens=16)
    want = masked(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    model = _lora_model(lora_case, path, varlen=True, max_tokens=16)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    lora_case.assert_same(out.loss, want.loss, lora_case.grads(model), lora_case.grads(masked))
    stats = model.xpukit_packing.stats
    assert stats["split_steps"] == 1 and stats["split_passes"] == 2
    assert stats["varlen"] == stats["packed"] >= 2  # each pass (and its recomputation) took them


def test_a_flattened_batch_reads_its_examples_from_the_position_restarts(
    tiny_models: Any, lora_case: Any
) -> None:
    from xpukit.loading.training.packing_rows import example_lengths

    lengths = list(lora_case.lengths)
    ids, mask, labels = lora_case.batch("right")
    keep = mask.bool()
    flat_ids, flat_labels = ids[keep][None], labels[keep][None].clone()
    starts = torch.cumsum(torch.tensor(lengths), 0) - torch.tensor(lengths)
    flat_labels[0, starts] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    assert example_lengths(positions) == lengths
    masked = _lora_model(lora_case, tiny_models["qwen3"], bucket=32)
    want = masked(input_ids=flat_ids, labels=flat_labels, position_ids=positions)
    model = _lora_model(lora_case, tiny_models["qwen3"], varlen=True, bucket=32)
    out = model(input_ids=flat_ids, labels=flat_labels, position_ids=positions)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    stats = model.xpukit_packing.stats
    assert stats["flattened_input"] == stats["varlen"] == 1


def test_rows_of_one_bucket_are_one_graph_shape_whatever_their_examples(
    tiny_models: Any, lora_case: Any
) -> None:
    """What the layer graphs key a replay on (layer_calls.flatten's signature) is the same for rows of
    one bucket with 2 and 6 examples: the boundaries keep their length, the padded length is the max."""
    from xpukit.loading.training.layer_calls import flatten

    model = _lora_model(lora_case, tiny_models["qwen3"], varlen=True, bucket=32)
    layer = model.get_base_model().model.layers[0]
    seen: list[tuple[Any, ...]] = []

    def keep(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(flatten([(args[1:], dict(kwargs))])[2])

    layer.register_forward_pre_hook(keep, with_kwargs=True)
    for lengths in ([9, 12], [3, 2, 6, 4, 1, 5]):
        ids, mask, labels = lora_case.batch("right", lengths=lengths)
        model(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert "cu_seq_lens_q" in str(seen[0]) and "max_length_q" in str(seen[0])


def test_apply_lora_with_varlen_sets_the_attention_before_packing(tiny_model: Path, lora_case: Any) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.lora import apply_lora
    from xpukit.machine.probe import cpu_facts
    from xpukit.planning.training.lora_request import resolve_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    request = resolve_lora(True, quantized=False)
    assert request is not None
    model, notes = apply_lora(
        base, request, compute_dtype="float32", quantized=False, device=cpu_facts(), packing=8, varlen=True
    )
    assert model.config._attn_implementation == "xpukit_varlen"
    assert any(note.startswith("packed attention: xpukit_varlen") for note in notes)
    assert model.xpukit_packing.varlen and model.xpukit_packing.bucket == 8
    model.train()
    ids, mask, labels = lora_case.batch("right")
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert model.xpukit_packing.stats["varlen"] == 1
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    plain, _ = apply_lora(
        plain,
        request,
        compute_dtype="float32",
        quantized=False,
        device=cpu_facts(),
        packing=None,
        varlen=True,
    )
    assert plain.config._attn_implementation == "sdpa"  # no packing: nothing to give boundaries to
