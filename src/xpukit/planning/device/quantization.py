"""bitsandbytes quantization requests: what was asked, whether this device and install can do it.

* For a model loaded to run (no adapters), ``"4bit"`` / ``"8bit"`` / ``"auto"`` take the fastest
  weight-only format of the device (torchao where it runs: :mod:`xpukit.planning.device.serve_quant`);
  ``"nf4"`` or a ``BitsAndBytesConfig`` always means bitsandbytes, and so does every load with adapters.
* ``"4bit"`` → ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=<plan dtype>)``; ``"8bit"`` →
  ``load_in_8bit=True``; a user ``BitsAndBytesConfig`` is used as given.
* bitsandbytes ≥ 0.48 (native XPU backend); on Arc A-series, bf16 4-bit compute needs ≥ 0.50
  (bitsandbytes#1942, docs/platform-notes.md §5.1) — otherwise the compute dtype becomes fp16 and the plan
  says so.
* No MPS backend exists: refused.
* Any other transformers quantization config (``QuantoConfig``, ``TorchAoConfig``, ``GPTQConfig``…)
  is passed to ``from_pretrained`` unchanged.
* Compute dtype: any float dtype works with bitsandbytes (fp32 is its own default compute dtype,
  just slower); xpukit only ever hands it one of bfloat16 / float16 / float32.

Nothing here imports bitsandbytes: versions come from package metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpukit._compat import installed_version, is_installed, version_at_least
from xpukit.errors import InvalidRequestError, MissingExtraError
from xpukit.machine.facts import DeviceFacts
from xpukit.machine.precision import normalize_dtype
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from xpukit.planning.model.facts import ModelFacts

__all__ = [
    "BNB_MIN",
    "BNB_MIN_ARC_A_BF16",
    "RECORDED_QUANTIZE_KEY",
    "QuantRequest",
    "auto_4bit_problem",
    "bnb_kwargs",
    "bnb_problem",
    "check_bnb",
    "head_skip_modules",
    "parse_quantize",
    "recorded_request",
]

BNB_MIN = "0.48"  # first release with the native XPU (SYCL) backend and a working CPU 4-bit path
BNB_MIN_ARC_A_BF16 = "0.50"  # Alchemist bf16 gemv_4bit fix (bitsandbytes#1942)

# The config.json key where `xpukit merge --quantize` records the quantization to load with
# (docs/planning.md "Quantization for inference").
RECORDED_QUANTIZE_KEY = "xpukit_quantize"

_NAMES = {"4bit": "4bit", "nf4": "4bit", "int4": "4bit", "8bit": "8bit", "int8": "8bit", "auto": "auto"}


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantRequest:
    """A parsed ``quantize=`` argument."""

    kind: str | None  # None | "4bit" | "8bit" | "auto" | "other" (a non-bitsandbytes config)
    user_config: QuantizationConfigMixin | None = None  # a quantization config given by the user, used as is
    bnb_asked: bool = False  # "nf4" or a BitsAndBytesConfig: bitsandbytes even without adapters
    origin: str = "given"  # where the request came from, as the plan's reason says it
    # bitsandbytes keywords recorded beside a trained adapter (its base as it trained), or None
    recorded: dict[str, Any] | None = None

    @property
    def method(self) -> str | None:
        """The config's ``quant_method`` (``quanto``, ``torchao``, ``gptq``…), when a config was given."""
        method = getattr(self.user_config, "quant_method", None)
        value = getattr(method, "value", method)
        return str(value) if value is not None else None

    @property
    def user_offload(self) -> bool:
        """The user's config allows CPU offload of unquantized modules."""
        return bool(getattr(self.user_config, "llm_int8_enable_fp32_cpu_offload", False))


def parse_quantize(value: object) -> QuantRequest:
    """``None`` / ``"4bit"`` / ``"8bit"`` / ``"auto"`` / a ``BitsAndBytesConfig`` → :class:`QuantRequest`.

    Raises:
        InvalidRequestError: anything else, or a BitsAndBytesConfig that loads neither 4 nor 8 bit.
    """
    if value is None or value is False:
        return QuantRequest(kind=None)
    if isinstance(value, str):
        kind = _NAMES.get(value.strip().lower())
        if value.strip().lower() in {"none", "off", "no"}:
            return QuantRequest(kind=None)
        if kind is None:
            raise InvalidRequestError(
                f"quantize={value!r} is not a known quantization. Valid: None, '4bit' / '8bit' (the "
                "device's fastest format to run, bitsandbytes to train), 'nf4' (bitsandbytes nf4 + double "
                "quant, always), 'auto' (4-bit only when the model does not fit otherwise), or a "
                "transformers.BitsAndBytesConfig."
            )
        return QuantRequest(kind=kind, bnb_asked=value.strip().lower() == "nf4")
    if type(value).__name__ == "BitsAndBytesConfig":
        if getattr(value, "load_in_4bit", False):
            return QuantRequest(kind="4bit", user_config=value, bnb_asked=True)
        if getattr(value, "load_in_8bit", False):
            return QuantRequest(kind="8bit", user_config=value, bnb_asked=True)
        raise InvalidRequestError(
            "quantize=BitsAndBytesConfig(...) loads neither 4-bit nor 8-bit; set load_in_4bit=True or "
            "load_in_8bit=True, or pass quantize=None."
        )
    if getattr(value, "quant_method", None) is not None and callable(getattr(value, "to_dict", None)):
        # Another transformers quantization config (QuantoConfig, TorchAoConfig, GPTQConfig,
        # AutoRoundConfig…): passed to from_pretrained unchanged (docs/platform-notes.md §4.8 lists several as
        # working on Intel GPUs); its own library checks it at load.
        return QuantRequest(kind="other", user_config=value)
    raise InvalidRequestError(
        f"quantize={value!r} ({type(value).__name__}) is not understood. Valid: None, '4bit', "
        "'8bit', 'auto', a transformers.BitsAndBytesConfig, or another transformers quantization "
        "config (QuantoConfig, TorchAoConfig, GPTQConfig…), passed to from_pretrained unchanged."
    )


def recorded_request(config: PreTrainedConfig) -> QuantRequest | None:
    """The quantization a merged checkpoint records for loads without adapters, or ``None``.

    ``xpukit merge --quantize int4`` writes ``"xpukit_quantize": "4bit"`` into config.json; a load
    with ``quantize`` left out takes it (``quantize="none"`` loads the checkpoint unquantized).
    """
    value = getattr(config, RECORDED_QUANTIZE_KEY, None)
    if value not in {"4bit", "8bit"}:
        return None
    origin = f"recorded in the checkpoint (config.json {RECORDED_QUANTIZE_KEY})"
    return QuantRequest(kind=str(value), origin=origin)


def bnb_kwargs(kind: str, compute_dtype: str) -> dict[str, Any]:
    """The ``BitsAndBytesConfig`` keyword arguments xpukit uses (JSON-able: the dtype is a name)."""
    if kind == "4bit":
        return {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": compute_dtype,
        }
    return {"load_in_8bit": True}


def bnb_problem(device: DeviceFacts, kind: str, compute_dtype: str) -> tuple[str | None, str | None]:
    """Why bitsandbytes cannot do ``kind`` on ``device`` here, and a dtype change that would fix it.

    Returns:
        ``(problem, compute_dtype_fix)``: ``problem`` is ``None`` when it works; ``compute_dtype_fix``
        is ``"float16"`` when only the compute dtype stands in the way (Arc A-series, bnb < 0.50).

    Raises:
        InvalidRequestError: on MPS, where bitsandbytes has no backend at all.
    """
    if device.backend == "mps":
        raise InvalidRequestError(
            f"quantize={kind!r} on mps: bitsandbytes has no MPS backend. Fix: quantize=None (fp16 on MPS), "
            "or run on xpu/cuda/cpu."
        )
    found = installed_version("bitsandbytes") if is_installed("bitsandbytes") else None
    feature = f"quantize={kind!r}"
    if found is None:
        return str(MissingExtraError(feature, "bitsandbytes", "quant", requirement=f">={BNB_MIN}")), None
    if not version_at_least(found, BNB_MIN):
        error = MissingExtraError(feature, "bitsandbytes", "quant", found=found, requirement=f">={BNB_MIN}")
        return str(error), None
    if (
        device.family == "arc-a"
        and kind == "4bit"
        and compute_dtype == "bfloat16"
        and not version_at_least(found, BNB_MIN_ARC_A_BF16)
    ):
        return (
            f"bitsandbytes {found} computes bf16 4-bit wrongly on Arc A-series (fixed in "
            f"{BNB_MIN_ARC_A_BF16}, bitsandbytes#1942)",
            "float16",
        )
    return None, None


def require_bnb(kind: str) -> str:
    """The installed bitsandbytes version, or :class:`MissingExtraError` naming the fix."""
    from xpukit._compat import require

    return require("bitsandbytes", f"quantize={kind!r}", minimum=BNB_MIN)


def head_skip_modules(
    facts: ModelFacts,
    quantization_config: dict[str, Any] | None,
    user_config: QuantizationConfigMixin | None = None,
) -> dict[str, Any] | None:
    """xpukit's bitsandbytes settings with the task head kept unquantized (so it can be trained).

    bitsandbytes would otherwise quantize a classifier (transformers' default skip list keeps only
    the output embeddings, tied weights and the last parameter's name, docs/known-issues.md
    "bitsandbytes: a classification head is quantized"); a config the user gave is left as given.
    """
    config = quantization_config
    if user_config is not None or not config or not facts.quantization_skip:
        return config
    if "llm_int8_skip_modules" in config or not (config.get("load_in_4bit") or config.get("load_in_8bit")):
        return config
    return {**config, "llm_int8_skip_modules": list(facts.quantization_skip)}


def check_bnb(
    kind: str | None,
    quant: QuantRequest,
    main: DeviceFacts,
    dtype_decision: Decision,
    enforce: bool,
) -> tuple[Decision, tuple[str, ...]]:
    """bitsandbytes usable for an explicit request; on Arc A with bnb < 0.50 switch to fp16 compute.

    Returns the dtype decision (changed to fp16 when only that makes 4-bit work) and the warnings; a
    missing bitsandbytes raises when ``enforce`` (this machine), else becomes a warning.
    """
    if kind not in {"4bit", "8bit"}:
        return dtype_decision, ()
    dtype = str(dtype_decision.value)
    compute = dtype
    if quant.user_config is not None:
        # A user's config computes in its own dtype (transformers' default is float32).
        compute = normalize_dtype(getattr(quant.user_config, "bnb_4bit_compute_dtype", None)) or "float32"
    problem, fix = bnb_problem(main, kind, compute)
    if fix and quant.user_config is not None:
        warning = (
            f"the given BitsAndBytesConfig computes 4-bit in bfloat16 on {main.name}: {problem}. Fix: "
            "pip install 'bitsandbytes>=0.50', or bnb_4bit_compute_dtype=torch.float16"
        )
        return dtype_decision, (warning,)
    if fix:
        if dtype_decision.source == "user":
            raise InvalidRequestError(
                f"dtype='bfloat16' with quantize='4bit' on {main.name}: {problem}. Fix: pip install "
                "'bitsandbytes>=0.50', or dtype='float16'."
            )
        fp16 = Decision(
            name="dtype",
            value=fix,
            reason=f"{problem}, so 4-bit computes in fp16 (pip install 'bitsandbytes>=0.50' for bf16)",
            rejected=(("bfloat16", str(problem)), *dtype_decision.rejected),
        )
        return fp16, ()
    if problem and not fix:
        if enforce:
            require_bnb(kind)  # raises MissingExtraError with the fix
        return dtype_decision, (f"{problem} (planned anyway for the assumed machine)",)
    return dtype_decision, ()


def auto_4bit_problem(main: DeviceFacts, dtype: str) -> str | None:
    """Why ``quantize="auto"`` cannot take bitsandbytes 4-bit here, or ``None``."""
    try:
        problem, fix = bnb_problem(main, "4bit", dtype)
    except InvalidRequestError as exc:  # MPS: no bitsandbytes backend
        return str(exc).split(". Fix")[0]
    if fix:
        return f"{problem} (would compute in fp16)"
    return problem
