"""``training_args(..., config_class=SFTConfig)``: xpukit's keywords in any ``TrainingArguments`` subclass.

TRL's trainers take their own configs (``SFTConfig``, ``DPOConfig``, ``GRPOConfig`` …), which are
``TrainingArguments`` subclasses with other defaults. Two of those defaults meet xpukit's rules
(docs/known-issues.md "TRL: configs turn bf16 and gradient checkpointing on by default"):

* ``bf16=None``, which TRL's ``__post_init__`` turns into ``not fp16`` — bf16 on, and on a CPU
  without ``use_cpu`` transformers then raises ``Your setup doesn't support bf16/gpu``. xpukit
  always passes both ``bf16`` and ``fp16`` explicitly, from its precision decision, so a class
  default never picks the mixed precision.
* ``gradient_checkpointing=True``: checkpointing is on unless the user turns it off, so xpukit's
  rule for it (non-reentrant, ``gradient_checkpointing_kwargs={"use_reentrant": False}``) applies.

Every other keyword the user gives passes through (``max_length``, ``packing``, ``beta`` …); one the
class does not have is refused with the closest names, before the class's own ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError, name_hints
from xpukit.training.keywords import TrainingContext, training_kwargs

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from xpukit.machine.facts import DeviceFacts

__all__ = ["build_config", "check_config_class", "config_kwargs", "fit_to_class"]

logger = logging.getLogger(__name__)


def check_config_class(config_class: object) -> type[TrainingArguments]:
    """The class to build: ``TrainingArguments`` when ``None``, else a subclass of it.

    Raises:
        InvalidRequestError: ``config_class`` is not a ``TrainingArguments`` subclass.
    """
    from transformers import TrainingArguments

    if config_class is None:
        return TrainingArguments  # type: ignore[no-any-return]
    if isinstance(config_class, type) and issubclass(config_class, TrainingArguments):
        return config_class
    what = config_class.__name__ if isinstance(config_class, type) else f"{config_class!r}"
    hint = " (an instance: pass the class itself)" if isinstance(config_class, TrainingArguments) else ""
    raise InvalidRequestError(
        f"training_args(config_class={what}){hint}: not a transformers.TrainingArguments subclass, so "
        "xpukit cannot build it with its keywords. Valid: TrainingArguments, Seq2SeqTrainingArguments, or "
        "a trainer's config class such as trl.SFTConfig, trl.DPOConfig, trl.GRPOConfig. Fix: pass the "
        "class, e.g. `from trl import SFTConfig; training_args(model, config_class=SFTConfig, ...)`."
    )


def _fields(cls: type[TrainingArguments]) -> dict[str, dataclasses.Field[object]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _default(field: dataclasses.Field[object]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def fit_to_class(
    cls: type[TrainingArguments], keywords: dict[str, object], user: Mapping[str, object]
) -> dict[str, object]:
    """xpukit's keywords made exact for ``cls``: no class default decides what xpukit decides.

    Args:
        cls: the ``TrainingArguments`` subclass.
        keywords: from :func:`xpukit.training.keywords.training_kwargs` (the user's already on top).
        user: the keywords the user passed (refused when ``cls`` has no such field).

    Returns:
        The keywords for ``cls(**keywords)``.

    Raises:
        InvalidRequestError: a user keyword ``cls`` does not have.
    """
    fields = _fields(cls)
    unknown = sorted(k for k in user if k not in fields)
    if unknown:
        raise InvalidRequestError(
            f"training_args(config_class={cls.__name__}): {name_hints(unknown, fields)} is not a field of "
            f"{cls.__name__}. Fix: drop or correct it ({cls.__name__} takes TrainingArguments' keywords "
            "and the fields its own class adds)."
        )
    out = dict(keywords)
    for name in ("bf16", "fp16"):  # explicit, whatever the class's default (TRL: bf16 = not fp16)
        out[name] = bool(out.get(name, False))
    checkpointing = out.get("gradient_checkpointing", _default(fields["gradient_checkpointing"]))
    if checkpointing is True and "gradient_checkpointing_kwargs" not in user:
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        if "gradient_checkpointing" not in out:
            logger.info(
                "training_args: %s turns gradient checkpointing on by default: made non-reentrant",
                cls.__name__,
            )
    return _current_names(out, user, fields)


# transformers 5.25 renamed gradient checkpointing's arguments (the old names are deprecated aliases
# that warn, to be removed in v6): xpukit's own keywords take the new names where the class has them.
_RENAMED = (
    ("gradient_checkpointing", "activation_checkpointing"),
    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
)


def _current_names(
    out: dict[str, object], user: Mapping[str, object], fields: Mapping[str, dataclasses.Field[object]]
) -> dict[str, object]:
    """``out`` with xpukit's checkpointing keywords under the class's current names; a name the user
    passed stays as given (its warning, if any, is theirs)."""
    for old, new in _RENAMED:
        if new in fields and old in out and old not in user and new not in out:
            out[new] = out.pop(old)
    return out


def config_kwargs(
    config_class: type[TrainingArguments] | None,
    device: DeviceFacts,
    /,
    *,
    context: TrainingContext | None = None,
    **user: object,
) -> dict[str, object]:
    """The keywords :func:`xpukit.training_args` passes to ``config_class`` on ``device`` (pure).

    For checking a config class against recorded device profiles without the hardware: building
    the class itself would initialise the device's runtime.

    Args:
        config_class: a ``TrainingArguments`` subclass (``trl.SFTConfig`` …), or ``None``.
        device: the device training runs on.
        context: the run's other facts (world size, quantisation …).
        **user: keywords for the class; they win, as in :func:`xpukit.training_args`.

    Returns:
        The keywords.

    Raises:
        InvalidRequestError: not a ``TrainingArguments`` subclass, a keyword it does not have, or a
            combination that would fail on this device.

    Example::

        >>> from trl import SFTConfig  # doctest: +SKIP
        >>> from xpukit.machine.profiles import device_profile
        >>> config_kwargs(SFTConfig, device_profile("meteor-lake"), max_length=512)["fp16"]  # doctest: +SKIP
        True
    """
    cls = check_config_class(config_class)
    return fit_to_class(cls, training_kwargs(device, context=context, **user), user)


def build_config(
    cls: type[TrainingArguments], keywords: dict[str, object], user: Mapping[str, object]
) -> TrainingArguments:
    """``cls(**keywords)`` after :func:`fit_to_class`; building it initialises the device's runtime."""
    return cls(**fit_to_class(cls, keywords, user))
