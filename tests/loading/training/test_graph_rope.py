"""liger-kernel's RoPE inside the layer graphs (loading/training/graph_rope.py) on the CPU: the check
against each family's own ``apply_rotary_pos_emb`` and the swap that holds only while the graphs
capture. liger's Triton kernel cannot run on a CPU, so a plain PyTorch function that computes what
liger's kernel computes (the rotary width taken from ``cos``, the rest passed through) stands in
for it; the H200 runs liger's own (docs/layer-graphs.md "RoPE in the layer graphs")."""

from __future__ import annotations

import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def half_rope(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1) -> Any:
    """liger's formula: the first ``cos.shape[-1]`` dims rotated as two halves, the rest untouched."""
    width = cos.shape[-1]
    c, s = cos.unsqueeze(unsqueeze_dim)[..., : width // 2], sin.unsqueeze(unsqueeze_dim)[..., : width // 2]

    def rotate(x: Any) -> Any:
        x1, x2, rest = x[..., : width // 2], x[..., width // 2 : width], x[..., width:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    return rotate(q), rotate(k)


def pairs_rope(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1) -> Any:
    """Another RoPE: adjacent pairs rotated (GLM-4's layout), not halves."""
    c, s = cos.unsqueeze(unsqueeze_dim)[..., ::2], sin.unsqueeze(unsqueeze_dim)[..., ::2]

    def rotate(x: Any) -> Any:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)

    return rotate(q), rotate(k)


def _layers(family: str, n: int = 2, **extra: Any) -> tuple[list[Any], tuple[Any, Any]]:
    """``n`` tiny decoder layers of ``family`` and the position embeddings their attention gets."""
    import importlib

    import transformers

    config_class = {"llama": "LlamaConfig", "phi3": "Phi3Config", "glm4": "Glm4Config"}[family]
    config = getattr(transformers, config_class)(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=n,
        vocab_size=64,
        **extra,
    )
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    layer_class = next(v for k, v in vars(module).items() if k.endswith("DecoderLayer"))
    rotary_class = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding"))
    layers = [layer_class(config, i) for i in range(n)]
    hidden = torch.randn(2, 5, 32)
    cos, sin = rotary_class(config)(hidden, torch.arange(5).unsqueeze(0).expand(2, 5))
    return layers, (cos, sin)


def _calls(layers: list[Any], embeddings: Any) -> list[tuple[Any, dict[str, Any]]]:
    return [((), {"position_embeddings": embeddings, "attention_mask": None}) for _ in layers]


def _rope(monkeypatch: pytest.MonkeyPatch, layers: list[Any], fn: Any, *, wanted: bool = True) -> Any:
    from xpukit.loading.training import graph_rope

    monkeypatch.setattr(graph_rope, "_liger_rope", lambda: fn)
    return graph_rope.GraphRope(layers, wanted=wanted)


@pytest.mark.parametrize(("family", "extra"), [("llama", {}), ("phi3", {"partial_rotary_factor": 0.5})])
def test_the_same_function_is_taken_and_put_in_place_only_while_swapped(
    monkeypatch: pytest.MonkeyPatch, family: str, extra: dict[str, Any]
) -> None:
    layers, embeddings = _layers(family, **extra)
    rope = _rope(monkeypatch, layers, half_rope)
    module = sys.modules[type(layers[0].self_attn).__module__]
    own = module.apply_rotary_pos_emb
    rope.decide(_calls(layers, embeddings))
    assert rope.active, rope.note
    assert "liger-kernel's RoPE in the graphs' replays" in rope.note and module.__name__ in rope.note
    assert module.apply_rotary_pos_emb is own  # deciding changes nothing
    with rope.swapped():
        assert module.apply_rotary_pos_emb is half_rope
    assert module.apply_rotary_pos_emb is own
    with pytest.raises(RuntimeError), rope.swapped():  # put back when the capture raises, too
        raise RuntimeError("capture failed")
    assert module.apply_rotary_pos_emb is own


def test_another_function_is_refused_with_the_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    """liger's halves against GLM-4's adjacent pairs: the family keeps its own RoPE."""
    layers, embeddings = _layers("glm4", partial_rotary_factor=0.5)
    rope = _rope(monkeypatch, layers, half_rope)
    module = sys.modules[type(layers[0].self_attn).__module__]
    own = module.apply_rotary_pos_emb
    rope.decide(_calls(layers, embeddings))
    assert not rope.active
    assert "differs from transformers.models.glm4.modeling_glm4.apply_rotary_pos_emb by" in rope.note
    with rope.swapped():
        assert module.apply_rotary_pos_emb is own


def test_the_check_compares_gradients_and_outputs() -> None:
    from xpukit.loading.training.graph_rope import TOLERANCE, rope_difference

    _, (cos, sin) = _layers("llama")
    assert rope_difference(half_rope, half_rope, cos, sin, 8) == 0.0
    assert rope_difference(half_rope, pairs_rope, cos, sin, 8) > 0.1

    def scaled_grad(q: Any, k: Any, cos: Any, sin: Any) -> Any:  # right outputs, wrong gradients
        q2, k2 = half_rope(q, k, cos, sin)
        return q2 + 1e-2 * (q - q.detach()), k2

    assert rope_difference(half_rope, scaled_grad, cos, sin, 8) > TOLERANCE


def test_decided_once_and_not_when_unwanted_or_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    layers, embeddings = _layers("llama")
    off = _rope(monkeypatch, layers, half_rope, wanted=False)
    off.decide(_calls(layers, embeddings))
    assert not off.active and "turned off" in off.note
    missing = _rope(monkeypatch, layers, None)
    missing.decide(_calls(layers, embeddings))
    assert not missing.active and "cannot be imported" in missing.note
    rope = _rope(monkeypatch, layers, pairs_rope)
    rope.decide(_calls(layers, embeddings))
    assert not rope.active
    from xpukit.loading.training import graph_rope

    monkeypatch.setattr(graph_rope, "_liger_rope", lambda: half_rope)
    rope.decide(_calls(layers, embeddings))  # the first capture decided
    assert not rope.active
    failing = _rope(monkeypatch, layers, lambda *a, **k: 1 / 0)
    failing.decide(_calls(layers, embeddings))
    assert not failing.active and "ZeroDivisionError" in failing.note
    no_embeddings = _rope(monkeypatch, layers, half_rope)
    no_embeddings.decide([((), {}) for _ in layers])
    assert not no_embeddings.active and "cannot check LlamaAttention's" in no_embeddings.note


def test_a_capture_that_fails_with_it_runs_once_more_without(monkeypatch: pytest.MonkeyPatch) -> None:
    layers, embeddings = _layers("llama")
    rope = _rope(monkeypatch, layers, half_rope)
    rope.decide(_calls(layers, embeddings))
    module = sys.modules[type(layers[0].self_attn).__module__]
    seen: list[Any] = []

    def capture() -> str:
        seen.append(module.apply_rotary_pos_emb)
        if module.apply_rotary_pos_emb is half_rope:
            raise RuntimeError("in-place write on a saved tensor")
        return "captured"

    assert rope.run(capture, keep=KeyError) == "captured"
    assert seen[0] is half_rope and seen[1] is not half_rope and not rope.active
    assert "a capture failed with liger-kernel's: RuntimeError: in-place write" in rope.note
    assert rope.run(capture, keep=KeyError) == "captured" and len(seen) == 3  # off from then on

    again = _rope(monkeypatch, layers, half_rope)
    again.decide(_calls(layers, embeddings))

    def nothing() -> None:
        raise KeyError("nothing to train")

    with pytest.raises(KeyError):
        again.run(nothing, keep=KeyError)  # not a failure of liger's: passed on, liger's stays
    assert again.active


def _family_calls(family: str) -> tuple[list[Any], list[tuple[Any, dict[str, Any]]]]:
    """The decoder layers of a tiny model of ``family`` (tests/loading/training/test_fused_lora.py's
    configs) and the
    arguments each received in one forward."""
    import transformers
    from test_fused_lora import _SMALL, FAMILIES

    config_class, extra = FAMILIES[family]
    extra = {k: v for k, v in extra.items() if k != "attn_implementation"}
    config = getattr(transformers, config_class)(**{**_SMALL, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layers = list(model.model.layers)
    calls: list[tuple[Any, dict[str, Any]]] = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, k: calls.append((a, dict(k))), with_kwargs=True)
        for layer in layers
    ]
    with torch.no_grad():
        model(input_ids=torch.arange(3, 15).reshape(2, 6))
    for hook in hooks:
        hook.remove()
    return layers, calls


@pytest.mark.parametrize(
    "family",
    [
        "gemma1",
        "gemma2",
        "gemma3",
        "granite",
        "olmo2",
        "qwen3",
        "smollm3",
        "mistral-swa",
        "phi3",
        "glm4",
        "qwen3-moe",
        "mixtral",
    ],
)
def test_every_fused_family_takes_the_halves_formula_but_glm4(
    monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """Each family the fused path covers, checked as at its first capture with liger's formula: all
    rotate halves (liger's kernel is taken), GLM-4 rotates adjacent pairs (its own RoPE stays)."""
    layers, calls = _family_calls(family)
    rope = _rope(monkeypatch, layers, half_rope)
    rope.decide(calls)
    assert rope.active == (family != "glm4"), rope.note
