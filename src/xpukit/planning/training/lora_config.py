"""A LoRA request against the model: fitted to its class, then built and checked as peft's config.

:func:`fit_lora_to_class` lays in what the model class needs (the task, the head trained in full, a
VLM's language-model targets) where ``lora=`` left it open; :func:`check_lora_request` builds the
``peft.LoraConfig`` (:func:`lora_config_or_problem`) and matches its targets against the module names
in the model's facts (:func:`targets_problem`), so a request peft would refuse is refused before any
weight is read. :func:`xpukit.loading.lora.apply_lora` builds the config and checks the targets
again, with these functions, on the loaded model. What ``lora=`` asks for is
:mod:`xpukit.planning.training.lora_request`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.training.lora_request import LoraRequest, targets_text

if TYPE_CHECKING:
    from xpukit.planning.model.classes import ModelClassChoice
    from xpukit.planning.model.facts import ModelFacts

__all__ = [
    "build_lora_config",
    "check_lora_request",
    "fit_lora_to_class",
    "lora_config_or_problem",
    "targets_problem",
]

_ALL_LINEAR = "all-linear"


def fit_lora_to_class(request: LoraRequest | None, choice: ModelClassChoice, facts: ModelFacts) -> Any:
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


def build_lora_config(request: LoraRequest) -> Any:
    config, problem = lora_config_or_problem(request)
    if problem is not None:
        raise InvalidRequestError(problem)
    return config


def lora_config_or_problem(request: LoraRequest) -> tuple[Any, str | None]:
    # A message rather than an exception: callers holding a loaded model drop it before raising.
    from peft import LoraConfig

    try:
        # A copy: peft extends lists it is given (modules_to_save) in place, and the plan is frozen.
        return LoraConfig(**copy.deepcopy(request.config)), None
    except (TypeError, ValueError) as exc:
        return None, f"lora=: peft.LoraConfig rejected {request.config}: {exc}"


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
    config, problem = lora_config_or_problem(request)
    if problem is None and facts.module_names:
        problem = targets_problem(config, facts.module_names, list(facts.linear_layers), facts.architecture)
    if problem is not None:
        raise InvalidRequestError(problem)


def targets_problem(config: Any, module_names: Any, linear_names: list[str], architecture: str) -> str | None:
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
