"""Planner fuzzing: random valid configs × every recorded profile × quantize / lora / max_memory.

For every drawn request, on every profile of :func:`xpukit.machine.profiles.profile_names`,
``plan_load`` either raises an :class:`~xpukit.errors.XpukitError` or returns a plan that satisfies
its own numbers (``MemoryEstimate`` in planning/loadplan.py, ``DeviceBudget`` in
planning/budgets.py):

- ``single``: ``weights + headroom <= budgets[0].usable``;
- ``split``: ``weights + headroom <= sum(usable)``, every ``weights_budget <= usable``,
  ``sum(weights_budget) >= weights``, and ``max_memory`` is exactly the weights budgets;
- ``offload``: every ``weights_budget <= usable`` and ``sum(weights_budget) >= weights`` (the
  accelerators' budgets plus what the host may hold);
- ``given`` (the user's ``max_memory``): ``weights <= sum(max_memory)`` unless ``"disk"`` is given;
  the headroom is the user's to leave.

Every plan also names only devices the machine has. The examples are derandomized, so CI sees the same
configs every run.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from xpukit.errors import XpukitError
from xpukit.machine.profiles import profile_names
from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.plan import plan_load

GiB = 2**30
ARCHS = ("qwen3", "llama", "qwen3_moe", "mixtral")


@st.composite
def configs(draw: Any) -> Any:
    """A valid transformers config of a decoder LLM, dense or mixture-of-experts."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    arch = draw(st.sampled_from(ARCHS))
    # Sizes from toy to 70B-class, so that every placement (single, split, offload) is reached.
    heads = draw(st.sampled_from([2, 8, 16, 32, 64]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    hidden = heads * head_dim
    common: dict[str, Any] = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([d for d in (1, 2, 4, 8, heads) if heads % d == 0])),
        "num_hidden_layers": draw(st.sampled_from([1, 2, 8, 24, 40, 64, 80])),
        "vocab_size": draw(st.integers(256, 200_000)),
        "intermediate_size": hidden * draw(st.sampled_from([2, 3, 4])),
        "tie_word_embeddings": draw(st.booleans()),
        "max_position_embeddings": draw(st.sampled_from([512, 4096, 32768, 131072])),
    }
    if arch in {"qwen3", "qwen3_moe"}:
        common["head_dim"] = head_dim
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    experts = draw(st.sampled_from([2, 4, 8, 16, 64]))
    per_token = draw(st.integers(1, min(experts, 8)))
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=per_token)
    return Qwen3MoeConfig(
        **common,
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=hidden // draw(st.sampled_from([1, 2, 4])),
    )


sizes = st.integers(1, 256).map(lambda n: f"{n}GiB")
max_memories = st.one_of(
    st.none(),
    st.none(),
    st.none(),
    st.dictionaries(st.sampled_from([0, 1, "cpu", "disk"]), sizes, min_size=1, max_size=3),
)
requests = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["auto", "bfloat16", "float16", "float32"]),
        "quantize": st.sampled_from([None, "4bit", "8bit", "auto"]),
        "lora": st.sampled_from([None, True, {"r": 8, "target_modules": ["q_proj", "v_proj"]}]),
        "max_memory": max_memories,
        "offload": st.booleans(),
    }
)


def check_numbers(plan: LoadPlan) -> None:
    """The plan's own numbers hold (module docstring)."""
    m = plan.memory
    assert m.weights > 0 and m.headroom >= 0 and m.budgets
    usable = sum(b.usable for b in m.budgets)
    budgets = [b.weights_budget for b in m.budgets]
    if m.placement == "single":
        assert m.weights + m.headroom <= m.budgets[0].usable
    elif m.placement in {"split", "offload"}:
        assert all(w is not None and w <= b.usable for w, b in zip(budgets, m.budgets, strict=True))
        assert sum(w or 0 for w in budgets) >= m.weights
        if m.placement == "split":
            assert m.weights + m.headroom <= usable
            assert plan.max_memory is not None and sorted(plan.max_memory.values()) == sorted(
                w or 0 for w in budgets
            )
    else:
        assert m.placement == "given" and plan.max_memory is not None
        assert "disk" in plan.max_memory or m.weights <= sum(
            v for k, v in plan.max_memory.items() if k != "disk"
        )
    names = {d.torch_device for d in plan.machine.devices} | {"cpu", "disk", "mps"}
    assert {b.device for b in m.budgets if m.placement != "given"} <= names
    accelerators = {d.index for d in plan.machine.devices}
    for key in plan.max_memory or {}:
        assert key in {"cpu", "disk", "mps"} or key in accelerators, (key, plan.max_memory)


def _llama(layers: int) -> Any:
    """A Llama-3-70B-like shape with ``layers`` layers (40: ~35 B, 80: ~70 B parameters)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=layers,
        vocab_size=128256,
    )


PLAIN = {"dtype": "auto", "quantize": None, "lora": None, "max_memory": None, "offload": True}


@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(config=configs(), request=requests)
@example(config=_llama(40), request=PLAIN)  # splits over the two stacks of a Max 1550
@example(config=_llama(80), request=PLAIN)  # offloads to CPU memory
@example(config=_llama(80), request=PLAIN | {"quantize": "auto", "lora": True})
def test_plans_raise_only_xpukit_errors_and_keep_their_numbers(config: Any, request: dict[str, Any]) -> None:
    for profile in profile_names():
        try:
            plan = plan_load(config, facts=profile, **request)
        except XpukitError:
            continue
        check_numbers(plan)
