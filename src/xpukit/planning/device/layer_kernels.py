"""Hub layer kernels (transformers' ``use_kernels`` / ``KernelConfig``): on or off, and why.

* Only on device types ``KernelConfig`` accepts (cuda, rocm, xpu, npu, neuron, tpu): on cpu/mps
  ``use_kernels=True`` replaces nothing, silently (docs/known-issues.md "transformers: use_kernels on CPU
  replaces nothing"), so ``"auto"`` leaves it off
  and an explicit request there is refused.
* ``"auto"`` turns it on when the model registers kernel layers and every kernel transformers'
  default mapping names for them on this device (inference mode) can be had — cached, or the Hub
  reachable (:func:`xpukit.planning.device.attention.obtainable`, from the
  :class:`~xpukit.sources.hub_access.HubFacts` given). Never with LoRA: ``model.train()`` makes
  transformers re-kernelize for training mode, fetching kernels outside xpukit's time bound.
* An explicit request that cannot be had falls back to off, with the reason recorded.
* Never when some modules run on the CPU, disk or MPS (offload or a given device_map): auto leaves
  it off, an explicit request is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from xpukit._compat import version_at_least
from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import DeviceFacts
from xpukit.planning.device.attention import KernelRef, device_type, obtainable
from xpukit.planning.model.facts import ModelFacts
from xpukit.planning.vocabulary import Decision
from xpukit.sources.hub_access import HubFacts

__all__ = [
    "DEFAULT_ON_FROM",
    "KERNEL_CONFIG_DEVICES",
    "KernelsChoice",
    "choose_kernels",
    "default_on_note",
    "mapping_refs",
    "parse_kernels",
]

# transformers 5.25 turned ``use_kernels`` on when it is not given (``USE_HUB_KERNELS`` unset), and
# made ``kernels`` a required dependency (docs/known-issues.md "transformers 5.25: use_kernels on by
# default").
DEFAULT_ON_FROM = "5.25"

# Device types KernelConfig accepts (transformers KERNELS_SUPPORTED_DEVICE_TYPES): no cpu, no mps.
KERNEL_CONFIG_DEVICES = ("cuda", "rocm", "xpu", "npu", "neuron", "tpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelsChoice:
    """The ``use_kernels`` decision and the user's kernel mapping, if any."""

    decision: Decision
    use: bool
    config: object = None  # the user's mapping dict or transformers.KernelConfig, as given
    warning: str | None = None


KernelsMode = Literal["auto", "on", "off"]


def parse_kernels(value: object) -> tuple[KernelsMode, object]:
    """``kernels=`` → ``(mode, config)`` with mode ``auto``/``on``/``off``. Raises on nonsense."""
    text = value.strip().lower() if isinstance(value, str) else None
    if value is None or text == "auto":
        return "auto", None
    if value is True or text in {"on", "true", "yes", "1"}:
        return "on", None
    if value is False or text in {"off", "false", "no", "0"}:
        return "off", None
    if isinstance(value, dict) or type(value).__name__ == "KernelConfig":
        return "on", value
    raise InvalidRequestError(
        f"kernels={value!r} is not understood. Valid: 'auto', True, False, a "
        "transformers.KernelConfig, or its "
        "mapping dict {'RMSNorm': 'kernels-community/rmsnorm:RMSNorm', ...}."
    )


def choose_kernels(
    value: object,
    device: DeviceFacts,
    model: ModelFacts,
    *,
    hub: HubFacts,
    lora: bool,
    host_modules: str | None = None,
) -> KernelsChoice:
    """Decide ``use_kernels`` (see the module docstring for the rules).

    ``host_modules`` says why some modules run on the CPU, disk or MPS, where Hub kernels have no build.
    Off is always passed as ``use_kernels=False``: from transformers 5.25 leaving it out kernelizes the
    model (docs/known-issues.md "transformers 5.25: use_kernels on by default"); the reason says so there.
    """
    choice = _choose(value, device, model, hub, lora=lora, host_modules=host_modules)
    note = default_on_note(hub.kernels().transformers)
    if choice.use or note is None:
        return choice
    decision = replace(choice.decision, reason=f"{choice.decision.reason} ({note})")
    return replace(choice, decision=decision)


def default_on_note(transformers_version: str | None) -> str | None:
    """Why ``use_kernels=False`` is passed explicitly, for a transformers that kernelizes by default."""
    found = transformers_version
    if not version_at_least(found, DEFAULT_ON_FROM):
        return None
    return f"passed as use_kernels=False: transformers {found} kernelizes every model when it is left out"


def _choose(
    value: object,
    device: DeviceFacts,
    model: ModelFacts,
    hub: HubFacts,
    *,
    lora: bool,
    host_modules: str | None,
) -> KernelsChoice:
    mode, config = parse_kernels(value)
    where = device_type(device)
    if mode == "off":
        return KernelsChoice(
            decision=Decision(name="use_kernels", value=False, reason="kernels=False given", source="user"),
            use=False,
        )
    if host_modules is not None:
        why = f"{host_modules}, where Hub layer kernels have no build"
        if mode == "on" and host_modules.startswith("the given device_map"):
            raise InvalidRequestError(f"kernels={value!r}: {why}. Fix: kernels=False (or 'auto').")
        return _not_had(mode, why)
    if where not in KERNEL_CONFIG_DEVICES:
        why = (
            f"transformers' KernelConfig accepts {', '.join(KERNEL_CONFIG_DEVICES)} only; on "
            f"{device.backend} "
            "use_kernels=True replaces nothing, silently"
        )
        if mode == "on":
            raise InvalidRequestError(
                f"kernels={value!r} on {device.backend}: {why}. Fix: kernels=False (or 'auto')."
            )
        return KernelsChoice(
            decision=Decision(name="use_kernels", value=False, reason=f"off: {why}"), use=False
        )
    if mode == "auto" and lora:
        why = (
            "a LoRA model is trained, and model.train() makes transformers re-kernelize for training mode, "
            "fetching kernels outside xpukit's time bound"
        )
        return KernelsChoice(
            decision=Decision(name="use_kernels", value=False, reason=f"off: {why}", rejected=((True, why),)),
            use=False,
        )
    if mode == "auto" and not model.kernel_layers:
        why = f"{model.architecture} registers no layers for Hub kernels"
        return KernelsChoice(
            decision=Decision(name="use_kernels", value=False, reason=f"off: {why}"), use=False
        )
    support = hub.kernels()
    if config is not None:
        refs = _user_refs(config, where)
    else:  # transformers' mapping names kernels only with a kernels release it accepts
        refs = mapping_refs(model.kernel_layers, where) if support.accepted else []
    ok, why = obtainable(refs, hub) if refs else (support.accepted, support.reason)
    if ok:
        what = ", ".join(sorted({r.repo for r in refs})) or "the mapped layers"
        return KernelsChoice(
            decision=Decision(
                name="use_kernels",
                value=True,
                reason=("kernels= given: " if mode == "on" else "")
                + f"Hub kernels for {what} on {device.backend}: {why}",
                source="user" if mode == "on" else "auto",
            ),
            use=True,
            config=config,
        )
    return _not_had(mode, why)


def _not_had(mode: str, why: str) -> KernelsChoice:
    """Kernels off because they cannot be had: a recorded fallback (with a warning) when asked for."""
    if mode == "on":
        return KernelsChoice(
            decision=Decision(
                name="use_kernels",
                value=False,
                reason=f"kernels were asked but cannot be had: {why}. Loading without them",
                rejected=((True, why),),
                source="fallback",
            ),
            use=False,
            warning=f"use_kernels cannot be had ({why}); loading without Hub kernels",
        )
    return KernelsChoice(
        decision=Decision(name="use_kernels", value=False, reason=f"off: {why}", rejected=((True, why),)),
        use=False,
    )


def mapping_refs(layers: tuple[str, ...], device_type: str) -> list[KernelRef]:
    """The Hub kernels transformers' default mapping would load for these layers (inference mode);
    imports ``kernels``: only for a release transformers accepts (``HubFacts.kernels()``)."""
    if not layers:
        return []
    from kernels import Mode
    from transformers.integrations.hub_kernels import get_kernel_mapping_transformers

    mapping = get_kernel_mapping_transformers()
    refs: dict[tuple[str, Any, Any], KernelRef] = {}
    for layer in layers:
        per_device = mapping.get(layer, {})
        entry = per_device.get(device_type)
        if entry is None:
            continue
        modes = entry.items() if isinstance(entry, dict) else [(Mode.INFERENCE, entry)]
        repos = [r for m, r in modes if not isinstance(m, Mode) or Mode.INFERENCE in m or m == Mode.FALLBACK]
        for repo in repos:
            repo_id = getattr(repo, "_repo_id", None) or getattr(repo, "repo_id", None)
            if repo_id:
                version = getattr(repo, "_version", None)
                revision = getattr(repo, "_revision", None)
                refs[(repo_id, version, revision)] = KernelRef(
                    repo=repo_id, version=version, revision=revision
                )
    return list(refs.values())


def _user_refs(config: object, device_type: str) -> list[KernelRef]:
    """Repositories named in a user's KernelConfig / mapping dict (any cached version counts)."""
    mapping = config if isinstance(config, dict) else getattr(config, "kernel_mapping", {}) or {}
    if getattr(config, "use_local_kernel", False):
        return []
    refs = []
    for value in mapping.values():
        if isinstance(value, dict):
            value = value.get(device_type)
        if isinstance(value, tuple):
            value = value[0]
        if isinstance(value, str) and "/" in value:
            refs.append(KernelRef(repo=value.split(":", 1)[0].partition("@")[0]))
    return refs
