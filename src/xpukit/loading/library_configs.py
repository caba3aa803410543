"""The third-party config objects a load is carried out with, built from the plan's plain values.

Building them is acting: planning decides and checks with plain values (a LoRA request's keywords,
:func:`xpukit.planning.training.lora_config.lora_config_problem`), and the objects the libraries take
are made here, when the load makes the adapters.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peft import LoraConfig

    from xpukit.planning.training.lora_request import LoraRequest

__all__ = ["lora_config"]


def lora_config(request: LoraRequest) -> LoraConfig:
    """peft's ``LoraConfig`` for new adapters (imports peft), from the request's keywords as planned.

    The settings are checked before (:func:`~xpukit.planning.training.lora_config.lora_config_problem`,
    while planning and again on the loaded model); peft's own error stands for anything that slipped.
    """
    from peft import LoraConfig

    # A copy: peft extends lists it is given (modules_to_save) in place, and the plan is frozen.
    return LoraConfig(**copy.deepcopy(request.config))
