"""Which loop serves a ``generate()`` call: xpukit's decode loop, or transformers' own.

xpukit's loop (:mod:`xpukit.loading.decode.loop`) serves the common cases only: a decoder-only model,
``input_ids`` with an optional ``attention_mask`` (left padding), greedy or plain sampling with
``temperature`` / ``top_k`` / ``top_p``, EOS (one id or several), ``max_new_tokens`` / ``max_length``
and ``min_new_tokens`` / ``min_length``. Every other argument, and every generation-config field
that differs from transformers' neutral default, sends the call to transformers' ``generate``
unchanged, with the reason (docs/decode-internals.md "Which loop runs").

The generation config is resolved the way ``generate()`` resolves it (the model's
``generation_config``, then transformers' global defaults, then the call's arguments) through
``GenerativePreTrainedModel._prepare_generation_config`` (transformers 5.17 and 5.22 alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig

    from xpukit.loading.decode.interfaces import DecodeModel

__all__ = ["DecodeRequest", "triage"]

# Arguments of GenerationMixin.generate that are not generation-config fields: any of them given
# (not None) means a case xpukit's loop does not serve.
_GENERATE_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "tokenizer",
    "assistant_tokenizer",
    "use_model_defaults",
)
# Generation-config fields the loop reads itself, or that do not change what generate() computes
# for a greedy / sampling call without an assistant.
_HANDLED_FIELDS = frozenset(
    {
        "max_length",
        "max_new_tokens",
        "min_length",
        "min_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "decoder_start_token_id",
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "transformers_version",
        "_from_model_config",
        "early_stopping",  # beam search only
        "length_penalty",  # beam search only
        "is_assistant",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
        "max_matching_ngram_size",  # prompt lookup only (prompt_lookup_num_tokens is checked)
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeRequest:
    """One ``generate()`` call that xpukit's loop serves, resolved to plain values.

    Attributes:
        input_ids: the prompts, ``(batch, prompt_len)``, left-padded when ``attention_mask`` has zeros.
        attention_mask: ``(batch, prompt_len)``, or ``None`` (all ones).
        new_tokens: at most this many tokens are generated per sequence.
        min_new_tokens: EOS is suppressed for the first this-many new tokens.
        do_sample: sample (else greedy).
        temperature, top_k, top_p: the sampling warpers, in transformers' order; ``top_k`` 0 and
            ``top_p`` 1.0 mean off.
        eos_ids: the EOS ids (empty: no EOS stop).
        pad_id: written after a sequence's EOS (transformers' rule: ``pad_token_id``, else the
            first EOS id).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos_ids: tuple[int, ...]
    pad_id: int


def triage(model: DecodeModel, args: tuple[object, ...], kwargs: dict[str, object]) -> DecodeRequest | str:
    """A :class:`DecodeRequest` when xpukit's loop serves this call, else the reason it does not.

    Args:
        model: the model whose ``generate`` was called.
        args: the positional arguments of the call (only ``inputs`` is served).
        kwargs: its keyword arguments.
    """
    import torch

    if len(args) > 1:
        return "positional arguments after inputs"
    given = [name for name in _GENERATE_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        return f"argument {', '.join(given)}"
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    call = {k: v for k, v in kwargs.items() if k not in _GENERATE_ARGUMENTS}
    generation_config = call.pop("generation_config", None)
    input_ids = args[0] if args else call.pop("inputs", None)
    if input_ids is None:
        input_ids = call.pop("input_ids", None)
    else:
        call.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        return "no 2-D input_ids (inputs_embeds, other modalities or an empty prompt)"
    attention_mask = cast("torch.Tensor | None", call.pop("attention_mask", None))  # as generate() takes it
    prepare = getattr(model, "_prepare_generation_config", None)
    if not callable(prepare):
        return "this transformers has no _prepare_generation_config"
    try:
        config, model_kwargs = prepare(generation_config, **call)
    except Exception as exc:  # transformers' own generate() reports the problem better
        return f"the generation config did not resolve ({type(exc).__name__})"
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
    if model_kwargs:
        return f"model arguments {', '.join(sorted(model_kwargs))}"
    reason = _unsupported_fields(config)
    if reason:
        return reason
    return _resolve(config, input_ids, attention_mask)


def _unsupported_fields(config: GenerationConfig) -> str | None:
    defaults = config._get_default_generation_params()
    odd = []
    for name, value in config.to_dict().items():
        if name in _HANDLED_FIELDS or name.startswith("_") or value is None:
            continue
        if name in defaults and value == defaults[name]:
            continue
        if value is False or value == {}:  # output_logits=False, watermarking off …
            continue
        odd.append(f"{name}={value!r}")
    if config.use_cache is False:
        odd.append("use_cache=False")
    if config.cache_implementation not in (None, "static"):
        odd.append(f"cache_implementation={config.cache_implementation!r}")
    return f"generation settings {', '.join(sorted(odd))}" if odd else None


def _resolve(
    config: GenerationConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> DecodeRequest | str:
    prompt_len = int(input_ids.shape[1])
    if config.max_new_tokens is not None:
        new_tokens = int(config.max_new_tokens)
    else:
        new_tokens = int(config.max_length) - prompt_len
    if new_tokens < 1:
        return f"no new tokens asked (max_new_tokens={config.max_new_tokens}, max_length={config.max_length})"
    eos = config.eos_token_id
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
    pad = config.pad_token_id
    pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    min_new = 0
    if eos_ids:
        min_new = max(int(config.min_new_tokens or 0), int(config.min_length or 0) - prompt_len, 0)
    do_sample = bool(config.do_sample)
    if do_sample and not float(config.temperature) > 0:
        return f"temperature={config.temperature} (transformers' generate() refuses it)"
    return DecodeRequest(
        input_ids=input_ids,
        attention_mask=attention_mask,
        new_tokens=new_tokens,
        min_new_tokens=min_new,
        do_sample=do_sample,
        temperature=float(config.temperature) if do_sample else 1.0,
        top_k=int(config.top_k or 0) if do_sample else 0,
        top_p=float(config.top_p if config.top_p is not None else 1.0) if do_sample else 1.0,
        eos_ids=eos_ids,
        pad_id=pad_id,
    )
