"""``plan_load``: every loading choice decided from facts, with its reason, before any weight is read.

Deciding is a pure function of the request, the machine's facts and the model's facts. The only
reads are the model's config (never its weights), the machine (only when ``facts`` is not given:
:func:`xpukit.probe.detect`), installed package versions, the local kernel cache, and — only when
a Hub-backed choice is on the table — one bounded reachability check (:mod:`xpukit.hub`).
"""

from __future__ import annotations

import difflib
import logging
import re
import sys
from pathlib import Path
from typing import Any

from xpukit.attention import choose_attention, normalize_attn
from xpukit.errors import DeviceSelectionError, DeviceUnavailableError, InvalidRequestError
from xpukit.facts import BACKENDS, DeviceFacts, MachineFacts
from xpukit.layer_kernels import choose_kernels, parse_kernels
from xpukit.layout import plan_layout
from xpukit.loadplan import Decision, LoadPlan
from xpukit.model_facts import model_facts
from xpukit.model_source import read_config
from xpukit.placement import parse_size
from xpukit.precision import DTYPES, inference_dtype, normalize_dtype
from xpukit.quantization import parse_quantize

__all__ = ["plan_load"]

logger = logging.getLogger(__name__)

_DEVICE = re.compile(r"^(?P<backend>xpu|cuda|mps|cpu)(?::(?P<index>\d+))?$")
INSTALL_FIX = {
    "xpu": "pip install torch --index-url https://download.pytorch.org/whl/xpu (and the Intel GPU driver: "
    "see 'PyTorch prerequisites for Intel GPUs')",
    "cuda": "pip install torch --index-url https://download.pytorch.org/whl/cu128 (the index for your CUDA "
    "version: see pytorch.org/get-started)",
    "mps": "MPS needs macOS 12.3+ on Apple silicon with the standard macOS torch wheel (pip install torch)",
}


def plan_load(
    model: Any,
    *,
    device: Any = None,
    dtype: Any = "auto",
    attn: Any = "auto",
    kernels: Any = "auto",
    device_map: Any = "auto",
    max_memory: dict[Any, Any] | None = None,
    quantize: Any = None,
    lora: Any = None,
    offload: bool = True,
    headroom: Any = None,
    facts: MachineFacts | str | None = None,
    model_class: Any = None,
    **from_pretrained_kwargs: Any,
) -> LoadPlan:
    """Plan how to load ``model`` for inference: device, dtype, placement, attention, kernels, 4-bit, LoRA.

    Reads the config only (offline rules honoured), never the weights. With ``facts`` given no
    device runtime is initialised.

    Args:
        model: a Hub id, a local model directory, or a ``PretrainedConfig``.
        device: ``"xpu"``, ``"xpu:1"``, ``"cuda"``, ``"mps"``, ``"cpu"`` or a ``torch.device``; default:
            the first available of xpu, cuda, mps, cpu.
        dtype: ``"auto"`` (per device family) or ``bfloat16`` / ``float16`` / ``float32``.
        attn: ``"auto"``, ``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2/3/4`` or a Hub
            kernel ``org/repo``.
        kernels: ``"auto"``, ``True``, ``False``, or a ``KernelConfig`` (or its mapping dict).
        device_map: ``"auto"`` (xpukit decides), an accelerate strategy, a device, or a dict.
        max_memory: per-device weight budgets (``{0: "10GiB", "cpu": "30GiB"}``).
        quantize: ``None``, ``"4bit"``, ``"8bit"``, ``"auto"``, a ``BitsAndBytesConfig``, or another
            transformers quantization config (``QuantoConfig``, ``GPTQConfig``…), passed through.
        lora: ``None``, ``True``, a ``LoraConfig``, a dict of its arguments, or an adapter path; new
            adapters are checked against the model's modules here (this imports peft).
        offload: allow CPU offload when the model fits nowhere else (else :class:`PlanError`).
        headroom: memory kept free beside the weights (bytes or ``"2GiB"``); default: the rule in
            docs/planning.md.
        facts: the machine to plan for: :class:`MachineFacts`, or a profile such as
            ``"max-1550"`` (one card: two FLAT stacks); default: this machine (:func:`xpukit.detect`).
        model_class: the transformers class to load with (default: the Auto class for the config).
        **from_pretrained_kwargs: passed to ``from_pretrained`` unchanged.

    Returns:
        A frozen :class:`LoadPlan`.

    Raises:
        InvalidRequestError: a bad or conflicting argument, path or model id.
        DeviceUnavailableError: the device cannot be used with this torch build or machine.
        MissingExtraError: a requested extra (bitsandbytes, peft) is missing on this machine.
        PlanError: the model fits nowhere (the message shows the numbers).

    Example:
        >>> from xpukit import plan_load
        >>> from xpukit.reference_models import reference_config
        >>> plan = plan_load(reference_config("qwen3-8b"), facts="arc-b580", quantize="4bit")
        >>> plan.device_map, plan.dtype
        ('xpu:0', 'bfloat16')
    """
    kwargs = dict(from_pretrained_kwargs)
    dtype, attn, quantize, kernels = _reconcile(
        kwargs, dtype=dtype, attn=attn, quantize=quantize, kernels=kernels
    )
    # Everything that can be checked without reading anything is checked first.
    dtype_req = _normalize_dtype_arg(dtype)
    attn = normalize_attn(attn)
    quant = parse_quantize(quantize)
    parse_kernels(kernels)
    given_headroom = parse_size(headroom, "headroom") if headroom is not None else None
    memory_limits = _normalize_max_memory(max_memory)
    device_text = _device_text(device)
    if isinstance(device_map, str) and _DEVICE.match(device_map.strip().lower()):
        mapped = device_map.strip().lower()
        if device_text is not None and device_text != mapped:
            raise InvalidRequestError(
                f"device={device!r} and device_map={device_map!r} disagree. Fix: pass one of them."
            )
        device_text = mapped
    elif device_map is not None and not isinstance(device_map, (str, dict)):
        raise InvalidRequestError(
            f"device_map={device_map!r} must be 'auto', a device, an accelerate strategy or a dict."
        )
    class_name = _check_model_class(model_class)
    _resolve_lora(lora, quantized=quant.kind in {"4bit", "8bit"})  # validate before reading anything
    config, source, name, consumed = read_config(model, kwargs)
    machine, facts_given = _machine(facts)
    if isinstance(device_map, dict):
        device_text = _device_of_map(device_map, device_text, machine)
    main, candidates, device_decision = _resolve_device(device_text, machine)
    mfacts = model_facts(config, name=name, trust_remote_code=bool(kwargs.get("trust_remote_code", False)))
    if mfacts.pre_quantized and quant.kind not in {None, "auto"}:
        raise InvalidRequestError(
            f"quantize={quantize!r}: {name} is already quantized ({mfacts.pre_quantized}); it cannot be "
            "quantized again. Fix: quantize=None."
        )

    warnings: list[str] = []
    dtype_decision = _dtype_decision(dtype_req, main, warnings)
    layout = plan_layout(
        facts=mfacts,
        machine=machine,
        main=main,
        candidates=candidates,
        dtype_decision=dtype_decision,
        quant=quant,
        device_map=device_map,
        max_memory=memory_limits,
        offload=offload,
        headroom=given_headroom,
        enforce_extras=not facts_given,
        warnings=warnings,
    )
    dtype_name = str(layout.dtype.value)
    host_modules = _host_modules(device_map, layout.max_memory, main)
    attention = choose_attention(attn, main, dtype_name, mfacts, host_modules=host_modules)
    lora_request = _resolve_lora(lora, quantized=layout.quantization is not None)
    _check_lora(lora_request, mfacts, enforce=not facts_given, warnings=warnings)
    kernel_choice = choose_kernels(
        kernels, main, mfacts, lora=lora_request is not None, host_modules=host_modules
    )
    for warning in (attention.warning, kernel_choice.warning):
        if warning:
            warnings.append(warning)
    decisions = [device_decision, layout.dtype, *layout.decisions, attention.decision, kernel_choice.decision]
    if lora_request is not None:
        decisions.append(Decision(name="lora", value=lora_request.describe(), reason=lora_request.reason))
    for warning in warnings:
        logger.warning("%s", warning)
    return LoadPlan(
        model=source,
        model_facts=mfacts,
        machine=machine,
        device=main,
        dtype=dtype_name,
        quantization=layout.quantization,
        quantization_config=layout.quantization_config,
        attn_implementation=attention.value,
        attention_kernel=attention.kernel.repo if attention.kernel else None,
        use_kernels=kernel_choice.use,
        device_map=layout.device_map,
        max_memory=layout.max_memory,
        memory=layout.memory,
        lora=lora_request,
        decisions=tuple(decisions),
        warnings=tuple(warnings),
        passthrough=kwargs,
        model_class=class_name or mfacts.auto_class,
        user_quantization_config=quant.user_config,
        kernel_config=kernel_choice.config if kernel_choice.use else None,
        config=config,
        config_kwargs=consumed,
        config_given="config" in kwargs or (source is not None and not isinstance(model, (str, Path))),
    )


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def _reconcile(kwargs: dict[str, Any], **ours: Any) -> tuple[Any, Any, Any, Any]:
    """Accept transformers' own keyword for each choice, but never both spellings at once."""
    dtype, attn, quantize, kernels = ours["dtype"], ours["attn"], ours["quantize"], ours["kernels"]
    for legacy in ("load_in_4bit", "load_in_8bit"):
        if kwargs.get(legacy):
            bits = legacy[len("load_in_") :]
            raise InvalidRequestError(
                f"{legacy}=True is not a from_pretrained argument in transformers 5. Fix: quantize='{bits}'."
            )
        kwargs.pop(legacy, None)
    pairs = (
        ("torch_dtype", "dtype", dtype, "auto"),
        ("attn_implementation", "attn", attn, "auto"),
        ("quantization_config", "quantize", quantize, None),
    )
    values = {"dtype": dtype, "attn": attn, "quantize": quantize}
    for theirs, mine, value, default in pairs:
        if theirs in kwargs:
            other = kwargs.pop(theirs)
            if value is not default and value != default:
                raise InvalidRequestError(
                    f"Both {mine}={value!r} and {theirs}={other!r} were given. Fix: pass only {mine}=."
                )
            values[mine] = other
    use_kernels = kwargs.pop("use_kernels", None)
    kernel_config = kwargs.pop("kernel_config", None)
    if (use_kernels is not None or kernel_config is not None) and kernels != "auto":
        raise InvalidRequestError(
            f"Both kernels={kernels!r} and use_kernels/kernel_config were given. Fix: pass only kernels=."
        )
    if kernel_config is not None:
        kernels = kernel_config
    elif use_kernels is not None:
        kernels = bool(use_kernels)
    return values["dtype"], values["attn"], values["quantize"], kernels


def _normalize_dtype_arg(value: Any) -> str:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    name = normalize_dtype(value)
    if name is None:
        raise InvalidRequestError(
            f"dtype={value!r} is not a dtype xpukit loads weights in. Valid: 'auto', "
            f"{', '.join(map(repr, DTYPES))} "
            "(or torch.bfloat16 …). Integer weights come from quantize='8bit' / '4bit'."
        )
    return name


def _normalize_max_memory(value: dict[Any, Any] | None) -> dict[int | str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise InvalidRequestError(
            f"max_memory={value!r} must be a non-empty dict such as {{0: '10GiB', 'cpu': '30GiB'}}."
        )
    out: dict[int | str, int] = {}
    for key, size in value.items():
        text = str(key).strip().lower()
        match = _DEVICE.match(text)
        if isinstance(key, int) or text.isdigit():
            norm: int | str = int(text)
        elif text in {"cpu", "mps", "disk"}:
            norm = text
        elif match and match["backend"] in {"xpu", "cuda"}:
            norm = int(match["index"] or 0)
        else:
            raise InvalidRequestError(
                f"max_memory key {key!r} is not a device. Use accelerator indices (0, 1, 'xpu:1'), "
                "'cpu', 'mps' or 'disk'."
            )
        out[norm] = parse_size(size, f"max_memory[{key!r}]")
    return out


def _device_text(device: Any) -> str | None:
    if device is None:
        return None
    text = str(device).strip().lower()
    if not _DEVICE.match(text):
        raise InvalidRequestError(
            f"device={device!r} is not a device. Valid: 'xpu', 'xpu:1', 'cuda', 'cuda:0', 'mps', "
            "'cpu' or a torch.device."
        )
    return text


def _check_model_class(model_class: Any) -> str | None:
    """The class name; a string must name a transformers class (checked before anything is read)."""
    if model_class is None:
        return None
    if not isinstance(model_class, str):
        if not isinstance(model_class, type) or not callable(getattr(model_class, "from_pretrained", None)):
            raise InvalidRequestError(
                f"model_class={model_class!r} has no from_pretrained. Pass a transformers model class "
                "(AutoModelForCausalLM, Qwen3ForCausalLM…) or its name."
            )
        return model_class.__name__
    import transformers

    try:
        cls = getattr(transformers, model_class)
    except (AttributeError, ImportError, RuntimeError):
        cls = None
    if cls is None or not callable(getattr(cls, "from_pretrained", None)):
        candidates = [n for n in dir(transformers) if n.startswith(("AutoModel", model_class[:4]))]
        close = difflib.get_close_matches(model_class, candidates, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise InvalidRequestError(
            f"model_class={model_class!r} is not a transformers model class.{hint} Valid: an Auto class "
            "such as 'AutoModelForCausalLM', 'AutoModelForSeq2SeqLM', 'AutoModelForImageTextToText', or "
            "a model class such as 'Qwen3ForCausalLM'."
        )
    return model_class


def _device_of_map(device_map: dict[Any, Any], device_text: str | None, machine: MachineFacts) -> str | None:
    """The device a dict device_map puts every module on (dtype, attention, kernels follow it)."""
    targets = set()
    for value in device_map.values():
        if isinstance(value, int) and not isinstance(value, bool):
            value = f"{machine.accelerator}:{value}"
        text = str(value).strip().lower()
        targets.add("cpu" if text == "disk" else text)
    if len(targets) != 1:
        return device_text
    (only,) = targets
    if not _DEVICE.match(only):
        return device_text  # plan_layout names the bad value
    if only in {"xpu", "cuda"}:
        only += ":0"
    if device_text is not None and device_text not in {only, only.split(":")[0]}:
        raise InvalidRequestError(
            f"device={device_text!r} but device_map puts every module on {only!r}. Fix: pass one of them."
        )
    return only


def _host_modules(device_map: Any, max_memory: dict[int | str, int] | None, main: DeviceFacts) -> str | None:
    """Why some modules run on the CPU, disk or MPS while the main device is an accelerator, else None.

    Hub attention and layer kernels run on xpu/cuda only; a module placed elsewhere would call them
    with tensors they have no build for.
    """
    if main.backend in {"cpu", "mps"}:
        return None
    if isinstance(device_map, dict):
        elsewhere = sorted({str(v).strip().lower() for v in device_map.values()} & {"cpu", "disk", "mps"})
        if elsewhere:
            return f"the given device_map puts modules on {', '.join(elsewhere)}"
    if max_memory and any(k in {"cpu", "disk"} for k in max_memory):
        return "the plan offloads weights to CPU memory"
    return None


def _check_lora(request: Any, facts: Any, *, enforce: bool, warnings: list[str]) -> None:
    """Check the LoRA settings and targets against the model's facts, before any weight is read."""
    if request is None or request.kind != "new":
        return
    from xpukit._compat import is_installed, require
    from xpukit.hub import hub_offline, hub_status, offline_guard
    from xpukit.lora import check_lora_request

    if not is_installed("peft"):
        if enforce:
            require("peft", "lora=True")  # MissingExtraError naming the extra
        warnings.append("peft is not installed here: the LoRA settings were not checked against the model")
        return
    # peft imports bitsandbytes, whose import reaches the Hub with no timeout on avx512_bf16 CPUs.
    guard = "peft" not in sys.modules and (hub_offline() or not hub_status().usable)
    with offline_guard(guard):
        check_lora_request(request, facts)


# ---------------------------------------------------------------------------------------------
# Machine and device
# ---------------------------------------------------------------------------------------------


def _machine(facts: MachineFacts | str | None) -> tuple[MachineFacts, bool]:
    if isinstance(facts, MachineFacts):
        return facts, True
    if isinstance(facts, str):
        from xpukit.profiles import machine_profile, parse_assume

        name, count = parse_assume(facts)
        return machine_profile(name, count), True
    if facts is not None:
        raise InvalidRequestError(
            f"facts={facts!r} must be MachineFacts or a profile name such as 'arc-b580x2'."
        )
    from xpukit.probe import detect

    return detect(devices=True), False


def _resolve_device(
    text: str | None, machine: MachineFacts
) -> tuple[DeviceFacts, tuple[DeviceFacts, ...], Decision]:
    order = ", ".join(BACKENDS)
    if text is None:
        if machine.devices:
            main = machine.devices[0]
            n = len(machine.devices)
            plural = "s" if n > 1 else ""
            reason = (
                f"first available backend in the order {order}: {n} {main.backend} device{plural} visible"
            )
            return main, machine.devices, Decision(name="device", value=main.torch_device, reason=reason)
        built = ", ".join(machine.compiled) or "CPU only"
        reason = f"no accelerator visible (torch build: {built}), so the CPU"
        return machine.cpu, (machine.cpu,), Decision(name="device", value="cpu", reason=reason)
    match = _DEVICE.match(text)
    assert match is not None  # checked by _device_text
    backend, index = match["backend"], match["index"]
    if backend == "cpu":
        return (
            machine.cpu,
            (machine.cpu,),
            Decision(name="device", value="cpu", reason="asked", source="user"),
        )
    if backend not in machine.compiled:
        build = machine.torch_version or "not installed"
        raise DeviceUnavailableError(
            f"device={text!r} was asked, but this torch build ({build}) has no {backend.upper()} support "
            f"(compiled backends: {', '.join(machine.compiled) or 'none'}). Fix: {INSTALL_FIX[backend]}"
        )
    devices = machine.devices_of(backend)
    if not devices:
        notes = "; ".join(machine.notes)
        raise DeviceUnavailableError(
            f"device={text!r} was asked; torch supports {backend} but no {backend} device is visible"
            + (f" ({notes})" if notes else "")
            + ". Check the driver, that the user is in the 'render' group (XPU), and ZE_AFFINITY_MASK / "
            "CUDA_VISIBLE_DEVICES; `xpukit doctor` shows what is seen."
        )
    if index is None:
        reason = f"asked for {backend}; {len(devices)} visible"
        return (
            devices[0],
            devices,
            Decision(name="device", value=devices[0].torch_device, reason=reason, source="user"),
        )
    for d in devices:
        if d.index == int(index):
            return d, (d,), Decision(name="device", value=d.torch_device, reason="asked", source="user")
    raise DeviceSelectionError(
        f"device={text!r}: only {len(devices)} {backend} device(s) are visible "
        f"({', '.join(d.torch_device for d in devices)}). Fix: use one of those indices."
    )


def _dtype_decision(requested: str, device: DeviceFacts, warnings: list[str]) -> Decision:
    if requested == "auto":
        choice = inference_dtype(device)
        return Decision(name="dtype", value=choice.dtype, reason=choice.reason, rejected=choice.rejected)
    reason = "asked"
    emulated = (requested == "bfloat16" and not device.native_bf16) or (
        requested == "float16" and device.backend == "cpu"
    )
    if emulated:
        native = inference_dtype(device).dtype
        warning = f"dtype={requested} on {device.name} is only emulated (slow); {native} is native here"
        warnings.append(warning)
        reason = f"asked; {warning}"
    return Decision(name="dtype", value=requested, reason=reason, source="user")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _resolve_lora(lora: Any, *, quantized: bool) -> Any:
    if lora is None:
        return None
    from xpukit.lora import resolve_lora  # written alongside; imported only when LoRA is asked for

    return resolve_lora(lora, quantized=quantized)
