"""What ``lora=`` asks for: :func:`resolve_lora` → a frozen :class:`LoraRequest` (pure).

It reads nothing (a trained adapter's files come read, :mod:`xpukit.sources.adapter_files`), and
does not import peft: the keys are checked against peft's ``LoraConfig`` keywords by name. Fitting
the request to the model and checking it with peft is :mod:`xpukit.planning.training.lora_config`;
applying it is :func:`xpukit.loading.lora.apply_lora`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from xpukit.errors import InvalidRequestError, name_hints
from xpukit.sources.adapter_files import AdapterFiles

__all__ = [
    "DEFAULT_LORA",
    "LORA_CONFIG_KEYS",
    "LoraRequest",
    "LoraSettings",
    "PeftLoraKeywords",
    "rank_problem",
    "resolve_lora",
    "targets_text",
]

# lora=True. r=16 with alpha=32 (scale alpha/r = 2) is the common QLoRA-era default: enough capacity
# for instruction or domain tuning on every linear layer, about 0.5 % of an 8B model's parameters.
# Dropout 0: measured on the demo fine-tune (docs/training-plan.md "lora_dropout: why 0"), 0.05 gave no
# better held-out loss, 20 % fewer tokens/s and a copy of every LoRA layer's input (peft's and
# unsloth's default is 0 too). "all-linear" targets every linear
# layer but the output head, on any architecture (peft's per-model default list misses new ones).
# task_type is the causal-LM one; plan_load replaces it with the model class's task unless given.
DEFAULT_LORA: dict[str, Any] = {
    "r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "target_modules": "all-linear",
    "bias": "none",
    "task_type": "CAUSAL_LM",
}


class PeftLoraKeywords(TypedDict, total=False):
    """The keyword arguments of peft's ``LoraConfig`` (peft 0.17–0.21), with peft's types; peft's own
    config objects (LoftQ, EVA, CorDA…) are named ``object``. Checked without importing peft, so a
    typo is refused at once; a key only newer peft knows can still be passed in a ``LoraConfig``."""

    task_type: str | None
    base_model_name_or_path: str | None
    revision: str | None
    inference_mode: bool
    r: int
    target_modules: list[str] | str | None
    exclude_modules: list[str] | str | None
    lora_alpha: float
    lora_dropout: float
    fan_in_fan_out: bool
    bias: Literal["none", "all", "lora_only"]
    use_rslora: bool
    modules_to_save: list[str] | None
    init_lora_weights: bool | str
    layers_to_transform: list[int] | int | None
    layers_pattern: list[str] | str | None
    rank_pattern: dict[str, int] | None
    alpha_pattern: dict[str, float] | None
    megatron_config: dict[str, object] | None
    megatron_core: str | None
    trainable_token_indices: list[int] | dict[str, list[int]] | None
    loftq_config: object
    eva_config: object
    corda_config: object
    lora_ga_config: object
    use_dora: bool
    velora_config: object
    alora_invocation_tokens: list[int] | None
    use_qalora: bool
    qalora_group_size: int
    monteclora_config: object
    layer_replication: list[tuple[int, int]] | None
    runtime_config: object
    lora_bias: bool
    target_parameters: list[str] | None
    use_bdlora: object
    arrow_config: object
    kasa_config: object
    ensure_weight_tying: bool


class LoraSettings(PeftLoraKeywords, total=False):
    """``lora=`` as a dict: peft's ``LoraConfig`` keywords, laid over :data:`DEFAULT_LORA`, and
    xpukit's own keys (each ``None`` or left out: decided while planning)."""

    gradient_checkpointing: bool | Literal["offload"] | None
    liger: bool | None
    fused: bool | None
    graphs: bool | None
    packing: bool | None


LORA_CONFIG_KEYS: frozenset[str] = PeftLoraKeywords.__optional_keys__
# Keys of a lora= dict that steer xpukit rather than peft.
_XPUKIT_KEYS = LoraSettings.__optional_keys__ - LORA_CONFIG_KEYS
# LoraConfig fields that describe the object, not the adapter.
_NOT_KWARGS = frozenset({"peft_type", "auto_mapping", "peft_version"})


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraRequest:
    """What ``lora=`` asked for, resolved and validated.

    Attributes:
        kind: ``"new"`` (fresh trainable adapters) or ``"adapter"`` (a trained adapter: for inference, or
            to train further with ``trainable``).
        config: keyword arguments for ``peft.LoraConfig`` (for ``"adapter"``: the saved config, for
            display only).
        adapter_path: the adapter directory when ``kind == "adapter"``.
        gradient_checkpointing: non-reentrant gradient checkpointing when applying (``True``), also
            with the saved activations offloaded to host memory (``"offload"``), or none (``False``);
            for new adapters the training plan decides it by fit unless ``lora=`` gave it.
        reason: why these settings.
        liger: use liger-kernel's fused kernels: ``None`` decides by device and installation,
            ``False`` never (``lora={"liger": False}``), ``True`` insists (a note says when it cannot).
        given: the ``config`` keys the user set; the others (``task_type``, ``modules_to_save``,
            ``target_modules``) follow the model class
            (:func:`xpukit.planning.training.lora_config.fit_lora_to_class`).
        gradient_checkpointing_given: ``lora=`` set ``gradient_checkpointing`` (the plan keeps it).
        liger_given: ``lora=`` set ``liger`` (the plan keeps it; ``liger`` is the plan's value after
            planning, so this says who chose it).
        fused: xpukit's fused 4-bit LoRA path: ``None`` decides by fit and device, ``False`` never
            (``lora={"fused": False}``), ``True`` insists (refused where it cannot run;
            :mod:`xpukit.planning.training.fused`).
        graphs: CUDA graphs of the decoder layers: ``None`` decides (on where measured), ``False``
            never, ``True`` insists (:mod:`xpukit.planning.training.graphs`).
        packing: padded training batches run as one row of their real tokens: ``None`` decides,
            ``False`` never, ``True`` insists (:mod:`xpukit.planning.training.packing`).
        loss: the training plan's loss (``"plain"``, ``"liger"``, ``"chunked"``); ``None`` before
            planning. ``"chunked"`` makes loading apply xpukit's chunked cross-entropy.
        trainable: for ``"adapter"``: loaded to train further (``trainable=True``), not for inference.
        files: for ``"adapter"``: the directory's files as read before planning (its config, tensor
            table and base record).
    """

    kind: Literal["new", "adapter"]
    config: dict[str, Any]
    adapter_path: str | None
    gradient_checkpointing: bool | str
    reason: str
    liger: bool | None = None
    given: frozenset[str] = frozenset()
    gradient_checkpointing_given: bool = False
    liger_given: bool = False
    fused: bool | None = None
    graphs: bool | None = None
    packing: bool | None = None
    loss: str | None = None
    trainable: bool = False
    # The training plan's: only the first this many layers checkpointed inside the graphs (None: all).
    checkpoint_layers: int | None = None
    files: AdapterFiles | None = field(default=None, repr=False, compare=False)  # not in the plan's JSON

    @property
    def trains(self) -> bool:
        """Adapters to train: new ones, or a saved one loaded with ``trainable=True``."""
        return self.kind == "new" or self.trainable

    def for_base(self, *, quantized: bool) -> LoraRequest:
        """New adapters on a base the layout quantizes (or not): gradient checkpointing's default,
        on for a quantized base, unless ``lora=`` gave it (the training plan then decides by fit)."""
        if self.kind != "new" or self.gradient_checkpointing_given:
            return self
        return dataclasses.replace(self, gradient_checkpointing=quantized)

    def describe(self) -> str:
        """One line for the plan's explain table."""
        c = self.config
        if self.kind == "adapter":
            saved = f"r={c.get('r')}, targets {targets_text(c.get('target_modules'))}" if c else "saved"
            use = "trained further (trainable=True)" if self.trainable else "inference only"
            return f"LoRA adapter {self.adapter_path} ({saved}), {use}"
        gc = self.gradient_checkpointing if isinstance(self.gradient_checkpointing, str) else "off"
        gc = "on" if self.gradient_checkpointing is True else gc
        return (
            f"new LoRA r={c.get('r')} alpha={c.get('lora_alpha')} dropout={c.get('lora_dropout')} "
            f"{targets_text(c.get('target_modules'))}, checkpointing {gc}"
        )


def resolve_lora(
    lora: object, *, quantized: bool, trainable: object = False, files: AdapterFiles | None = None
) -> LoraRequest | None:
    """Validate ``lora=`` and resolve it to a :class:`LoraRequest` (no model, no peft import).

    Args:
        lora: ``None``/``False`` (no LoRA); ``True`` (new adapters with :data:`DEFAULT_LORA`); a dict
            of ``LoraConfig`` keywords laid over those defaults (plus xpukit's own
            ``gradient_checkpointing`` and ``liger`` keys); a ``peft.LoraConfig``; or the path of a
            trained adapter directory (loaded for inference).
        quantized: the base model is loaded in 4/8-bit (gradient checkpointing then defaults on).
        trainable: with an adapter path, load it to train further (its weights trainable).
        files: with an adapter path, its files as read
            (:func:`xpukit.sources.adapter_files.read_adapter_files`).

    Returns:
        The request, or ``None`` when no LoRA is wanted.

    Raises:
        InvalidRequestError: an unknown key, a wrong type, an adapter directory without
            ``adapter_config.json``, or ``trainable=True`` without an adapter path.

    Example::

        >>> resolve_lora(True, quantized=True).describe()
        'new LoRA r=16 alpha=32 dropout=0.0 all-linear, checkpointing on'
    """
    if not isinstance(trainable, bool):
        raise InvalidRequestError(f"trainable={trainable!r}: must be True or False.")
    if trainable and not isinstance(lora, str | os.PathLike):
        raise InvalidRequestError(
            f"trainable=True with lora={lora!r}: trainable=True loads a saved adapter to train it further. "
            "Fix: load_for_xpu(base, lora='path/to/adapter', trainable=True); new adapters (lora=True or a "
            "config) are trainable already, so drop trainable= for them."
        )
    if lora is None or lora is False:
        return None
    if lora is True:
        return _new(dict(DEFAULT_LORA), quantized, None, None, "lora=True given: xpukit's defaults")
    if isinstance(lora, dict):
        return _from_dict(lora, quantized)
    if isinstance(lora, str | os.PathLike):
        if files is None or files.path != str(Path(os.fspath(lora))):
            raise InvalidRequestError(
                f"lora={lora!r}: the adapter's files were not read. Fix: build the request with "
                "xpukit.planning.request.LoadRequest(lora=...), which reads them."
            )
        return _from_files(files, trainable)
    if type(lora).__name__ == "LoraConfig" and dataclasses.is_dataclass(lora):
        config = _config_kwargs(lora)
        _check_numbers(config)
        given = frozenset(k for k, v in config.items() if v is not None)
        return _new(config, quantized, None, None, "lora= given: your LoraConfig, as is", given)
    raise InvalidRequestError(
        f"lora={lora!r} ({type(lora).__name__}) is not understood. Valid: None/False, True, a dict of "
        "LoraConfig keywords, a peft.LoraConfig, or the path of a trained adapter directory."
    )


def _new(
    config: dict[str, Any],
    quantized: bool,
    gc: bool | str | None,
    liger: bool | None,
    origin: str,
    given: frozenset[str] = frozenset(),
    fused: bool | None = None,
    graphs: bool | None = None,
    packing: bool | None = None,
) -> LoraRequest:
    gradient_checkpointing = quantized if gc is None else gc
    # Without a choice, plan_load's training plan decides by fit (the gradient_checkpointing decision);
    # this default (on for quantised training) is what apply_lora uses on a request made without a plan.
    why_gc = "from lora=" if gc is not None else "chosen by fit (see the gradient_checkpointing decision)"
    return LoraRequest(
        kind="new",
        config=config,
        adapter_path=None,
        gradient_checkpointing=gradient_checkpointing,
        liger=liger,
        reason=f"{origin}; gradient checkpointing {why_gc}",
        given=given,
        gradient_checkpointing_given=gc is not None,
        liger_given=liger is not None,
        fused=fused,
        graphs=graphs,
        packing=packing,
    )


def _from_dict(lora: dict[Any, Any], quantized: bool) -> LoraRequest:
    bad = [k for k in lora if not isinstance(k, str) or (k not in LORA_CONFIG_KEYS | _XPUKIT_KEYS)]
    if bad:
        hints = name_hints(bad, LORA_CONFIG_KEYS | _XPUKIT_KEYS)
        raise InvalidRequestError(
            f"lora= dict has unknown keys: {hints}. Valid keys are peft.LoraConfig's "
            f"({', '.join(sorted(LORA_CONFIG_KEYS))}) and xpukit's gradient_checkpointing, liger, fused, "
            "graphs and packing. "
            "A key only a newer peft knows can be passed as a peft.LoraConfig object instead."
        )
    options = dict(lora)
    gc = options.pop("gradient_checkpointing", None)
    liger = options.pop("liger", None)
    fused = options.pop("fused", None)
    graphs = options.pop("graphs", None)
    packing = options.pop("packing", None)
    for name, value in (
        ("gradient_checkpointing", gc),
        ("liger", liger),
        ("fused", fused),
        ("graphs", graphs),
        ("packing", packing),
    ):
        offload = name == "gradient_checkpointing" and value == "offload"
        if value is not None and not isinstance(value, bool) and not offload:
            valid = "True or False" + (" (or 'offload')" if name == "gradient_checkpointing" else "")
            raise InvalidRequestError(f"lora={{'{name}': {value!r}}}: must be {valid}.")
    _check_numbers(options)
    keys = ", ".join(sorted(options))
    origin = (
        f"lora= given: xpukit's LoraConfig defaults with {keys} from it"
        if options
        else "lora= given: xpukit's LoraConfig defaults (the dict sets only xpukit's options)"
    )
    return _new(
        {**DEFAULT_LORA, **options}, quantized, gc, liger, origin, frozenset(options), fused, graphs, packing
    )


def _check_numbers(options: dict[str, Any]) -> None:
    """The numeric settings peft only checks while it changes the model (too late to refuse cleanly)."""
    r, alpha, dropout = options.get("r", 1), options.get("lora_alpha", 1), options.get("lora_dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise InvalidRequestError(
            f"lora={{'r': {r!r}}}: the rank must be a positive integer (e.g. 8, 16, 64)."
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise InvalidRequestError(
            f"lora={{'lora_alpha': {alpha!r}}}: must be a positive number (commonly r or 2*r)."
        )
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise InvalidRequestError(f"lora={{'lora_dropout': {dropout!r}}}: must be in [0, 1).")


def rank_problem(request: LoraRequest, hidden: int) -> str | None:
    """Why a new adapter's rank cannot pay for itself on a model of width ``hidden``, else ``None``.

    A layer's LoRA update ``B @ A`` has rank at most ``min(in, out)``, which is at most the hidden size
    for every linear layer of a decoder (docs/training.md "`lora=`"); a larger ``r`` only adds
    ``r * (in + out)`` parameters per layer, and their memory, with nothing to learn in them.
    """
    r = request.config.get("r")
    if request.kind != "new" or not isinstance(r, int) or r <= hidden:
        return None
    return (
        f"lora={{'r': {r}}}: the rank is larger than the model's hidden size ({hidden}), and a layer's "
        f"LoRA update has rank at most min(in, out) <= {hidden}: the extra rank only adds parameters "
        f"and memory. Fix: r <= {hidden} (8 to 64 is usual; 16 is xpukit's default)."
    )


def _from_files(files: AdapterFiles, trainable: bool) -> LoraRequest:
    return LoraRequest(
        kind="adapter",
        config=files.config,
        adapter_path=files.path,
        gradient_checkpointing=False,
        reason="a trained adapter directory, trainable=True: its weights trainable, the training plan made "
        "for it"
        if trainable
        else "a trained adapter directory: loaded for inference (eval mode, not trainable)",
        trainable=trainable,
        files=files,
    )


def _config_kwargs(config: object) -> dict[str, Any]:
    """A LoraConfig's keyword arguments (sets become sorted lists; enums their values)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        if not f.init or f.name in _NOT_KWARGS:
            continue
        value = getattr(config, f.name)
        if isinstance(value, set | frozenset):
            value = sorted(value)
        elif hasattr(value, "value") and type(value).__module__.startswith("peft"):
            value = value.value  # TaskType enum -> "CAUSAL_LM"
        out[f.name] = value
    return out


def targets_text(targets: object) -> str:
    if isinstance(targets, list | tuple | set):
        return ",".join(sorted(map(str, targets)))
    return str(targets)
