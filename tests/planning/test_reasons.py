"""Every reason tells the truth about who decided (docs/planning.md "Who decided").

Plans are built with and without each explicit option. A decision the user's argument made has
``source="user"`` and a reason that names the argument (``device='cuda:0' given``); the same decision
without the argument is the plan's (``auto``) and its reason claims no user choice.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from xpukit import plan_load
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.vocabulary import Decision

CONFIG = reference_config("qwen3-0.6b")
TRAIN = {"lora": True, "batch_size": 2, "seq_len": 128}

# (case, keyword arguments, the decision the argument makes, the words its reason must contain,
#  the keywords of the same plan without that argument)
CASES: list[tuple[str, dict[str, Any], str, str, dict[str, Any]]] = [
    ("device", {"device": "cuda:0"}, "device", "device='cuda:0' given", {}),
    ("device-backend", {"device": "cuda"}, "device", "device='cuda' given", {}),
    ("dtype", {"dtype": "float16"}, "dtype", "dtype='float16' given", {}),
    ("attn", {"attn": "eager"}, "attn_implementation", "attn='eager' given", {}),
    ("kernels", {"kernels": False}, "use_kernels", "kernels=False given", {}),
    ("quantize", {"quantize": "4bit"}, "quantization", "quantize='4bit' given", {}),
    ("max_memory", {"max_memory": {0: "10GiB"}}, "max_memory", "max_memory= given", {}),
    ("device_map", {"device_map": "cuda:0"}, "device_map", "device_map=", {}),
    ("headroom", {"headroom": "1GiB"}, "headroom", "headroom= given", {}),
    ("strategy", {"strategy": "ddp"}, "strategy", "strategy='ddp' given", {}),
    ("fast_decode", {"fast_decode": True}, "fast_decode", "fast_decode=True given", {}),
    ("seed", {**TRAIN, "seed": 3}, "seed", "seed=3 given", TRAIN),
    (
        "gradient_checkpointing",
        {**TRAIN, "lora": {"gradient_checkpointing": True}},
        "gradient_checkpointing",
        "lora={'gradient_checkpointing': True} given",
        TRAIN,
    ),
    ("liger", {**TRAIN, "lora": {"liger": False}}, "liger", "lora={'liger': False} given", TRAIN),
    (
        "fused",
        {**TRAIN, "quantize": "4bit", "lora": {"fused": False}},
        "fused_lora",
        "lora={'fused': False} given",
        {**TRAIN, "quantize": "4bit"},
    ),
]

# What a reason may say only when the user made the choice: "X= given", "asked", "says so", "your".
_CLAIM = re.compile(r"\b\w+=(?:\{[^}]*\}|\S*) given\b|\basked\b|says so|\byour\b")
# Negations and causes are not claims: "no quantize= given", "not given", "from the given max_memory".
_NOT_A_CLAIM = re.compile(r"\bno \w+=\S* given\b|\bnot given\b|the given \w+")


def claims_user(reason: str) -> bool:
    """Whether ``reason`` presents the choice as the user's."""
    return bool(_CLAIM.search(_NOT_A_CLAIM.sub("", reason)))


def _plan(**kwargs: Any) -> Any:
    return plan_load(CONFIG, facts="h200", **kwargs)


def _find(plan: Any, name: str) -> Decision | None:
    return next((d for d in plan.decisions if d.name == name), None)


@pytest.mark.parametrize(("case", "kwargs", "name", "words", "without"), CASES, ids=[c[0] for c in CASES])
def test_the_users_choice_is_named_as_the_users(
    case: str, kwargs: dict[str, Any], name: str, words: str, without: dict[str, Any]
) -> None:
    with_it = _find(_plan(**kwargs), name)
    assert with_it is not None, f"{case}: no {name} decision"
    assert with_it.source == "user", f"{case}: {name} is the user's: {with_it}"
    assert words in with_it.reason, f"{case}: {with_it.reason!r} does not name the argument"
    plain = _find(_plan(**without), name)
    if plain is not None:  # the same decision when the plan makes it
        assert plain.source != "user", f"{case}: without the argument {name} is not the user's"
        assert not claims_user(plain.reason), f"{case}: the plan's {name} claims a user choice: {plain}"


ALL_PLANS = [kw for _, kw, _, _, _ in CASES] + [{}, TRAIN, {**TRAIN, "quantize": "4bit"}]


@pytest.mark.parametrize("kwargs", ALL_PLANS, ids=lambda kw: ",".join(sorted(kw)) or "defaults")
def test_no_plan_decision_claims_the_user_decided(kwargs: dict[str, Any]) -> None:
    for d in _plan(**kwargs).decisions:
        if d.source == "auto":
            # The plan may cite the user's argument as the cause ("quantize='auto': ...") but never
            # presents its own choice as asked for.
            assert not claims_user(d.reason), d
        elif d.source == "user":
            assert claims_user(d.reason), f"a user's choice not named as the user's: {d}"


def test_the_claim_check_is_not_vacuous() -> None:
    assert claims_user("device='cuda:0' given") and claims_user("lora={'liger': False} given")
    assert claims_user("asked") and claims_user("your LoraConfig, as is")
    assert not claims_user("full precision: no quantize= given") and not claims_user("not given: unseeded")
    assert not claims_user("quantize='auto': not needed, the model fits as it is")


def test_liger_off_names_who_chose_it() -> None:
    """The reported case: lora=True, the plan turned liger off, the note said lora={'liger': False}."""
    from xpukit.machine.profiles import device_profile
    from xpukit.planning.training.liger import decide_liger

    h200 = device_profile("h200")
    common: dict[str, Any] = {"liger_version": "0.8.5", "triton": True, "supported_types": None}
    by_plan = decide_liger(h200, "qwen3", wanted=False, given=False, **common)
    by_user = decide_liger(h200, "qwen3", wanted=False, given=True, **common)
    assert "lora={'liger': False}" not in by_plan.reason and "training plan" in by_plan.reason
    assert "lora={'liger': False} given" in by_user.reason


def test_explain_tags_only_fallbacks() -> None:
    text = _plan(device="cuda:0").explain()
    assert "device='cuda:0' given" in text and "(asked)" not in text
