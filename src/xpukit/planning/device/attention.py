"""Attention implementation: what to ask transformers for, and why; and whether Hub kernels can be had.

Rules (docs/planning.md "Decision rules", docs/known-issues.md "transformers: flash-attention requests on
CPU and the Hub fallback" and docs/known-issues.md "transformers: the kernels version window" and
docs/known-issues.md "huggingface_hub 2.4: Hub requests without a timeout", docs/platform-notes.md
§4.5–4.7):

* SDPA by default; eager only when asked or when the architecture has no SDPA.
* flash-attention-2 from the Hub (``kernels-community/flash-attn2``) only on xpu/cuda (CUDA from
  compute capability 8.0), fp16/bf16, for architectures that support it, with a ``kernels``
  release this transformers accepts, and the kernel obtainable: in the local cache, or the Hub
  reachable and not offline. ``attn="auto"`` takes it when all of that holds; an explicit request
  that cannot be had falls back to SDPA with the reason recorded.
* On Intel GPUs ``attn="auto"`` considers it only on the families its XPU builds target (Data
  Center Max, Arc B-series, Lunar Lake, Panther Lake); elsewhere (Arc A, Meteor Lake, Flex…) only
  an explicit request takes it, with a warning on the plan.
* Never when some modules run on the CPU, disk or MPS (offload, or a given device_map): auto picks
  SDPA, an explicit request is refused.
* FlashAttention-3/4 exist for NVIDIA Hopper/Blackwell only (their Hub builds ship CUDA binaries):
  refused elsewhere with the reason.

:func:`obtainable` (a kernels release transformers accepts, and the kernel cached or the Hub
reachable) is shared with :mod:`xpukit.planning.device.layer_kernels`, which decides ``use_kernels``.
Both decide from a :class:`~xpukit.sources.hub_access.HubFacts` they are given and read nothing
themselves: the Hub is asked only when a Hub kernel is on the table and not cached.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import DeviceFacts
from xpukit.planning.model.facts import ModelFacts
from xpukit.planning.vocabulary import Decision
from xpukit.sources.hub_access import RECHECK_HINT, HubFacts

__all__ = [
    "AttentionChoice",
    "KernelRef",
    "choose_attention",
    "device_type",
    "normalize_attn",
    "obtainable",
]

KERNEL_PATTERN = re.compile(r"^[^/:@]+/[^/:@]+(?:@[^/:]+)?(?::[^/:]+)?$")  # transformers' is_kernel()


@dataclass(frozen=True, slots=True)
class _FlashSpec:
    repo: str
    devices: tuple[str, ...]
    min_cc: tuple[int, int]
    package: str | None  # a pip package that provides it without the Hub


FLASH = {
    "flash_attention_2": _FlashSpec("kernels-community/flash-attn2", ("cuda", "xpu"), (8, 0), "flash_attn"),
    "flash_attention_3": _FlashSpec(
        "kernels-community/vllm-flash-attn3", ("cuda",), (9, 0), "flash_attn_interface"
    ),
    "flash_attention_4": _FlashSpec("kernels-community/flash-attn4", ("cuda",), (9, 0), None),
}
# Devices each known Hub attention kernel ships builds for (transformers' FLASH_ATTN_KERNEL_DEVICES);
# unlisted kernels are assumed to run everywhere, as transformers assumes.
KERNEL_DEVICES = {spec.repo: spec.devices for spec in FLASH.values()} | {
    "kernels-community/flash-attn3": ("cuda",),
    "kernels-community/aiter-flash-attn": ("rocm",),
    "kernels-community/metal-flash-sdpa": ("mps",),
}
NAMED = ("auto", "sdpa", "eager", "flex_attention", *FLASH)


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelRef:
    """A Hub kernel: repository, and the version or revision to load."""

    repo: str
    version: int | None = None
    revision: str | None = None

    def cached(self, hub: HubFacts) -> bool:
        """Whether it is in the local kernel cache, as ``hub`` says."""
        return hub.cached(self.repo, version=self.version, revision=self.revision)

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else f"{self.repo} (v{self.version})"


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionChoice:
    """The attention decision and, for a Hub kernel, what to fetch."""

    decision: Decision
    value: str
    kernel: KernelRef | None = None
    warning: str | None = None


def normalize_attn(value: object) -> str:
    """Validate ``attn=`` (before anything is read). Raises InvalidRequestError for unknown names."""
    if value is None:
        return "auto"
    text = str(value).strip()
    if text in NAMED or KERNEL_PATTERN.match(text):
        return text
    raise InvalidRequestError(
        f"attn={value!r} is not an attention implementation. Valid: {', '.join(NAMED)}, or a Hub kernel "
        "'org/repo[@revision][:function]' such as 'kernels-community/flash-attn2'."
    )


def device_type(device: DeviceFacts) -> str:
    """The kernels library's device type: ``rocm`` for AMD GPUs (torch's cuda), else the backend."""
    return "rocm" if device.family == "amd" else device.backend


def obtainable(refs: list[KernelRef], hub: HubFacts) -> tuple[bool, str]:
    """Whether Hub kernels can be had: accepted ``kernels`` release, and cached or Hub reachable.

    The cache is asked first; the Hub's status (a bounded check) only when a kernel is not cached.
    """
    support = hub.kernels()
    if not support.accepted:
        return False, support.reason
    missing = [r for r in refs if not r.cached(hub)]
    if not missing:
        return True, "in the local kernel cache"
    status = hub.status()
    names = ", ".join(str(r) for r in missing)
    if status.usable:
        return True, f"not cached yet; the Hub answers ({status.reason}), fetched at load under a time bound"
    if status.offline:
        return False, (
            f"{names} not in the local cache and HF_HUB_OFFLINE is set. Fix: load once while online "
            "(the kernels library caches what it fetches), or unset HF_HUB_OFFLINE"
        )
    return (
        False,
        f"{names} not in the local cache and the Hub cannot be used: {status.reason} ({RECHECK_HINT})",
    )


def _kernel_ref(text: str) -> KernelRef:
    repo = text.split(":", 1)[0]
    repo, _, revision = repo.partition("@")
    if revision:
        return KernelRef(repo=repo, revision=revision)
    return KernelRef(repo=repo, version=_kernel_version(repo))


def _kernel_version(repo: str) -> int:
    # transformers pins a major version per attention kernel (FLASH_ATTN_KERNEL_VERSIONS, e.g. v4 of
    # flash-attn2 from torch 2.10); unknown repos get 1, as in transformers.
    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_VERSIONS
    except ImportError:
        return 1
    return int(FLASH_ATTN_KERNEL_VERSIONS.get(repo, 1))


def choose_attention(
    attn: str,
    device: DeviceFacts,
    dtype: str,
    model: ModelFacts,
    *,
    hub: HubFacts,
    host_modules: str | None = None,
) -> AttentionChoice:
    """Decide ``attn_implementation`` (see the module docstring for the rules).

    ``hub`` answers whether a Hub kernel can be had (asked only when one is on the table);
    ``host_modules`` says why some modules run off the accelerator (CPU offload, a device_map with
    ``cpu``/``disk``/``mps``): a Hub or flash kernel has no build for them.
    """
    named = _named_choice(attn, model)
    if named is not None:
        return named
    default = _Default.of(model)
    explicit = attn != "auto"
    if host_modules is not None:
        return _off_accelerator(attn, explicit, host_modules, default)
    family_note = _intel_family_problem(device)
    if family_note is not None and not explicit:
        return default.choice(rejected=(("kernels-community/flash-attn2", family_note),))
    asked = attn if explicit else "flash_attention_2"
    problem, value, kernel, how = _flash_path(asked, device, dtype, model, hub)
    if problem is None:
        return _flash_taken(attn, explicit, device, value, kernel, how, family_note)
    return _flash_not_had(attn, explicit, problem, default)


def _named_choice(attn: str, model: ModelFacts) -> AttentionChoice | None:
    """``eager``, ``sdpa`` and ``flex_attention``: taken as asked (refused where the model lacks it)."""
    if attn == "eager":
        return _asked("eager")
    if attn == "sdpa":
        if not model.supports_sdpa:
            raise InvalidRequestError(
                f"attn='sdpa': {model.architecture} has no SDPA implementation. Fix: attn='eager' or 'auto'."
            )
        return _asked("sdpa")
    if attn == "flex_attention":
        if not model.supports_flex_attn:
            raise InvalidRequestError(
                f"attn='flex_attention': {model.architecture} does not support it. Fix: attn='sdpa'."
            )
        return _asked(
            "flex_attention",
            "note the first generate compiles with torch.compile (52 s once on a 2-core CPU)",
        )
    return None


@dataclass(frozen=True, slots=True)
class _Default:
    """SDPA, or eager for an architecture without SDPA, and why."""

    value: str
    reason: str

    @classmethod
    def of(cls, model: ModelFacts) -> _Default:
        if model.supports_sdpa:
            return cls(
                "sdpa",
                "SDPA: torch's fused attention, fast on every device (GQA native on XPU from torch 2.8)",
            )
        return cls("eager", f"{model.architecture} has no SDPA implementation, so eager is required")

    def choice(self, *, rejected: tuple[tuple[str, str], ...]) -> AttentionChoice:
        """The default, taken by ``attn="auto"`` with flash-attention rejected for a reason."""
        decision = Decision(
            name="attn_implementation", value=self.value, reason=self.reason, rejected=rejected
        )
        return AttentionChoice(decision=decision, value=self.value)

    def fallback(self, attn: str, why: str) -> AttentionChoice:
        """The default in place of an explicit request that cannot be had, with a warning."""
        return AttentionChoice(
            decision=Decision(
                name="attn_implementation",
                value=self.value,
                reason=f"{attn} was asked but cannot be had: {why}. Falling back to {self.value}",
                rejected=((attn, why),),
                source="fallback",
            ),
            value=self.value,
            warning=f"attn={attn!r} cannot be had ({why}); using {self.value} instead",
        )


def _off_accelerator(attn: str, explicit: bool, host_modules: str, default: _Default) -> AttentionChoice:
    """Some modules run on the CPU, disk or MPS: auto takes the default, an explicit request falls back
    (or is refused when the user's own device_map put them there)."""
    why = f"{host_modules}, where flash-attention kernels have no build"
    if explicit and host_modules.startswith("the given device_map"):
        raise InvalidRequestError(
            f"attn={attn!r}: {why}. Fix: attn='sdpa', or a device_map without cpu/disk/mps."
        )
    if explicit:
        return default.fallback(attn, why)
    return default.choice(rejected=(("kernels-community/flash-attn2", why),))


def _flash_taken(
    attn: str,
    explicit: bool,
    device: DeviceFacts,
    value: str,
    kernel: KernelRef | None,
    how: str,
    family_note: str | None,
) -> AttentionChoice:
    """Flash attention can be had: taken (with a warning off the Intel families its kernels target)."""
    warning = None
    if family_note is not None and explicit:
        warning = f"attn={attn!r} on {device.name}: {family_note}; it may fail or be slow here"
        how = f"{how}; {family_note}"
    decision = Decision(
        name="attn_implementation",
        value=value,
        reason=f"attn={attn!r} given: {how}" if explicit else how,
        rejected=() if explicit else (("sdpa", "flash-attention-2 can be had here and is faster"),),
        source="user" if explicit else "auto",
    )
    return AttentionChoice(decision=decision, value=value, kernel=kernel, warning=warning)


def _flash_not_had(attn: str, explicit: bool, problem: str, default: _Default) -> AttentionChoice:
    """Flash attention cannot be had: refused when it cannot work on this device at all, else the
    default (a fallback with a warning when it was asked for)."""
    if explicit and problem.startswith("!"):  # cannot work on this device at all: refuse
        raise InvalidRequestError(problem[1:])
    problem = problem.lstrip("!")
    if explicit:
        return default.fallback(attn, problem)
    return default.choice(rejected=(("kernels-community/flash-attn2", problem.split(" Fix: ")[0]),))


# Intel families the Hub flash-attn2 XPU kernels target: Data Center Max (Ponte Vecchio) and Xe2
# (Battlemage, Lunar Lake) — pytorch#167057 "we support Intel Ponte Vecchio and Battlemage";
# Dao-AILab/flash-attention#1528 lists Max, B580 and 140V. Panther Lake is Xe3, the successor.
FLASH_XPU_FAMILIES = ("max", "arc-b", "lunar-lake", "panther-lake")


def _intel_family_problem(device: DeviceFacts) -> str | None:
    if device.backend != "xpu" or device.family in FLASH_XPU_FAMILIES:
        return None
    return (
        f"the Intel flash-attn2 kernels target {', '.join(FLASH_XPU_FAMILIES)} GPUs, not "
        f"{device.family} (pytorch#167057, Dao-AILab/flash-attention#1528)"
    )


def _flash_path(
    attn: str, device: DeviceFacts, dtype: str, model: ModelFacts, hub: HubFacts
) -> tuple[str | None, str, KernelRef | None, str]:
    """``(problem, value, kernel, reason)``; a problem starting with ``!`` refuses an explicit request."""
    spec = FLASH.get(attn)
    dtype_ok = dtype in {"bfloat16", "float16"}
    if spec is not None:
        where = device_type(device)
        if spec.min_cc == (9, 0) and device.backend != "cuda":
            return (
                f"!attn={attn!r} on {device.backend}: FlashAttention-{attn[-1]} exists for NVIDIA "
                "Hopper/Blackwell "
                f"only (the Hub build {spec.repo} ships CUDA binaries). Fix: attn='flash_attention_2' "
                "(Hub kernel, xpu/cuda) or attn='sdpa'.",
                "",
                None,
                "",
            )
        repo = "kernels-community/aiter-flash-attn" if where == "rocm" else spec.repo
        if where not in spec.devices and where != "rocm":
            return (
                f"!attn={attn!r} on {device.backend}: {repo} has builds for "
                f"{'/'.join(spec.devices)} only. Fix: attn='sdpa'.",
                "",
                None,
                "",
            )
        cc = device.compute_capability
        if device.backend == "cuda" and where == "cuda" and cc is not None and cc < spec.min_cc:
            need = f"{spec.min_cc[0]}.{spec.min_cc[1]}"
            return (
                f"!attn={attn!r}: {device.name} has compute capability {cc[0]}.{cc[1]}, the kernel "
                f"needs {need}+. Fix: attn='sdpa'.",
                "",
                None,
                "",
            )
    else:
        repo = _kernel_ref(attn).repo
        devices = KERNEL_DEVICES.get(repo)
        if devices is not None and device_type(device) not in devices:
            return (
                f"!attn={attn!r} on {device.backend}: {repo} has builds for {'/'.join(devices)} "
                "only. Fix: attn='sdpa'.",
                "",
                None,
                "",
            )
    if not model.supports_flash_attn:
        return (f"!{model.architecture} does not support flash attention. Fix: attn='sdpa'.", "", None, "")
    if not dtype_ok:
        return (
            f"!flash attention computes in fp16/bf16, the plan's dtype is {dtype}. Fix: "
            "dtype='bfloat16' (or 'float16').",
            "",
            None,
            "",
        )
    if spec is not None and device.backend == "cuda" and spec.package:
        from xpukit._compat import is_installed

        if is_installed(spec.package):
            return None, attn, None, f"the {spec.package} package is installed: {attn} without the Hub"
    text = spec.repo if spec is not None else attn
    if spec is not None and device_type(device) == "rocm":
        text = "kernels-community/aiter-flash-attn"
    kernel = _kernel_ref(text)
    ok, why = obtainable([kernel], hub)
    if not ok:
        return why, "", None, ""
    return None, text, kernel, f"Hub kernel {kernel} for {device.backend}: {why}"


def _asked(value: str, reason: str = "") -> AttentionChoice:
    """The user's explicit choice, taken as given."""
    said = f"attn={value!r} given" + (f": {reason}" if reason else "")
    return AttentionChoice(
        decision=Decision(name="attn_implementation", value=value, reason=said, source="user"),
        value=value,
    )
