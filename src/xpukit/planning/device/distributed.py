"""Distributed decisions, pure: which device this rank loads onto, which strategy trains, which backend.

Rules (docs/distributed.md "What xpukit decides"):

* **Rank placement.** In a launched job (``MachineFacts.launch`` with a world size > 1) the whole
  model goes on ``<backend>:<local rank>`` as ``device_map={"": local_rank}``, and is never split
  over the devices of other ranks. Every rank sees every selected device (oneCCL needs it), so the
  local rank names this rank's own. An explicit ``device=`` / ``device_map=`` that contradicts the
  rank is refused with the fix. The CPU and MPS have one device, shared by every rank.
* **Strategy** (``auto`` | ``ddp`` | ``fsdp`` | ``deepspeed``): ``auto`` is DDP when the model with
  its training memory fits one device, else FSDP2. FSDP loads without a device_map (weights on the
  CPU, or meta with ``cpu_ram_efficient_loading``) and, for 4-bit, stores the quantized weights in
  the compute dtype (``bnb_4bit_quant_storage``) so FSDP can shard them beside the other weights.
* **Process-group backend**: xccl on XPU (torch >= 2.8 and ``is_xccl_available()``), nccl on CUDA,
  gloo on CPU/MPS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from packaging.version import InvalidVersion, Version

from xpukit.errors import DeviceSelectionError, InvalidRequestError
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.machine.launch import LaunchFacts
from xpukit.planning.budgets import DeviceMap
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from xpukit.planning.device.layout import Layout
    from xpukit.planning.model.facts import ModelFacts

__all__ = [
    "STRATEGIES",
    "DistributedLoad",
    "RankPlacement",
    "choose_strategy",
    "parse_strategy",
    "place_rank",
    "plan_distributed",
    "process_group_backend",
    "quant_storage_problem",
    "shard_candidates",
    "training_bytes",
]

STRATEGIES = ("auto", "ddp", "fsdp", "deepspeed")
_SPLITTING = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_strategy(value: object) -> str | None:
    """``None`` or one of :data:`STRATEGIES` (any case).

    Raises:
        InvalidRequestError: anything else.
    """
    if value is None:
        return None
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text not in STRATEGIES:
        raise InvalidRequestError(
            f"strategy={value!r} is not a strategy xpukit plans; valid: {', '.join(STRATEGIES)} "
            "(tensor parallelism is transformers' own tp_plan='auto', docs/distributed.md). "
            "Fix: pass one of those, or leave strategy unset."
        )
    return text


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlacement:
    """Where this rank loads: the device text for the planner and the decision that says why."""

    device_text: str | None
    decision: Decision
    device_map: DeviceMap  # what from_pretrained gets once the layout found the model fits this device


def place_rank(
    device_text: str | None,
    device_map: DeviceMap | None,
    machine: MachineFacts,
    *,
    strategy: str | None = None,
) -> RankPlacement | None:
    """This rank's own device, or ``None`` when the process is not one rank of a multi-process job.

    Args:
        device_text: the normalised ``device=`` (``xpu``, ``xpu:1``, ``cpu``…) or ``None``.
        device_map: the user's ``device_map=`` (``"auto"`` when not given).
        machine: the facts, with ``launch``.
        strategy: the training strategy asked for (FSDP loads without a device_map).

    Returns:
        The placement, or ``None`` outside a launched job.

    Raises:
        InvalidRequestError: a ``device=`` or ``device_map=`` that puts weights on another rank's
            device, or splits the model over several.
        DeviceSelectionError: fewer devices visible than this rank's local rank needs.
    """
    launch = machine.launch
    if launch is None or not launch.distributed:
        return None
    where = launch.describe() + (f" (from {_variables(launch)})" if launch.variables else "")
    if isinstance(device_map, str) and device_map.strip().lower() in _SPLITTING[1:]:
        raise InvalidRequestError(
            f"device_map={device_map!r} splits the model over every visible device, but this process is "
            f"{where}: the other devices belong to the other ranks. Fix: drop device_map (xpukit puts "
            "the whole model on this rank's device), or strategy='fsdp' to shard a model that does not fit."
        )
    if isinstance(device_map, dict) and len({str(v).strip().lower() for v in device_map.values()}) > 1:
        raise InvalidRequestError(
            f"device_map={device_map!r} spreads the model over several devices, but this process is {where}: "
            "the other devices belong to the other ranks. Fix: drop device_map (xpukit puts the whole model "
            "on this rank's device), or strategy='fsdp' to shard a model that does not fit."
        )
    backend = (device_text or machine.accelerator).split(":")[0]
    if backend in {"cpu", "mps"}:
        reason = f"{where}: every rank trains on the one {backend.upper()} device"
        shared: dict[str, Any] = {"": backend}
        return RankPlacement(
            device_text=backend, decision=_decision(launch, backend, reason), device_map=shared
        )
    devices = machine.devices_of(backend)
    index = launch.local_rank
    asked = device_text.partition(":")[2] if device_text else ""
    if asked and int(asked) != index and not (len(devices) == 1 and int(asked) == 0):
        raise InvalidRequestError(
            f"device={device_text!r}, but this process is {where}: its device is {backend}:{index}, and "
            f"{device_text} belongs to local rank {asked}. Every rank sees every selected device and "
            f"uses the one its local rank names. Fix: pass device={backend!r} (or nothing), or "
            f"device_map={{'': {index}}}; to run on other cards, select them at launch "
            "(`xpukit launch --devices 2,3 --nproc 2 -- train.py`)."
        )
    reason = (
        f"{where}: the whole model on this rank's own device {backend}:{index} "
        "(device_map={'': local_rank}), never split over the devices of other ranks"
    )
    if len(devices) == 1 and index > 0:
        # A per-rank mask (each rank sees only its own card): its device is index 0.
        index = 0
        reason = f"{where}: one {backend} device visible (a per-rank device mask), so {backend}:0; " + (
            "oneCCL needs every rank to see every selected device (docs/distributed.md)"
            if backend == "xpu"
            else "the model stays whole on it"
        )
    elif index >= len(devices):
        raise DeviceSelectionError(
            f"This process is {where}, but only {len(devices)} {backend} device(s) are visible "
            f"({', '.join(d.torch_device for d in devices) or 'none'}): local rank {launch.local_rank} has "
            f"no device of its own. Fix: start at most {len(devices)} processes per node "
            f"(`xpukit launch --nproc {len(devices) or 1}`), or select more devices."
        )
    dmap: dict[str, Any] = {"": index}
    if strategy == "fsdp":
        reason += "; strategy='fsdp': loaded for sharding (see the strategy decision)"
    return RankPlacement(
        device_text=f"{backend}:{index}",
        decision=_decision(launch, f"{backend}:{index}", reason),
        device_map=dmap,
    )


def _decision(launch: LaunchFacts, device: str, reason: str) -> Decision:
    value = f"rank {launch.rank}/{launch.world_size} on {device}"
    return Decision(name="launch", value=value, reason=reason, source="auto")


def _variables(launch: LaunchFacts) -> str:
    return ", ".join(f"{k}={v}" for k, v in launch.variables) or launch.launcher


def training_bytes(weights: int, num_parameters: int, *, lora: bool, quantized: bool) -> int:
    """Bytes one rank needs to train the whole model beside activations (docs/distributed.md §2).

    LoRA (or a quantized base, which only trains adapters): the frozen weights plus ~2% for the
    adapters, their gradients and Adam states. Full fine-tuning with Adam in mixed precision:
    16 bytes per parameter (16-bit weights and gradients, fp32 master weights and two moments).
    """
    if lora or quantized:
        return weights + weights // 50
    return max(weights, 16 * num_parameters)


def choose_strategy(
    requested: str, *, need: int, usable: int, device: DeviceFacts, world_size: int
) -> Decision:
    """The training strategy, with the reason.

    Args:
        requested: one of :data:`STRATEGIES`.
        need: bytes one rank needs to train the whole model (:func:`training_bytes` plus headroom).
        usable: bytes usable on this rank's device.
        device: this rank's device.
        world_size: processes in the job (1 when not launched).

    Returns:
        The ``strategy`` decision. On the CPU and MPS ``auto`` is DDP: accelerate applies FSDP only on
        accelerators (``training_args`` refuses ``strategy="fsdp"`` there; a load for sharding is
        still planned, for torch's own ``fully_shard``).
    """
    from xpukit.planning.budgets import format_bytes

    fits = need <= usable
    sizes = f"training needs ~{format_bytes(need)} per rank, {device.torch_device} has {format_bytes(usable)}"
    if requested == "auto" and device.backend in {"cpu", "mps"}:
        return Decision(
            name="strategy",
            value="ddp",
            reason=f"auto: {sizes}; DDP, because accelerate applies FSDP only on accelerators",
        )
    if requested == "auto":
        if fits or world_size <= 1:
            why = "fits one device" if fits else "does not fit, but a single process cannot shard"
            return Decision(
                name="strategy",
                value="ddp",
                reason=f"auto: {sizes}: {why}, so DDP (a full copy per rank, fastest)",
                rejected=(("fsdp", "not needed: the model fits one device"),) if fits else (),
            )
        per_rank = need // world_size
        short = (
            f"; even sharded (~{format_bytes(per_rank)} per rank) it does not fit: LoRA or 4-bit would"
            if per_rank > usable
            else ""
        )
        return Decision(
            name="strategy",
            value="fsdp",
            reason=f"auto: {sizes}: does not fit one device, so FSDP2 shards it over {world_size} ranks"
            + short,
            rejected=(("ddp", "every rank would need the whole model"),),
        )
    what = {
        "ddp": "a full copy per rank",
        "fsdp": "FSDP2 shards weights over the ranks",
        "deepspeed": "DeepSpeed ZeRO",
    }[requested]
    reason = f"strategy={requested!r} given: {what}"
    if requested == "ddp" and not fits:
        reason += f" ({sizes}: it may run out of memory; strategy='fsdp' shards it)"
    return Decision(name="strategy", value=requested, reason=reason, source="user")


def quant_storage_problem(user_config: QuantizationConfigMixin | None, dtype: str) -> str | None:
    """Why a user's ``BitsAndBytesConfig`` cannot be sharded by FSDP, else ``None``.

    FSDP flattens each wrapped module's parameters into one dtype: 4-bit weights stored as uint8
    (bitsandbytes' default) beside bf16 norms cannot be sharded (docs/distributed.md "FSDP2 with 4-bit").
    """
    if user_config is None or not getattr(user_config, "load_in_4bit", False):
        return None
    storage = str(getattr(user_config, "bnb_4bit_quant_storage", "torch.uint8")).replace("torch.", "")
    if storage == dtype:
        return None
    return (
        f"strategy='fsdp' with a 4-bit BitsAndBytesConfig whose bnb_4bit_quant_storage is {storage}: FSDP "
        f"shards a module's weights in one dtype, so the 4-bit storage must equal the compute dtype "
        f"({dtype}). Fix: BitsAndBytesConfig(..., bnb_4bit_quant_storage=torch.{dtype}), or quantize='4bit' "
        "(xpukit sets it)."
    )


def process_group_backend(
    device: DeviceFacts, torch_version: str | None, xccl_available: bool | None = None
) -> tuple[str | None, str]:
    """The ``torch.distributed`` backend for a device, with the reason (``None``: let accelerate pick)."""
    if device.backend == "xpu":
        if not _at_least(torch_version, "2.8"):
            return (
                None,
                f"no ddp_backend set: xccl needs torch >= 2.8 (found {torch_version}); accelerate picks one",
            )
        if xccl_available is False:
            return None, (
                "no ddp_backend set: this torch build has no xccl (torch.distributed.is_xccl_available() is "
                "False); install the XPU wheel of torch >= 2.8"
            )
        return "xccl", "ddp_backend=xccl: XPU with torch >= 2.8"
    if device.backend == "cuda":
        return "nccl", "ddp_backend=nccl: CUDA"
    return "gloo", f"ddp_backend=gloo: {device.backend}"


def _at_least(version: str | None, minimum: str) -> bool:
    if version is None:
        return False
    try:
        return Version(version.split("+")[0]) >= Version(minimum)
    except InvalidVersion:
        return False


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedLoad:
    """What a launched rank and a training strategy change in a load plan."""

    device_map: DeviceMap | None
    quantization_config: dict[str, Any] | None
    max_memory: dict[int | str, int] | None
    strategy: str | None
    decisions: tuple[Decision, ...]  # the launch / strategy decisions, and the device_map one replaced

    def merged(self, decisions: list[Decision]) -> list[Decision]:
        """``decisions`` with a same-named one replaced, the launch and strategy ones after ``device``."""
        mine = {d.name: d for d in self.decisions}
        out = [mine.pop(d.name, d) for d in decisions]
        extra = [d for d in self.decisions if d.name in mine]
        at = next((i + 1 for i, d in enumerate(out) if d.name == "device"), 0)
        return out[:at] + extra + out[at:]


def plan_distributed(
    *,
    rank: RankPlacement | None,
    strategy: str | None,
    layout: Layout,
    model_facts: ModelFacts,
    main: DeviceFacts,
    machine: MachineFacts,
    user_device_map: DeviceMap | None,
    user_quant_config: QuantizationConfigMixin | None,
    lora: bool,
) -> DistributedLoad:
    """Rank placement and strategy applied to a layout (``planning.layout.Layout``).

    Raises:
        InvalidRequestError: FSDP with 8-bit weights, or with a 4-bit config FSDP cannot shard.
    """
    device_map: DeviceMap | None = layout.device_map
    max_memory = layout.max_memory
    qconfig = dict(layout.quantization_config) if layout.quantization_config is not None else None
    decisions: list[Decision] = []
    if rank is not None:
        launch = machine.launch
        assert launch is not None
        why = f"this rank's own device (local rank {launch.local_rank}; see the launch decision)"
        decisions += [Decision(name="device", value=main.torch_device, reason=why), rank.decision]
    map_reason = None
    if rank is not None and layout.memory.placement == "single" and user_device_map in (None, "auto"):
        device_map = rank.device_map
        map_reason = f"{layout.memory.verdict}; this rank's own device only ({rank.decision.value})"
    chosen = None
    if strategy is not None:
        world = machine.launch.world_size if machine.launch is not None else 1
        quantized = layout.quantization is not None
        weights = layout.memory.weights
        need = training_bytes(weights, model_facts.num_parameters, lora=lora, quantized=quantized)
        usable = layout.memory.budgets[0].usable if layout.memory.budgets else 0
        decision = choose_strategy(
            strategy, need=need + layout.memory.headroom, usable=usable, device=main, world_size=world
        )
        chosen = str(decision.value)
        if chosen == "fsdp":
            dtype = str(layout.dtype.value)
            if layout.quantization == "8bit":
                raise InvalidRequestError(
                    "strategy='fsdp' with 8-bit (LLM.int8) weights: FSDP cannot shard bitsandbytes' "
                    "Int8Params. "
                    "Fix: quantize='4bit' (QLoRA with FSDP), or strategy='ddp'."
                )
            if layout.quantization == "4bit":
                problem = quant_storage_problem(user_quant_config, dtype)
                if problem:
                    raise InvalidRequestError(problem)
                if qconfig is not None and user_quant_config is None:
                    qconfig["bnb_4bit_quant_storage"] = dtype
                # bitsandbytes quantizes where the weights are loaded: on this rank's own device.
                device_map, max_memory = (rank.device_map if rank is not None else device_map), None
                map_reason = (
                    f"FSDP with 4-bit: quantized on this rank's device, stored as {dtype} "
                    "(bnb_4bit_quant_storage = compute dtype) so FSDP can shard the 4-bit weights"
                )
            elif user_device_map in (None, "auto"):
                device_map, max_memory = None, None
                map_reason = (
                    "FSDP: no device_map; the weights load on the CPU (or meta on ranks > 0 with "
                    "cpu_ram_efficient_loading) and FSDP2 moves each rank's shard to its device"
                )
        decisions.append(decision)
    if map_reason is not None:
        decisions.append(Decision(name="device_map", value=device_map, reason=map_reason))
    return DistributedLoad(
        device_map=device_map,
        quantization_config=qconfig,
        max_memory=max_memory,
        strategy=chosen,
        decisions=tuple(decisions),
    )


def shard_candidates(main: DeviceFacts, machine: MachineFacts) -> tuple[DeviceFacts, ...]:
    """The devices of this node's ranks, this rank's first: what FSDP shards over (for sizing)."""
    launch = machine.launch
    if launch is None or main.backend in {"cpu", "mps"}:
        return (main,)
    ranks = launch.local_world_size or launch.world_size
    devices = machine.devices_of(main.backend)[:ranks]
    return (main, *(d for d in devices if d.index != main.index))
