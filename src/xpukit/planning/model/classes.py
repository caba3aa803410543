"""Which transformers class loads a model, and what the LoRA task is for that class (pure).

The class comes from ``model_class=`` or, when not given, from the ``architectures`` the checkpoint's
config names (the class that saved it), mapped to the Auto class whose mapping builds that class for
the config's ``model_type``: a sequence-classification checkpoint loads as
``AutoModelForSequenceClassification``, a T5 checkpoint as ``AutoModelForSeq2SeqLM``, a BERT encoder
as ``AutoModel``. Only a config that names no architecture (one built in code) falls back to the
first Auto class that knows its type, causal LMs first. The plan records the choice as a
``model_class`` decision with its reason (docs/planning.md "Model class (`model_class=`)").

The LoRA task follows the class (:func:`fit_lora_to_class`): ``SEQ_CLS`` / ``TOKEN_CLS`` /
``QUESTION_ANS`` with the task head trained in full (``modules_to_save``, and kept out of 4-bit),
``SEQ_2_SEQ_LM``, ``FEATURE_EXTRACTION`` for a base model, ``CAUSAL_LM`` for causal and
image-text-to-text models; on a VLM the adapters go on the language model's linear layers only.
A peft ``CAUSAL_LM`` adapter on a model without ``generate`` fails inside peft
(docs/known-issues.md "peft: the task type must match the model class").
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from xpukit.errors import InvalidRequestError
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = [
    "AUTO_KINDS",
    "AutoKind",
    "ClassFacts",
    "ModelClassChoice",
    "auto_class_for",
    "build_meta_model",
    "choose_model_class",
    "class_facts",
    "unexpected_weights_problem",
]


@dataclass(frozen=True, slots=True)
class AutoKind:
    """One transformers Auto class: the mapping that lists what it builds, and its peft task."""

    auto_class: str
    mapping: str  # in transformers.models.auto.modeling_auto: model_type -> class name(s)
    task_type: str | None  # peft TaskType; None: a plain PeftModel
    head: bool = False  # a task head trained in full with LoRA (modules_to_save), kept out of 4-bit


# Looked up in this order for a class name; a VLM class that transformers also lists as a causal LM
# (Gemma3ForConditionalGeneration) is an image-text-to-text model.
AUTO_KINDS: tuple[AutoKind, ...] = (
    AutoKind("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "CAUSAL_LM"),
    AutoKind("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "CAUSAL_LM"),
    AutoKind("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "SEQ_2_SEQ_LM"),
    AutoKind(
        "AutoModelForSequenceClassification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "SEQ_CLS",
        True,
    ),
    AutoKind(
        "AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "TOKEN_CLS", True
    ),
    AutoKind(
        "AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "QUESTION_ANS", True
    ),
    AutoKind("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", None),
    AutoKind("AutoModel", "MODEL_MAPPING_NAMES", "FEATURE_EXTRACTION"),
    AutoKind("AutoModelForTextEncoding", "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES", "FEATURE_EXTRACTION"),
)
_BY_AUTO = {kind.auto_class: kind for kind in AUTO_KINDS}
# A config that names no architecture: the first of these that knows its type (causal LMs first).
_FALLBACK_ORDER = (
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForSeq2SeqLM",
    "AutoModel",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelClassChoice:
    """The class a load uses.

    Attributes:
        name: what ``from_pretrained`` is called on: an Auto class or a model class name.
        kind: the Auto kind of that class (task type, head), ``None`` when no Auto class lists it.
        decision: the ``model_class`` decision for the plan.
        cls: the class object the user passed, when not a name.
    """

    name: str
    kind: AutoKind | None
    decision: Decision
    cls: type[PreTrainedModel] | None = None

    @property
    def task_type(self) -> str | None:
        """The peft task type for LoRA on this class."""
        return self.kind.task_type if self.kind is not None else None


def _names(mapping: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, mapping, None) or {})


def _kind_building(class_name: str, model_type: str | None) -> AutoKind | None:
    """The first Auto kind that builds ``class_name`` (for ``model_type`` when given)."""
    for kind in AUTO_KINDS:
        for key, value in _names(kind.mapping).items():
            values = value if isinstance(value, (tuple, list)) else (value,)
            if class_name in values and (model_type is None or key == model_type):
                return kind
    return None


def auto_class_for(config: PreTrainedConfig) -> str:
    """The Auto class for a config that names no architecture: the first that knows its type.

    Raises:
        InvalidRequestError: no Auto class builds this config.
    """
    from transformers.models.auto import modeling_auto

    for auto_name in _FALLBACK_ORDER:
        mapping = getattr(modeling_auto, _BY_AUTO[auto_name].mapping.removesuffix("_NAMES"), None)
        if mapping is not None and type(config) in mapping:
            return auto_name
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_name in _FALLBACK_ORDER:
        if auto_name in auto_map:
            return auto_name
    raise InvalidRequestError(
        f"No transformers Auto class loads a {type(config).__name__} (model_type "
        f"{getattr(config, 'model_type', None)!r}) that names no architecture. xpukit then tries "
        f"{', '.join(_FALLBACK_ORDER)}. Fix: pass model_class=<the transformers class>."
    )


def choose_model_class(
    config: PreTrainedConfig, model_class: type[PreTrainedModel] | str | None = None
) -> ModelClassChoice:
    """Decide the class: ``model_class=`` when given, else the config's ``architectures``.

    Args:
        config: the model's config.
        model_class: the user's class or class name (checked by ``check_model_class``), or ``None``.

    Returns:
        The choice, with its ``model_class`` decision.

    Raises:
        InvalidRequestError: no Auto class builds a config that names no architecture.
    """
    model_type = getattr(config, "model_type", None)
    saved, saved_kind = _saved_class(config)
    if model_class is not None:
        name = model_class if isinstance(model_class, str) else model_class.__name__
        kind = _BY_AUTO.get(name) or _kind_building(name, None)
        same = saved is not None and (name == saved or (kind is not None and kind.auto_class == saved))
        if saved is None or same:
            why = f"model_class={name!r} was given"
        else:
            why = (
                f"model_class={name!r} was given; the checkpoint's config names {_arch(config)} "
                f"(loaded by {saved}). A weight {name} cannot take is refused at load, not dropped"
            )
        decision = Decision(name="model_class", value=name, reason=why, source="user")
        return ModelClassChoice(
            name=name, kind=kind, decision=decision, cls=None if isinstance(model_class, str) else model_class
        )
    if saved is not None:
        reason = f"the config's architectures names {_arch(config)}"
        if saved_kind is not None:
            reason += f": {saved} builds it for model_type {model_type!r}"
        fallback = auto_class_for(config) if _fallback_knows(config) else None
        rejected: tuple[tuple[object, str], ...] = ()
        if fallback is not None and fallback != saved:
            rejected = ((fallback, f"would not build {_arch(config)}: its weights would not all load"),)
        decision = Decision(name="model_class", value=saved, reason=reason, rejected=rejected)
        return ModelClassChoice(name=saved, kind=saved_kind, decision=decision)
    name = auto_class_for(config)
    decision = Decision(
        name="model_class",
        value=name,
        reason=f"the config names no architecture: the first Auto class that builds {type(config).__name__}",
    )
    return ModelClassChoice(name=name, kind=_BY_AUTO[name], decision=decision)


def _arch(config: PreTrainedConfig) -> str:
    return str((getattr(config, "architectures", None) or ["?"])[0])


def _saved_class(config: PreTrainedConfig) -> tuple[str | None, AutoKind | None]:
    """The class to load a config's first architecture with, and its kind."""
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        return None, None
    arch = str(architectures[0])
    kind = _kind_building(arch, getattr(config, "model_type", None))
    if kind is not None:
        return kind.auto_class, kind
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_name, ref in auto_map.items():  # remote code: {"AutoModelForX": "modeling_x.XClass"}
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        if any(isinstance(r, str) and r.rsplit(".", 1)[-1] == arch for r in refs) and auto_name in _BY_AUTO:
            return auto_name, _BY_AUTO[auto_name]
    import transformers

    if callable(getattr(getattr(transformers, arch, None), "from_pretrained", None)):
        return arch, _kind_building(arch, None)
    return None, None


def _fallback_knows(config: PreTrainedConfig) -> bool:
    try:
        auto_class_for(config)
    except InvalidRequestError:
        return False
    return True


def build_meta_model(
    config: PreTrainedConfig, model_class: type[PreTrainedModel] | str | None, *, trust_remote_code: bool
) -> tuple[str, PreTrainedModel]:
    """Build the model ``model_class`` (a name or class) loads, on the meta device; return its Auto kind.

    Built on the meta device: no memory, no init cost (0.04 s for an 8B shape), and tied weights stay
    tied. "eager" keeps transformers from checking (or fetching) an attention implementation the
    config may name.
    """
    import torch
    import transformers

    choice = choose_model_class(config, model_class)
    cls = choice.cls if choice.cls is not None else getattr(transformers, choice.name)
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "attn_implementation": "eager"}
    with torch.device("meta"):
        if hasattr(cls, "from_config"):  # an Auto class
            model = cls.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code, **kwargs)
        else:
            model = cls._from_config(copy.deepcopy(config), **kwargs)
    return (choice.kind.auto_class if choice.kind is not None else choice.name), model


class ClassFacts(TypedDict, total=False):
    """What :func:`class_facts` finds (each key only where it applies; :class:`ModelFacts` fields)."""

    head_modules: tuple[str, ...]
    quantization_skip: tuple[str, ...]
    language_model: str
    language_linear_layers: tuple[str, ...]


def class_facts(model: PreTrainedModel, auto_class: str) -> ClassFacts:
    """Facts that follow from the model's class: its task head and, for a VLM, its language model.

    Returns:
        ``head_modules`` (the top-level modules with weights beside the base model, for classes with
        a task head), ``quantization_skip`` (the modules bitsandbytes must leave unquantized so the
        head can be trained: transformers' default skip list plus the head), ``language_model``
        (the module path of a VLM's language model) and ``language_linear_layers`` (the names of its
        linear layers).
    """
    import torch
    from transformers import PreTrainedModel as Base
    from transformers.quantizers.base import get_keys_to_not_convert

    out: ClassFacts = {}
    kind = _BY_AUTO.get(auto_class)
    base = getattr(model, str(getattr(model, "base_model_prefix", "") or "-"), None)
    if kind is not None and kind.head and isinstance(base, torch.nn.Module):
        heads = tuple(
            name
            for name, child in model.named_children()
            if child is not base and any(True for _ in child.parameters())
        )
        out["head_modules"] = heads
        out["quantization_skip"] = tuple(sorted(set(get_keys_to_not_convert(model)) | set(heads)))
    vision = getattr(model.config, "vision_config", None)
    text_type = type(model.config.get_text_config())
    if vision is not None and text_type is not type(model.config):
        for name, module in model.named_modules():
            if name and isinstance(module, Base) and type(module.config) is text_type:
                linear = {
                    sub.rsplit(".", 1)[-1]
                    for sub, m in module.named_modules()
                    if sub and isinstance(m, torch.nn.Linear)
                }
                out["language_model"] = name
                out["language_linear_layers"] = tuple(sorted(linear))
                break
    return out


def unexpected_weights_problem(
    name: str,
    loaded_as: str,
    keys: Iterable[object] | None,
    config: PreTrainedConfig,
    *,
    base_prefix: str,
    user_class: bool,
) -> tuple[str | None, str | None]:
    """Whether a load that left checkpoint weights unused is refused: ``(refusal, note)``.

    Refused, with the class that takes every weight as the fix, unless the user named the class and
    every unused weight is the saved model's head (outside its base model ``base_prefix``): an LM
    head replaced by a classifier (a causal LM loaded as ``AutoModelForSequenceClassification`` for
    a reward model) or a head dropped for embeddings (``AutoModel``). That is then a note, never
    silent. A weight of the base model itself is always refused.
    """
    unused = sorted(str(k) for k in keys or ())
    if not unused:
        return None, None
    shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
    saved, _ = _saved_class(config)
    if user_class and base_prefix and not any(k.startswith(f"{base_prefix}.") for k in unused):
        return None, (
            f"not loaded: {shown}, the head of {_arch(config)}; model_class={loaded_as} replaces it"
        )
    if saved is not None and saved != loaded_as:
        fix = f"load it with model_class={saved!r} (the class for {_arch(config)}, which its config names)"
    else:
        fix = "pass the model_class= of the model that saved this checkpoint"
    return (
        f"{name}: {loaded_as} cannot take {len(unused)} weight(s) of the checkpoint ({shown}); loading "
        f"would drop them and train a different model than the one saved. The model was not returned. "
        f"Fix: {fix}."
    ), None
