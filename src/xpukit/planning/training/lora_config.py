"""A LoRA request against the model: fitted to its class, then built and checked as peft's config.

:func:`fit_lora_to_class` lays in what the model class needs (the task, the head trained in full, a
VLM's language-model targets) where ``lora=`` left it open; :func:`check_lora_request` builds the
``peft.LoraConfig`` and matches its targets against the module names in the model's facts
(:func:`lora_config_problem`), so a request peft would refuse is refused before any weight is read.
:func:`xpukit.loading.lora.apply_lora` checks the targets again, with the same rule, on the loaded
model, and builds the config the adapters are made with (:mod:`xpukit.loading.library_configs`).
What ``lora=`` asks for is :mod:`xpukit.planning.training.lora_request`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError
from xpukit.planning.training.lora_request import LoraRequest, targets_text

if TYPE_CHECKING:
    from peft import LoraConfig

    from xpukit.planning.model.classes import ModelClassChoice
    from xpukit.planning.model.facts import ModelFacts

__all__ = [
    "check_lora_request",
    "fit_lora_to_class",
    "lora_config_problem",
]

_ALL_LINEAR = "all-linear"


def fit_lora_to_class(
    request: LoraRequest | None, choice: ModelClassChoice, facts: ModelFacts
) -> LoraRequest | None:
    """The LoRA request with the task, head and targets the model class needs.

    What the user set stays (``request.given``); a ``task_type`` that contradicts the class is
    refused, because peft then builds the wrong wrapper (``CAUSAL_LM`` on a classifier fails with
    ``AttributeError: ... prepare_inputs_for_generation``).

    Raises:
        InvalidRequestError: the given ``task_type`` does not fit the class.
    """
    if request is None or request.kind != "new":
        return request
    config = dict(request.config)
    given = request.given
    task = choice.task_type
    notes = []
    if "task_type" in given and config.get("task_type") not in (None, task):
        raise InvalidRequestError(
            f"lora task_type={config.get('task_type')!r} does not fit {choice.name} ({facts.architecture}), "
            f"whose LoRA task is {task!r}: peft would wrap it as the wrong kind of model. Fix: drop "
            f"task_type (xpukit sets {task!r} from the class), or pass the model_class= that task needs."
        )
    if config.get("task_type") != task or "task_type" not in given:
        config["task_type"] = task
        notes.append(f"task {task} from {choice.name}")
    if facts.head_modules and "modules_to_save" not in given:
        config["modules_to_save"] = list(facts.head_modules)
        notes.append(f"the head ({', '.join(facts.head_modules)}) trained in full (modules_to_save)")
    if facts.language_model and "target_modules" not in given and facts.language_linear_layers:
        names = "|".join(re.escape(n) for n in facts.language_linear_layers)
        config["target_modules"] = rf"{re.escape(facts.language_model)}\..*\.(?:{names})"
        notes.append(
            f"LoRA on the language model ({facts.language_model}) only; the vision tower stays frozen"
        )
    if not notes:
        return request
    return dataclasses.replace(request, config=config, reason=f"{request.reason}; {'; '.join(notes)}")


def lora_config_problem(
    request: LoraRequest, module_names: Sequence[str] | None, linear_names: Sequence[str], architecture: str
) -> str | None:
    """Why peft refuses the settings of new adapters, or (``module_names`` given) why their targets
    match no module of this ``architecture``; ``None`` when neither.

    A message rather than an exception: the loader, holding a loaded model, drops it before raising.
    peft's ``LoraConfig`` is built here only for its own validation and its target matching, then
    dropped: the config the adapters are made with is built where they are (:mod:`xpukit.loading`).
    """
    from peft import LoraConfig

    try:
        # A copy: peft extends lists it is given (modules_to_save) in place, and the plan is frozen.
        config = LoraConfig(**copy.deepcopy(request.config))
    except (TypeError, ValueError) as exc:
        return f"lora=: peft.LoraConfig rejected {request.config}: {exc}"
    if module_names is None:
        return None
    return _targets_problem(config, module_names, linear_names, architecture)


def check_lora_request(request: LoraRequest | None, facts: ModelFacts) -> None:
    """Refuse a LoRA request that peft would refuse for this model — before any weight is read.

    Builds the ``peft.LoraConfig`` (imports peft, which imports bitsandbytes: call it under
    :func:`xpukit.hub.offline_guard` when the Hub cannot be used) and matches its ``target_modules``
    against the module names recorded in the model's facts (built on the meta device).

    Raises:
        InvalidRequestError: ``LoraConfig`` rejects the settings, or the targets match no module (the
            message lists the model's linear layers).
    """
    if request is None or request.kind != "new":
        return
    names = facts.module_names or None  # none recorded: the targets are left to peft at load
    problem = lora_config_problem(request, names, facts.linear_layers, facts.architecture)
    if problem is not None:
        raise InvalidRequestError(problem)


def _targets_problem(
    config: LoraConfig, module_names: Sequence[str], linear_names: Sequence[str], architecture: str
) -> str | None:
    """Why the targets match no module, listing the model's linear layers (peft's own error names
    neither the model's layers nor the fix); ``None`` when they match."""
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.target_modules
    if targets is None or targets == _ALL_LINEAR or getattr(config, "target_parameters", None):
        return None  # peft resolves these per architecture
    if any(check_target_module_exists(config, name) for name in module_names):
        return None
    return (
        f"lora target_modules={targets_text(targets)!r} match no module of this "
        f"{architecture}. Its linear layers are: {', '.join(linear_names)}. "
        'Name some of those, or use target_modules="all-linear".'
    )
