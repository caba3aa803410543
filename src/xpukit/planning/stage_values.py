"""The frozen values the stages of :mod:`xpukit.planning.stages` return, one per stage: what is known
once each stage has decided (request → config → machine → model → placement → attention → adapters
and training → decode → plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.planning.device.attention import AttentionChoice
from xpukit.planning.device.decode_plan import DecodePlan
from xpukit.planning.device.distributed import DistributedLoad, RankPlacement
from xpukit.planning.device.layer_kernels import KernelsChoice
from xpukit.planning.device.layout import Layout
from xpukit.planning.device.quantization import QuantRequest
from xpukit.planning.device.saved_quant import SavedFormat
from xpukit.planning.model.classes import ModelClassChoice
from xpukit.planning.model.facts import ModelFacts
from xpukit.planning.training.base_record import BaseRecord
from xpukit.planning.training.lora_request import LoraRequest
from xpukit.planning.training.training_plan import TrainingPlan
from xpukit.planning.vocabulary import Decision
from xpukit.sources.hub_access import HubFacts

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["Adapters", "Attention", "Config", "Decode", "Machine", "Model", "Placement"]


@dataclass(frozen=True, kw_only=True)
class Config:
    """The model's config, where it came from, and the quantization asked (or recorded in it)."""

    config: PreTrainedConfig
    source: str | None  # where the weights come from (None: a built-in shape or a bare config)
    name: str
    consumed: frozenset[str]
    quant: QuantRequest
    given: bool  # a config was given (``config=`` or a config object with a source), not read
    saved: SavedFormat | None = None  # a quantized checkpoint xpukit merge wrote (its record)


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The machine, this process's rank in a launched job, the main device, and the Hub as seen from it."""

    machine: MachineFacts
    facts_given: bool
    rank: RankPlacement | None
    main: DeviceFacts
    candidates: tuple[DeviceFacts, ...]
    device_decision: Decision
    world: int  # processes of a launched job
    hub: HubFacts  # asked only when a Hub kernel is on the table (xpukit/sources/hub_access.py)


@dataclass(frozen=True, kw_only=True)
class Model:
    """What the model is: its class, its facts, and a saved adapter checked against it."""

    class_choice: ModelClassChoice
    facts: ModelFacts
    adapter_check: str | None
    record: BaseRecord | None
    warnings: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the weights go, in which dtype and format; the LoRA request and its training plan."""

    layout: Layout
    lora: LoraRequest | None
    training: TrainingPlan | None
    distributed: DistributedLoad
    warnings: tuple[str, ...]

    @property
    def dtype(self) -> str:
        return str(self.layout.dtype.value)


@dataclass(frozen=True, kw_only=True)
class Attention:
    """The attention implementation and the Hub layer kernels."""

    attention: AttentionChoice
    kernels: KernelsChoice
    warnings: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Adapters:
    """The decisions about the adapters and their training, in the plan's order."""

    decisions: tuple[Decision, ...]
    warnings: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Decode:
    """``fast_decode``'s plan and decision (both ``None`` when not asked)."""

    plan: DecodePlan | None
    decision: Decision | None
