"""LoRA adapters on a loaded model (``lora=True`` / a config for training, ``lora=PATH`` for inference).

:func:`apply_lora` carries out a :class:`~xpukit.planning.training.lora_request.LoraRequest` (resolved from
the user's ``lora=`` by the planner) and returns notes of what really ran, which the loader records
in the model's plan.

Training a quantised model is lean by default. peft's ``prepare_model_for_kbit_training`` upcasts
every weight that is not 4-bit (embeddings, ``lm_head``, norms) to fp32. Measured on an H200 with a
Qwen3-8B-shaped model (docs/training.md, docs/benchmarks.md: one LoRA step of 4 × 512 tokens, nf4 +
double quant, bf16 compute), peft's recipe peaked at 15.39 GB at 3 711 tok/s, against 11.05 GB at
4 088 tok/s with those weights left in bf16, at the same loss; adding liger-kernel lowered the peak
to 7.84 GB but ran slower, at 2 954 tok/s. xpukit therefore does its own preparation: freeze the base
weights, gradient checkpointing (non-reentrant, which also makes the input embeddings require grad),
and no blanket upcast. Only what a precision needs is changed: with fp16 compute the trainable
weights must be fp32, because ``GradScaler`` refuses to unscale fp16 gradients; with fp32 compute
the half-precision weights become fp32.

On CPUs with avx512_bf16, bitsandbytes repacks a 4-bit weight into a CPU-only layout on the first
eval-mode forward (``generate`` does one). That layout is served by ``gemv_4bit``, which has no
backward, so LoRA layers before the residual stream silently get zero gradients afterwards
(docs/known-issues.md "bitsandbytes: CPU repacking of 4-bit weights"). :func:`apply_lora` undoes such a
repacking and turns it off for the model it
prepares for training.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from xpukit._compat import require
from xpukit.errors import InvalidRequestError
from xpukit.loading.bnb_cpu import keep_trained_4bit_numerics, restore_trainable_4bit_layout
from xpukit.loading.library_configs import lora_config
from xpukit.machine.facts import DeviceFacts
from xpukit.machine.precision import normalize_dtype
from xpukit.planning.training.lora_config import lora_config_problem
from xpukit.planning.training.lora_request import LoraRequest, targets_text

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

__all__ = ["apply_lora", "linear_module_names", "lora_problem"]

logger = logging.getLogger(__name__)


def apply_lora(
    model: PreTrainedModel,
    request: LoraRequest,
    *,
    compute_dtype: str,
    quantized: bool,
    device: DeviceFacts,
    fused: bool = False,
    fused_insist: bool = False,
    graphs: bool = False,
    packing: int | None = None,
    pass_tokens: int | None = None,
    host_embedding: bool = False,
    varlen: bool = False,
) -> tuple[PeftModel, list[str]]:
    """Carry out a :class:`LoraRequest` on a loaded model.

    For ``kind="new"``: validates the targets against the model before changing anything, undoes a
    bitsandbytes CPU repacking, freezes the base weights, applies the dtype policy (module
    docstring), enables non-reentrant gradient checkpointing when asked, applies liger-kernel where
    it can run, then ``peft.get_peft_model``. For ``kind="adapter"``: ``PeftModel.from_pretrained``
    with ``is_trainable=False`` and eval mode; with ``request.trainable`` the same preparation as new
    adapters, then ``PeftModel.from_pretrained(..., is_trainable=True)`` (its weights trainable).

    Args:
        model: a transformers ``PreTrainedModel``.
        request: from :func:`resolve_lora`.
        compute_dtype: the plan's compute dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        quantized: the model's linear layers are 4/8-bit (bitsandbytes).
        device: the device the model is on.
        fused: for new adapters, route the 4-bit LoRA projections through the fused autograd
            functions (:func:`xpukit.loading.training.fused_lora.apply_fused_lora`); what cannot be
            fused keeps peft's path and is recorded in the notes.
        graphs: for new adapters, CUDA graphs of the decoder layers
            (:func:`xpukit.loading.training.layer_graphs.install_layer_graphs`), after the fused path.
        packing: for new adapters, run padded training batches as one row of their real tokens,
            padded to a multiple of this many tokens
            (:func:`xpukit.loading.training.packing.install_packing`); ``None``: batches run as given.
        pass_tokens: with packing, the plan's token budget per pass (a longer row is split by tokens).
        varlen: with packing, a packed row's attention runs torch's ``varlen_attn`` from its
            boundaries (the ``packed_attention`` decision): the attention is set to
            ``xpukit_varlen`` before the layer graphs are installed
            (:func:`xpukit.loading.training.varlen_attention.use_varlen`).
        host_embedding: for new adapters, the frozen input embedding moves to host memory
            (:func:`xpukit.loading.training.host_embedding.install_host_embedding`).
        fused_insist: with ``fused``, refuse (``InvalidRequestError``) when not every decoder block
            can be fused (``lora={"fused": True}``).

    Returns:
        The ``PeftModel`` and notes of what ran (fallbacks included).

    Raises:
        MissingExtraError: peft is not installed (extra ``lora``).
        InvalidRequestError: the LoRA config is invalid or its targets match no module of the model
            (the message lists the model's linear layers), found before the model is changed. If
            peft itself refuses later, the message says to reload the model. With ``fused_insist``:
            some block cannot take the fused path (the message gives the reason and the fix).
        DeviceUnavailableError: a repacked 4-bit weight could not be restored for training.
    """
    require("peft", "lora=" + ("PATH" if request.kind == "adapter" else "True"))
    dtype = normalize_dtype(compute_dtype)
    if dtype is None:
        raise InvalidRequestError(
            f"apply_lora(compute_dtype={compute_dtype!r}): expected bfloat16, float16 or float32."
        )
    if request.kind == "adapter" and not request.trainable:
        return _load_adapter(model, request)
    return _new_adapters(
        model,
        request,
        dtype=dtype,
        quantized=quantized,
        device=device,
        fused=fused,
        insist=fused_insist,
        graphs=graphs,
        packing=packing,
        pass_tokens=pass_tokens,
        host_embedding=host_embedding,
        varlen=varlen,
    )


def _load_adapter(model: PreTrainedModel, request: LoraRequest) -> tuple[PeftModel, list[str]]:
    from peft import PeftModel

    try:
        peft_model = PeftModel.from_pretrained(model, request.adapter_path, is_trainable=False)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise InvalidRequestError(
            f"lora={request.adapter_path!r}: the adapter does not fit this model: {exc}. Load the base "
            f"model the adapter was trained on ({request.config.get('base_model_name_or_path')!r})."
        ) from exc
    peft_model.eval()
    notes = [f"loaded LoRA adapter {request.adapter_path} for inference (eval mode, frozen)"]
    return peft_model, notes + keep_trained_4bit_numerics(peft_model)


def _new_adapters(
    model: PreTrainedModel,
    request: LoraRequest,
    *,
    dtype: str,
    quantized: bool,
    device: DeviceFacts,
    fused: bool = False,
    graphs: bool = False,
    insist: bool = False,
    packing: int | None = None,
    pass_tokens: int | None = None,
    host_embedding: bool = False,
    varlen: bool = False,
) -> tuple[PeftModel, list[str]]:
    import torch

    problem = None
    if request.kind != "adapter":  # saved: plan_load checked it
        names = [n for n, _ in model.named_modules() if n]
        problem = lora_config_problem(request, names, linear_module_names(model), type(model).__name__)
    if problem:  # before any change to the model
        raise InvalidRequestError(problem)
    config = None if request.kind == "adapter" else lora_config(request)
    notes = _prepare_base(model, request, dtype=dtype, quantized=quantized, device=device)
    try:
        peft_model = _attach(model, request, config)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise InvalidRequestError(
            f"lora=: peft could not add adapters to this {type(model).__name__}: {exc}. The model has been "
            "prepared (frozen, checkpointing): reload it before trying another lora= setting."
        ) from exc
    if dtype == "float16":
        changed = _upcast_trainable(peft_model, torch.float32)
        notes.append(
            "compute is float16: trainable (LoRA) weights are float32 so GradScaler can unscale their "
            f"gradients ({changed} cast); frozen base weights stay float16"
        )
    notes += _speedups(
        peft_model,
        request,
        fused=fused,
        graphs=graphs,
        insist=insist,
        packing=packing,
        pass_tokens=pass_tokens,
        varlen=varlen,
    )
    if host_embedding:
        from xpukit.loading.training.host_embedding import install_host_embedding

        notes.append(install_host_embedding(peft_model))
    trainable, total = _count_parameters(peft_model)
    targets = targets_text(request.config.get("target_modules"))
    what = f"LoRA adapter {request.adapter_path}, trainable," if request.kind == "adapter" else "LoRA"
    notes.append(
        f"{what} on {targets}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / max(total, 1):.2f} %)"
    )
    logger.info("LoRA applied: %s", "; ".join(notes))
    return peft_model, notes


def _prepare_base(
    model: PreTrainedModel, request: LoraRequest, *, dtype: str, quantized: bool, device: DeviceFacts
) -> list[str]:
    """The base model made ready for adapters: frozen, cast, checkpointing, the loss, offloading."""
    import torch

    notes: list[str] = []
    notes += restore_trainable_4bit_layout(model)
    for param in model.parameters():
        param.requires_grad_(False)
    notes.append(
        "froze the base weights" + (" (xpukit's lean k-bit preparation: no fp32 upcast)" if quantized else "")
    )
    if dtype == "float32":
        changed = _cast_half_params(model, torch.float32)
        if changed:
            notes.append(f"compute is float32: cast {changed} half-precision base tensors to float32")
    else:
        notes.append(f"non-quantised weights (embeddings, lm_head, norms) kept in {dtype}")
    if request.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        notes.append("gradient checkpointing on (use_reentrant=False; input embeddings require grad)")
    from xpukit.loading.training.liger import apply_liger
    from xpukit.planning.training.loss_chunk import LOSS_CHUNK_TOKENS

    notes += apply_liger(
        model, device, wanted=request.liger, given=request.liger_given, loss_chunk=LOSS_CHUNK_TOKENS
    )
    if request.loss == "chunked":
        notes.append(_chunked_loss(model))
    if request.gradient_checkpointing == "offload":  # last: liger's own loss replaces ``forward``
        from xpukit.loading.training.offload import offload_saved_activations

        notes.append(offload_saved_activations(model, device))
    return notes


def _speedups(
    peft_model: PeftModel,
    request: LoraRequest,
    *,
    fused: bool,
    graphs: bool,
    insist: bool,
    packing: int | None,
    pass_tokens: int | None = None,
    varlen: bool = False,
) -> list[str]:
    """The fused path, packed rows' attention, the layer graphs and packing, on the model with its
    adapters (the attention first: the layer graphs read it when they are installed)."""
    notes: list[str] = []
    varlen = varlen and packing is not None
    if varlen:
        from xpukit.loading.training.varlen_attention import use_varlen

        notes.append(use_varlen(peft_model))
    # liger's SwiGLU inside the fused MLP and its RoPE inside the layer graphs are speed choices, not
    # the plan's memory saver: only the user's own lora={"liger": False} keeps them out.
    no_liger = request.liger_given and request.liger is False
    if fused:
        from xpukit.loading.training.fused_lora import apply_fused_lora

        notes += apply_fused_lora(peft_model, insist=insist, liger=False if no_liger else None)
    if graphs:
        from xpukit.loading.training.fused_lora import fused_everywhere
        from xpukit.loading.training.layer_graphs import install_layer_graphs

        if fused and fused_everywhere(peft_model):
            checkpoint = request.gradient_checkpointing  # False, True or "offload": inside the graphs
            notes.append(
                install_layer_graphs(
                    peft_model,
                    checkpoint=checkpoint,
                    rope=not no_liger,
                    checkpoint_layers=request.checkpoint_layers,
                )
            )
        else:  # the graphs were measured on whole fused blocks only
            notes.append(
                "CUDA graphs of the decoder layers: not installed (not every block runs the fused path, "
                "where they were measured)"
            )
    if packing is not None:
        from xpukit.loading.training.packing import install_packing

        graphs_of = getattr(peft_model, "xpukit_layer_graphs", None)  # their shapes, once full
        notes.append(
            install_packing(
                peft_model, bucket=packing, graphs=graphs_of, max_tokens=pass_tokens, varlen=varlen
            )
        )
    return notes


def _attach(model: PreTrainedModel, request: LoraRequest, config: LoraConfig | None) -> PeftModel:
    """New adapters (``get_peft_model``), or a saved adapter loaded trainable (``trainable=True``)."""
    from peft import PeftModel, get_peft_model

    if request.kind == "adapter":
        return PeftModel.from_pretrained(model, request.adapter_path, is_trainable=True)
    return get_peft_model(model, config)


def _chunked_loss(model: PreTrainedModel) -> str:
    """xpukit's chunked cross-entropy on ``model``, or the note that the plain loss stays."""
    from xpukit.loading.training.chunked_loss import apply_chunked_loss

    try:
        return apply_chunked_loss(model)
    except ValueError as exc:
        logger.warning("chunked cross-entropy not applied (%s): the plain loss needs more memory", exc)
        return f"fallback: chunked cross-entropy not applied ({exc}); the plain loss stays"


def lora_problem(model: torch.nn.Module, request: LoraRequest) -> str | None:
    """Why ``request`` cannot be applied to the loaded ``model`` (``None`` when it can); raises nothing.

    The loader's safety net after ``from_pretrained``: it returns a message, so the caller can drop
    the model before raising (a traceback would otherwise keep every weight alive).
    """
    if request.kind != "new":
        return None
    names = [n for n, _ in model.named_modules() if n]
    return lora_config_problem(request, names, linear_module_names(model), type(model).__name__)


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct names (last path part) of a model's linear layers, e.g. ``['down_proj', ...]``.

    These are what ``target_modules`` can name. bitsandbytes' 4/8-bit layers subclass
    ``torch.nn.Linear``; GPT-2's ``Conv1D`` is counted as well.
    """
    import torch

    names = set()
    for name, module in model.named_modules():
        if name and (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def _cast_half_params(model: torch.nn.Module, dtype: torch.dtype) -> int:
    import torch

    changed = 0
    for param in model.parameters():
        if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit":
            param.data = param.data.to(dtype)
            changed += 1
    return changed


def _upcast_trainable(model: torch.nn.Module, dtype: torch.dtype) -> int:
    changed = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
            changed += 1
    return changed


def _count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    trainable = total = 0
    for param in model.parameters():
        # A 4-bit weight packs two values per uint8 element.
        n = param.numel() * (2 if type(param).__name__ == "Params4bit" else 1)
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total
