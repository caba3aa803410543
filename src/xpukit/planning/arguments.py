"""The user's arguments to ``plan_load``, normalised and checked before anything is read.

transformers' own spellings (``torch_dtype``, ``attn_implementation``, ``quantization_config``,
``use_kernels``) are accepted, never together with xpukit's; devices, budgets and classes are
validated so that a typo is refused with the valid choices.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.machine.precision import DTYPES, normalize_dtype
from xpukit.planning.budgets import parse_size
from xpukit.planning.device.choice import DEVICE_PATTERN
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.training.lora_request import LoraRequest
    from xpukit.sources.hub_access import HubFacts

__all__ = [
    "check_keywords",
    "check_lora_targets",
    "check_model_class",
    "check_seed",
    "device_of_map",
    "host_modules_reason",
    "normalize_dtype_arg",
    "normalize_max_memory",
    "parse_device",
    "reconcile",
    "seed_decision",
]


def reconcile(kwargs: dict[str, Any], **ours: object) -> tuple[object, object, object, object]:
    """Accept transformers' own keyword for each choice, but never both spellings at once."""
    dtype, attn, quantize, kernels = ours["dtype"], ours["attn"], ours["quantize"], ours["kernels"]
    for legacy in ("load_in_4bit", "load_in_8bit"):
        if kwargs.get(legacy):
            bits = legacy[len("load_in_") :]
            raise InvalidRequestError(
                f"{legacy}=True is not a from_pretrained argument in transformers 5. Fix: quantize='{bits}'."
            )
        kwargs.pop(legacy, None)
    pairs = (
        ("torch_dtype", "dtype", dtype, "auto"),
        ("attn_implementation", "attn", attn, "auto"),
        ("quantization_config", "quantize", quantize, None),
    )
    values = {"dtype": dtype, "attn": attn, "quantize": quantize}
    for theirs, mine, value, default in pairs:
        if theirs in kwargs:
            other = kwargs.pop(theirs)
            if value is not default and value != default:
                raise InvalidRequestError(
                    f"Both {mine}={value!r} and {theirs}={other!r} were given. Fix: pass only {mine}=."
                )
            values[mine] = other
    use_kernels = kwargs.pop("use_kernels", None)
    kernel_config = kwargs.pop("kernel_config", None)
    if (use_kernels is not None or kernel_config is not None) and kernels != "auto":
        raise InvalidRequestError(
            f"Both kernels={kernels!r} and use_kernels/kernel_config were given. Fix: pass only kernels=."
        )
    if kernel_config is not None:
        kernels = kernel_config
    elif use_kernels is not None:
        kernels = bool(use_kernels)
    return values["dtype"], values["attn"], values["quantize"], kernels


def normalize_dtype_arg(value: object) -> str:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    name = normalize_dtype(value)
    if name is None:
        raise InvalidRequestError(
            f"dtype={value!r} is not a dtype xpukit loads weights in. Valid: 'auto', "
            f"{', '.join(map(repr, DTYPES))} "
            "(or torch.bfloat16 …). Integer weights come from quantize='8bit' / '4bit'."
        )
    return name


def normalize_max_memory(value: dict[Any, Any] | None) -> dict[int | str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise InvalidRequestError(
            f"max_memory={value!r} must be a non-empty dict such as {{0: '10GiB', 'cpu': '30GiB'}}."
        )
    out: dict[int | str, int] = {}
    for key, size in value.items():
        text = str(key).strip().lower()
        match = DEVICE_PATTERN.match(text)
        if isinstance(key, int) or text.isdigit():
            norm: int | str = int(text)
        elif text in {"cpu", "mps", "disk"}:
            norm = text
        elif match and match["backend"] in {"xpu", "cuda"}:
            norm = int(match["index"] or 0)
        else:
            raise InvalidRequestError(
                f"max_memory key {key!r} is not a device. Use accelerator indices (0, 1, 'xpu:1'), "
                "'cpu', 'mps' or 'disk'."
            )
        out[norm] = parse_size(size, f"max_memory[{key!r}]")
    return out


def parse_device(device: object) -> str | None:
    if device is None:
        return None
    text = str(device).strip().lower()
    if not DEVICE_PATTERN.match(text):
        raise InvalidRequestError(
            f"device={device!r} is not a device. Valid: 'xpu', 'xpu:1', 'cuda', 'cuda:0', 'mps', "
            "'cpu' or a torch.device."
        )
    return text


def check_model_class(model_class: object) -> str | None:
    """The class name; a string must name a transformers class (checked before anything is read)."""
    if model_class is None:
        return None
    if not isinstance(model_class, str):
        if not isinstance(model_class, type) or not callable(getattr(model_class, "from_pretrained", None)):
            raise InvalidRequestError(
                f"model_class={model_class!r} has no from_pretrained. Pass a transformers model class "
                "(AutoModelForCausalLM, Qwen3ForCausalLM…) or its name."
            )
        return model_class.__name__
    import transformers

    try:
        cls = getattr(transformers, model_class)
    except (AttributeError, ImportError, RuntimeError):
        cls = None
    if cls is None or not callable(getattr(cls, "from_pretrained", None)):
        candidates = [n for n in dir(transformers) if n.startswith(("AutoModel", model_class[:4]))]
        close = difflib.get_close_matches(model_class, candidates, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise InvalidRequestError(
            f"model_class={model_class!r} is not a transformers model class.{hint} Valid: an Auto class "
            "such as 'AutoModelForCausalLM', 'AutoModelForSeq2SeqLM', 'AutoModelForImageTextToText', or "
            "a model class such as 'Qwen3ForCausalLM'."
        )
    return model_class


def device_of_map(device_map: dict[Any, Any], device_text: str | None, machine: MachineFacts) -> str | None:
    """The device a dict device_map puts every module on (dtype, attention, kernels follow it)."""
    targets = set()
    for value in device_map.values():
        if isinstance(value, int) and not isinstance(value, bool):
            value = f"{machine.accelerator}:{value}"
        text = str(value).strip().lower()
        targets.add("cpu" if text == "disk" else text)
    if len(targets) != 1:
        return device_text
    (only,) = targets
    if not DEVICE_PATTERN.match(only):
        return device_text  # plan_layout names the bad value
    if only in {"xpu", "cuda"}:
        only += ":0"
    if device_text is not None and device_text not in {only, only.split(":")[0]}:
        raise InvalidRequestError(
            f"device={device_text!r} but device_map puts every module on {only!r}. Fix: pass one of them."
        )
    return only


def host_modules_reason(
    device_map: object, max_memory: dict[int | str, int] | None, main: DeviceFacts
) -> str | None:
    """Why some modules run on the CPU, disk or MPS while the main device is an accelerator, else None.

    Hub attention and layer kernels run on xpu/cuda only; a module placed elsewhere would call them
    with tensors they have no build for.
    """
    if main.backend in {"cpu", "mps"}:
        return None
    if isinstance(device_map, dict):
        elsewhere = sorted({str(v).strip().lower() for v in device_map.values()} & {"cpu", "disk", "mps"})
        if elsewhere:
            return f"the given device_map puts modules on {', '.join(elsewhere)}"
    if max_memory and any(k in {"cpu", "disk"} for k in max_memory):
        return "the plan offloads weights to CPU memory"
    return None


def check_lora_targets(
    request: LoraRequest | None, facts: ModelFacts, *, enforce: bool, hub: HubFacts
) -> tuple[str, ...]:
    """Check the LoRA settings and targets against the model's facts, before any weight is read
    (peft imported under ``hub.import_offline``: its import can reach the Hub); the warnings (peft
    missing on an assumed machine: nothing checked)."""
    if request is None or request.kind != "new":
        return ()
    from xpukit._compat import is_installed, require
    from xpukit.planning.training.lora_config import check_lora_request

    if not is_installed("peft"):
        if enforce:
            require("peft", "lora=True")  # MissingExtraError naming the extra
        return ("peft is not installed here: the LoRA settings were not checked against the model",)
    with hub.import_offline("peft"):  # peft imports bitsandbytes, whose import can reach the Hub
        check_lora_request(request, facts)
    return ()


def check_seed(seed: object) -> int | None:
    """``seed=`` as an int (``None`` stays ``None``); anything else is refused before anything is read."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise InvalidRequestError(
            f"seed={seed!r} is not a seed. Valid: an int from 0 to 2**32 - 1 (numpy's range), or None "
            "for unseeded adapter initialisation. Fix: seed=7 (the same as training_args(seed=7))."
        )
    return seed


def seed_decision(seed: int | None, *, new_adapters: bool) -> Decision:
    """The ``seed`` decision: whether the random initialisation of new LoRA adapters repeats."""
    if seed is None:
        return Decision(
            name="seed",
            value=None,
            reason="not given: the LoRA adapters' random initialisation is unseeded, so two runs differ. "
            'Pass seed=N (docs/training.md "Reproducible runs")',
        )
    reason = (
        f"seed={seed} given: transformers.set_seed({seed}) right before the LoRA adapters are created, "
        "so their initialisation repeats"
        if new_adapters
        else f"seed={seed} given, but nothing random runs at this load (no new LoRA adapters): not applied"
    )
    return Decision(name="seed", value=seed, reason=reason, source="user")


def check_keywords(
    kwargs: dict[str, Any], config: PreTrainedConfig, consumed: Iterable[str], *, ours: Iterable[str]
) -> None:
    """Refuse a keyword that is neither xpukit's, nor ``from_pretrained``'s, nor the config's, with the
    closest names; before any weight is read (docs/planning.md "Keywords").

    ``from_pretrained`` hands a keyword it does not know to the model's ``__init__``, which fails with
    a ``TypeError`` after the checkpoint was opened (``quantise="4bit"``, ``devcie="cpu"``). A model
    with its own code (``trust_remote_code=True``) may take any keyword: not checked.
    """
    consumed = set(consumed)
    left = [k for k in kwargs if k not in consumed and not hasattr(config, k)]
    if not left or kwargs.get("trust_remote_code"):
        return  # nothing to check: transformers' modeling code is not imported for it
    from xpukit.machine.library_source import from_pretrained_keywords

    keywords = from_pretrained_keywords()  # the installed transformers' (read once per process)
    if keywords is None:
        return
    accepted, named = keywords
    unknown = [k for k in left if k not in accepted]
    if not unknown:
        return
    ours = sorted(ours)
    parts = []
    for key in unknown:
        field = _lora_field(key)
        if field is not None:  # a LoRA setting given flat: it goes inside lora=
            parts.append(f"{key}={kwargs[key]!r} (did you mean lora={{{field!r}: {kwargs[key]!r}}}?)")
            continue
        close = difflib.get_close_matches(key, list(dict.fromkeys([*ours, *sorted(named)])), n=2, cutoff=0.7)
        parts.append(f"{key}={kwargs[key]!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    raise InvalidRequestError(
        f"Unknown keyword{'s' if len(parts) > 1 else ''}: {', '.join(parts)}: neither xpukit's, nor "
        f"from_pretrained's, nor an attribute of the {getattr(config, 'model_type', '') or 'model'} config, "
        "so from_pretrained would pass it to the model's __init__, which fails with a TypeError. "
        f"xpukit's keywords: {', '.join(ours)}."
    )


# LoRA settings a user may give as keywords of their own; they belong in lora= (a LoraConfig field).
_LORA_FIELDS = {
    "lora_r": "r",
    "lora_rank": "r",
    "rank": "r",
    "r": "r",
    "lora_alpha": "lora_alpha",
    "alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "target_modules": "target_modules",
    "lora_target_modules": "target_modules",
    "lora_targets": "target_modules",
}


def _lora_field(key: str) -> str | None:
    """The ``LoraConfig`` field a stray keyword names (``lora_r`` → ``r``), else ``None``."""
    return _LORA_FIELDS.get(key)
