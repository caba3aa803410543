"""The plan a load follows: one :class:`Decision` per choice, the memory estimate, and what ran.

A :class:`LoadPlan` is frozen. :func:`xpukit.plan_load` makes it; :func:`xpukit.load_for_xpu`
carries it out and attaches a copy with the :class:`LoadEvent` s of the load (fallbacks and their
causes) as ``model.xpukit_plan``.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from xpukit.planning.budgets import DeviceMap, format_bytes
from xpukit.planning.vocabulary import Decision, Json, LoadEvent, MemoryEstimate, jsonable

if TYPE_CHECKING:
    from transformers import KernelConfig, PreTrainedConfig
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from xpukit.machine.facts import DeviceFacts, MachineFacts
    from xpukit.planning.device.decode_plan import DecodePlan
    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.training.lora_request import LoraRequest
    from xpukit.planning.training.merge import MergePlan
    from xpukit.planning.training.training_plan import TrainingPlan

__all__ = ["LoadPlan"]


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    """Everything a load will do, with the reasons; made by :func:`xpukit.plan_load`.

    Attributes:
        model: what to load (Hub id or local path; ``None`` for a bare config with no weights).
        model_facts: what was read from the config.
        machine: the facts the plan was made for (detected, or a profile).
        device: the main device.
        dtype: ``bfloat16`` / ``float16`` / ``float32`` (also the 4-bit compute dtype).
        quantization: ``4bit``, ``8bit`` (bitsandbytes), ``torchao`` (the format xpukit chose for a
            load without adapters, or a given ``TorchAoConfig``), the ``quant_method`` of another
            given quantization config (``quanto``…, passed through unchanged), or ``None``.
        quantization_config: the ``BitsAndBytesConfig`` keyword arguments (dtype as a name), or the
            user's config as a dict.
        attn_implementation: what ``from_pretrained`` gets (``sdpa``, ``eager``, a Hub kernel repo…).
        attention_kernel: the Hub kernel the attention needs (``org/repo``), fetched under a time
            bound at load; ``None`` when none.
        use_kernels: whether ``from_pretrained(use_kernels=True)`` is passed.
        device_map / max_memory: what ``from_pretrained`` gets.
        memory: the size estimate against each device.
        lora: the LoRA request (:class:`xpukit.planning.training.lora_request.LoraRequest`) or ``None``.
        decisions: every choice with its reason and rejected alternatives.
        warnings: things the user should know (offload, emulated dtype, fallbacks).
        passthrough: other ``from_pretrained`` keyword arguments, passed unchanged.
        events: what happened at load (empty until carried out).
        carried_out: whether this plan is the one a load carried out.
        seed: the ``seed=`` for new LoRA adapters' initialisation, or ``None`` (unseeded).
        strategy: the distributed strategy the load was planned for (``ddp``, ``fsdp``, ``deepspeed``),
            or ``None``; :func:`xpukit.training_args` follows it.
        decode: what ``fast_decode=True`` sets on the generation config
            (:class:`xpukit.planning.device.decode_plan.DecodePlan`), or ``None`` when not asked.
        training: the memory savers for new LoRA adapters, chosen by fit
            (:class:`xpukit.planning.training.training_plan.TrainingPlan`); ``None`` without new adapters.
        merge: where and into which weights ``merge=True`` merges the adapter
            (:class:`xpukit.planning.training.merge.MergePlan`); ``None`` without ``merge=``.
    """

    model: str | None
    model_facts: ModelFacts
    machine: MachineFacts
    device: DeviceFacts
    dtype: str
    quantization: str | None
    quantization_config: dict[str, Any] | None
    attn_implementation: str
    attention_kernel: str | None
    use_kernels: bool
    device_map: DeviceMap | None
    max_memory: dict[int | str, int] | None
    memory: MemoryEstimate
    lora: LoraRequest | None
    decisions: tuple[Decision, ...]
    warnings: tuple[str, ...] = ()
    passthrough: dict[str, Any] = field(default_factory=dict)
    model_class: str = ""
    events: tuple[LoadEvent, ...] = ()
    carried_out: bool = False
    # Objects the user handed over, used as given (not compared, not serialised).
    user_quantization_config: QuantizationConfigMixin | None = field(default=None, compare=False, repr=False)
    kernel_config: object = field(default=None, compare=False, repr=False)  # a KernelConfig or its dict
    config: PreTrainedConfig | None = field(default=None, compare=False, repr=False)
    config_kwargs: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    config_given: bool = field(default=False, compare=False, repr=False)  # the user handed over a config
    seed: int | None = None  # set_seed before new LoRA adapters are created; None: unseeded
    strategy: str | None = None  # the distributed strategy the load is for (planning/device/distributed.py)
    decode: DecodePlan | None = None  # fast_decode=True: static cache / compile (planning/device/decode.py)
    training: TrainingPlan | None = None  # new LoRA adapters: savers by fit (planning/training/fit.py)
    merge: MergePlan | None = None  # merge=True: the adapter merged at load (planning/training/merge.py)

    @property
    def fallbacks(self) -> tuple[LoadEvent, ...]:
        """The load events that replaced a planned choice, each with its cause."""
        return tuple(e for e in self.events if e.kind == "fallback")

    def decision(self, name: str) -> Decision:
        """The decision called ``name``."""
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(name)

    def with_merge(self, merge: MergePlan) -> LoadPlan:
        """This plan carrying ``merge`` out (:meth:`MergePlan.plan_changes`)."""
        return replace(self, **merge.plan_changes(self))

    def with_events(self, events: tuple[LoadEvent, ...], **changes: Any) -> LoadPlan:
        """A copy recording what a load did (``carried_out=True``); ``changes``: fields of the plan the
        load changed (each of its own type, as ``dataclasses.replace`` takes them: hence ``Any``)."""
        return replace(self, events=self.events + events, carried_out=True, **changes)

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """The exact keyword arguments for ``from_pretrained`` (imports torch/transformers to build them)."""
        import torch

        kwargs: dict[str, Any] = {
            "dtype": getattr(torch, self.dtype),
            "device_map": dict(self.device_map) if isinstance(self.device_map, dict) else self.device_map,
            "attn_implementation": self.attn_implementation,
        }
        if self.max_memory is not None:
            kwargs["max_memory"] = dict(self.max_memory)
        if self.quantization is not None and self.model_facts.pre_quantized is None:
            # A pre-quantized checkpoint's own quantization_config (in its config.json) loads it.
            kwargs["quantization_config"] = self._bnb_config()
        # Always given: from transformers 5.25 a missing use_kernels means True (docs/known-issues.md
        # "transformers 5.25: use_kernels on by default"), which would override the plan's "off".
        kwargs["use_kernels"] = self.use_kernels
        if self.use_kernels and self.kernel_config is not None:
            kwargs["kernel_config"] = self._kernel_config()
        kwargs.update(self.passthrough)
        if self.config_given and self.config is not None:
            kwargs["config"] = self.config
        return kwargs

    def _bnb_config(self) -> QuantizationConfigMixin:
        if self.user_quantization_config is not None:
            return self.user_quantization_config
        from xpukit.planning.device.quant_configs import quantization_config

        return quantization_config(self.quantization_config or {})

    def _kernel_config(self) -> KernelConfig | None:
        if isinstance(self.kernel_config, dict):
            from transformers import KernelConfig

            return KernelConfig(self.kernel_config)
        return cast("KernelConfig | None", self.kernel_config)  # the user's KernelConfig, as given

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the whole plan (the schema of ``xpukit plan --json``)."""
        lora = self.lora
        return {
            "model": self.model,
            "model_facts": self.model_facts.to_dict(),
            "machine": {
                "source": self.machine.source,
                "torch_version": self.machine.torch_version,
                "devices": [d.to_dict() for d in self.machine.devices],
                "cpu": self.machine.cpu.to_dict(),
            },
            "device": self.device.to_dict(),
            "dtype": self.dtype,
            "quantization": self.quantization,
            "quantization_config": jsonable(self.quantization_config),
            "attn_implementation": self.attn_implementation,
            "attention_kernel": self.attention_kernel,
            "use_kernels": self.use_kernels,
            "device_map": jsonable(self.device_map),
            "max_memory": jsonable(self.max_memory),
            "memory": self.memory.to_dict(),
            "lora": None if lora is None else {"describe": lora.describe(), **_jsonable_fields(lora)},
            "decisions": [d.to_dict() for d in self.decisions],
            "warnings": list(self.warnings),
            "from_pretrained_kwargs": self._kwargs_summary(),
            "model_class": self.model_class,
            "events": [e.to_dict() for e in self.events],
            "carried_out": self.carried_out,
            "seed": self.seed,
            "strategy": self.strategy,
            "decode": self.decode.describe() if self.decode is not None else None,
            "training": self.training.to_dict() if self.training is not None else None,
            "launch": self.machine.launch.to_dict() if self.machine.launch is not None else None,
            "merge": self.merge.to_dict() if self.merge is not None else None,
        }

    def _kwargs_summary(self) -> dict[str, Any]:
        # The kwargs without importing torch: dtypes as "torch.bfloat16", configs as dicts.
        out: dict[str, Any] = {
            "dtype": f"torch.{self.dtype}",
            "device_map": jsonable(self.device_map),
            "attn_implementation": self.attn_implementation,
        }
        if self.max_memory is not None:
            out["max_memory"] = jsonable(self.max_memory)
        if self.quantization is not None and self.model_facts.pre_quantized is None:
            kind = (
                type(self.user_quantization_config).__name__
                if self.user_quantization_config is not None
                else ("TorchAoConfig" if self.quantization == "torchao" else "BitsAndBytesConfig")
            )
            out["quantization_config"] = {kind: jsonable(self.quantization_config)}
        out["use_kernels"] = self.use_kernels
        if self.use_kernels and self.kernel_config is not None:
            out["kernel_config"] = jsonable(self.kernel_config)
        out.update({k: jsonable(v) for k, v in self.passthrough.items() if k != "config"})
        if self.config_given and self.config is not None:
            out["config"] = f"<the given {type(self.config).__name__}>"
        return out

    def explain(self, width: int = 100, *, verbose: bool = False) -> str:
        """A readable table of the choices, the memory, the warnings and what ran.

        Short by default: each choice with the first line of its reason, the memory and the training
        step in one line each. ``verbose=True`` gives every reason in full, the memory and training
        estimates, the rejected alternatives and the ``from_pretrained`` keywords
        (``xpukit plan --explain``; docs/planning.md "Reading a plan").
        """
        facts = self.model_facts
        params = (
            f"{facts.num_parameters / 1e9:.2f} B"
            if facts.num_parameters >= 1e8
            else f"{facts.num_parameters:,}"
        )
        lines = [
            f"Plan for {self.model or facts.name}: {facts.architecture}, {params} parameters",
            f"Machine: {self.machine.source}; main device {self.device.torch_device} ({self.device.name})",
        ]
        if self.machine.launch is not None:
            lines.append(_launch_line(self))
        headline = self.merge.warning if self.merge is not None else None  # which weights: said first
        lines += textwrap.wrap(headline or "", width, initial_indent="! ", subsequent_indent="  ")
        lines.append("")
        lines += self._decision_lines(width, verbose)
        if verbose:
            lines += self._memory_lines(width)
            lines += self.training.explain_lines() if self.training is not None else []
        else:
            short = [_memory_line(self.memory)] + ([self.training.summary_line()] if self.training else [])
            lines += [""] + [w for line in short for w in textwrap.wrap(line, width, subsequent_indent="  ")]
        rejected = [(d.name, v, why) for d in self.decisions for v, why in d.rejected]
        if rejected and verbose:
            lines += ["", "Rejected alternatives"]
            for name, value, why in rejected:
                lines += textwrap.wrap(
                    f"{name} = {_short(value)}: {why}", width, initial_indent="  ", subsequent_indent="    "
                )
        rest = [w for w in self.warnings if w != headline]
        if rest:
            lines += ["", "Warnings"]
            for w in rest:
                lines += textwrap.wrap(w, width, initial_indent="  ! ", subsequent_indent="    ")
        if verbose:
            target = repr(self.model) if self.model else f"<no weights: config {facts.name}>"
            lines += [
                "",
                f"{self.model_class or facts.auto_class}.from_pretrained({target}, **kwargs) with kwargs:",
            ]
            for key, value in self._kwargs_summary().items():
                lines.append(f"  {key} = {json.dumps(value) if not isinstance(value, str) else value}")
        if self.events:
            lines += ["", "What happened at load"]
            for e in self.events:
                text = (
                    f"{e.kind} {e.what}: {_short(e.planned)} -> {_short(e.actual)}"
                    if e.planned
                    else f"{e.kind} {e.what}: {_short(e.actual)}"
                )
                lines += textwrap.wrap(
                    f"{text} ({e.cause})" if e.cause else text,
                    width,
                    initial_indent="  ",
                    subsequent_indent="    ",
                )
        if not verbose:
            hint = (
                "Every reason in full, the rejected alternatives and the from_pretrained keywords: "
                "explain(verbose=True), or `xpukit plan --explain`."
            )
            lines += ["", *textwrap.wrap(hint, width)]
        return "\n".join(lines)

    def _decision_lines(self, width: int, verbose: bool) -> list[str]:
        """The table of choices: every reason wrapped in full, or its first line only."""
        name_w = max(len(d.name) for d in self.decisions) + 2
        value_w = min(max(len(_short(d.value)) for d in self.decisions) + 2, 34 if verbose else 26)
        lines = [f"  {'choice':<{name_w}}{'value':<{value_w}}why"]
        indent = 2 + name_w + value_w
        room = max(width - indent, 30)
        for d in self.decisions:
            value = _short(d.value)
            tag = " (fallback)" if d.source == "fallback" else ""  # a user's choice says so in its reason
            wrapped = (
                textwrap.wrap(d.reason + tag, room)
                if verbose
                else [_one_line(d.reason, room - len(tag)) + tag]
            )
            wrapped = wrapped or [""]
            head = f"  {d.name:<{name_w}}{value:<{value_w}}"
            if len(value) >= value_w:
                lines.append(f"  {d.name:<{name_w}}{value}")
                head = " " * indent
            lines.append(head + wrapped[0])
            lines += [" " * indent + w for w in wrapped[1:]]
        return lines

    def _memory_lines(self, width: int) -> list[str]:
        m = self.memory
        lines = ["", "Memory"]
        lines.append(f"  weights    {format_bytes(m.weights):>11}  {m.weights_key}; {m.sizing}")
        lines.append(f"  headroom   {format_bytes(m.headroom):>11}  {m.headroom_rule}")
        for b in m.budgets:
            budget = f"; max_memory {format_bytes(b.weights_budget)}" if b.weights_budget is not None else ""
            lines.append(f"  {b.device:<10} {format_bytes(b.usable):>11}  usable: {b.rule}{budget}")
        lines += textwrap.wrap(f"verdict: {m.verdict}", width, initial_indent="  ", subsequent_indent="    ")
        return lines


def _memory_line(m: MemoryEstimate) -> str:
    weights = f"{format_bytes(m.weights)} of weights ({m.weights_key})"
    return f"Memory: {weights} + {format_bytes(m.headroom)} headroom; {m.verdict}"


def _one_line(text: str, room: int) -> str:
    """``text`` in ``room`` characters: whole, else up to its last clause that fits, else to a word."""
    if len(text) <= room:
        return text
    cut = max((text.rfind(sep, 0, room - 2) for sep in ("; ", ": ", ". ", ", ", " (")), default=-1)
    if cut >= room // 2:
        return text[:cut].rstrip(" ,;:.") + " …"
    return textwrap.shorten(text, room, placeholder=" …")


def _launch_line(plan: LoadPlan) -> str:
    # Rank, world size, launcher and the process-group backend (docs/distributed.md "What xpukit decides").
    from xpukit.planning.device.distributed import process_group_backend

    launch = plan.machine.launch
    assert launch is not None
    backend, _ = process_group_backend(plan.device, plan.machine.torch_version, plan.machine.xccl_available)
    strategy = f"; strategy {plan.strategy}" if plan.strategy else ""
    return f"Launch: {launch.describe()}; backend {backend or 'chosen by accelerate'}{strategy}"


def _short(value: object) -> str:
    if isinstance(value, dict):
        return json.dumps(jsonable(value))
    return str(value)


def _jsonable_fields(obj: object) -> dict[str, Json]:
    names = getattr(obj, "__dataclass_fields__", None)
    if names:  # a field left out of repr (what was read to make it, such as an adapter's files) stays out
        return {str(n): jsonable(getattr(obj, n)) for n, f in names.items() if f.repr}
    return {}
