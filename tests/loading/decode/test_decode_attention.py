"""The grouped decode attention gives transformers' SDPA result, and hands every other call to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    # query as transformers makes it: (b, q, heads, d) transposed to (b, heads, q, d), not contiguous
    query = torch.randn(batch, q_len, heads, 16, generator=g).transpose(1, 2)
    key = torch.randn(batch, kv_heads, kv_len, 16, generator=g)
    value = torch.randn(batch, kv_heads, kv_len, 16, generator=g)
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    mask[0, :, :, :2] = False  # left padding of the first row
    mask[:, :, :, kv_len - 1 :] = False  # the cache's empty tail
    return query, key, value, mask


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("float_mask", [False, True])
def test_one_query_token_equals_transformers_sdpa(heads: int, kv_heads: int, float_mask: bool) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from xpukit.loading.decode.attention import grouped_decode_sdpa

    module = _Module(heads // kv_heads)
    query, key, value, mask = _inputs(2, heads, kv_heads, 1, 10)
    if float_mask:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, weights = grouped_decode_sdpa(module, query, key, value, mask, scaling=0.25)
    assert weights is None and got.shape == want.shape == (2, 1, heads, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_grouped_path_makes_no_repeat_kv_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.integrations.sdpa_attention as sdpa

    from xpukit.loading.decode.attention import grouped_decode_sdpa

    calls: list[int] = []
    original = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda x, n: calls.append(n) or original(x, n))
    query, key, value, mask = _inputs(1, 8, 2, 1, 10)
    grouped_decode_sdpa(_Module(4), query, key, value, mask)
    assert calls == []  # one query token: grouped, no copy
    query, key, value, mask = _inputs(1, 8, 2, 5, 10)  # a prefill: transformers' path, which repeats
    grouped_decode_sdpa(_Module(4), query, key, value, mask)
    assert calls == [4, 4]


@pytest.mark.parametrize("kwargs", [{"dropout": 0.1}, {"softcap": 30.0}])
def test_special_calls_go_to_transformers(kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.integrations.sdpa_attention as sdpa

    from xpukit.loading.decode.attention import grouped_decode_sdpa

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: seen.append(k) or ("hf", None))
    query, key, value, mask = _inputs(1, 8, 2, 1, 10)
    assert grouped_decode_sdpa(_Module(4), query, key, value, mask, **kwargs) == ("hf", None)
    assert seen and all(seen[0][k] == v for k, v in kwargs.items())


def test_a_model_generates_the_same_tokens(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.decode.attention import NAME, use_grouped_decode_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw: dict[str, Any] = dict(max_new_tokens=12, do_sample=False, cache_implementation="static")
    kw.update(disable_compile=True, output_logits=True, return_dict_in_generate=True)
    want = model.generate(input_ids=ids, attention_mask=mask, **kw)
    note = use_grouped_decode_attention(model)
    assert note and model.config._attn_implementation == NAME
    got = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_models_without_grouped_heads_keep_their_attention(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.decode.attention import use_grouped_decode_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    assert use_grouped_decode_attention(model) is None
    assert model.config._attn_implementation == "eager"
