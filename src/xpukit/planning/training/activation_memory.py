"""The activation memory of one LoRA training step, from a decoder's shape (pure).

:func:`activation_bytes` is the formula of docs/training-plan.md "The activation estimate", one line per
term; tests/planning/training/test_training_plan.py checks it against peaks measured on the CPU.
:mod:`xpukit.planning.training.fit` uses it to choose the memory savers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.planning.model.shape import ModelShape
from xpukit.planning.training.loss_chunk import LOSS_CHUNK_TOKENS

if TYPE_CHECKING:
    from xpukit.planning.training.lora_request import LoraRequest

__all__ = [
    "CHUNK_BYTES",
    "GRAPH_BUCKET",
    "GRAPH_BUCKET_CHECKPOINTED",
    "GRAPH_SHAPES",
    "activation_bytes",
    "chunk_tokens",
    "dequant_transient",
    "graph_bucket",
    "lora_parameters",
]

# xpukit's chunked cross-entropy (kernels/chunked_ce.py): fp32 logits of one chunk of tokens.
CHUNK_BYTES = 256 << 20


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the chunked cross-entropy: :data:`CHUNK_BYTES` of fp32 logits (≥ 1)."""
    return max(1, CHUNK_BYTES // (4 * vocab))


# LoRA target groups: (names peft may give the layers, which input they read).
_GROUPS = {
    "attn_in": ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv"),
    "attn_out": ("o_proj", "out_proj", "dense", "c_proj"),
    "mlp_in": ("gate_proj", "up_proj", "gate_up_proj", "c_fc", "fc1", "w1", "w3"),
    "mlp_out": ("down_proj", "fc2", "w2"),
}


def _targeted(targets: object) -> dict[str, int]:
    """LoRA layers per group; an unknown or ``all-linear`` target counts every group (an upper bound)."""
    full = {"attn_in": 3, "attn_out": 1, "mlp_in": 2, "mlp_out": 1}
    if not isinstance(targets, list | tuple | set | frozenset):
        return full
    names = {str(t).rsplit(".", 1)[-1] for t in targets}
    known = {n for group in _GROUPS.values() for n in group}
    if names - known:
        return full
    return {g: min(full[g], sum(n in names for n in members)) for g, members in _GROUPS.items()}


def lora_parameters(shape: ModelShape, request: LoraRequest) -> int:
    """Trainable LoRA parameters: ``r × (d_in + d_out)`` per adapted layer."""
    r = int(request.config.get("r", 16))
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, i = shape.hidden, shape.intermediate
    n = _targeted(request.config.get("target_modules"))
    attn_in = [(h, q), (h, kv), (h, kv)][: n["attn_in"]]
    per_layer = sum(r * (a + b) for a, b in attn_in)
    per_layer += n["attn_out"] * r * (q + h) + n["mlp_in"] * r * (h + i) + n["mlp_out"] * r * (i + h)
    return per_layer * shape.layers


def dequant_transient(shape: ModelShape, *, compute_bytes: int, fused_lora: bool) -> int:
    """Dequantised 4-bit weights alive at once in one layer's backward: the fused MLP's backward
    holds gate, up and down in the compute dtype; bitsandbytes' matmul one weight at a time."""
    return compute_bytes * shape.hidden * shape.intermediate * (3 if fused_lora else 1)


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    *,
    compute_bytes: int,
    lora_r: int,
    targets: object,
    dropout: bool,
    mask_bytes: int,
    checkpointing: bool | str,
    fused_loss: bool,
    fused_lora: bool = False,
    kernel_norms: bool = False,
    dequant_bytes: int = 0,
    chunked_loss: bool = False,
) -> dict[str, int]:
    """The peak activation memory of one forward + backward, in bytes (docs/training-plan.md "The
    activation estimate": every term there is one line here).

    Args:
        shape: the decoder's sizes.
        tokens: micro-batch × sequence length.
        compute_bytes: 2 for bf16/fp16 autocast (fp32 LoRA weights), 4 for fp32 compute.
        lora_r: the LoRA rank.
        targets: peft ``target_modules``.
        dropout: ``lora_dropout > 0``.
        mask_bytes: bytes per element of a dropout mask (1 where torch has the fused kernel: CUDA,
            XPU; else the input's element size).
        checkpointing: ``False``, ``True`` or ``"offload"``.
        fused_loss: liger-kernel's fused linear cross-entropy replaces ``lm_head`` + loss (in
            chunks of :data:`~xpukit.planning.training.loss_chunk.LOSS_CHUNK_TOKENS`).
        chunked_loss: with ``fused_loss``, xpukit's chunked cross-entropy instead of liger's: the
            same saved gradient plus one chunk's logits in flight (12 bytes per logit, measured).
        fused_lora: xpukit's fused 4-bit LoRA path computes the block's projections (one saved
            input per group, gate and up kept for the SwiGLU, ``down``'s input recomputed).
        kernel_norms: liger-kernel's RMSNorm replaces transformers' (its input kept in the compute
            dtype, not upcast to fp32).
        dequant_bytes: bytes of dequantised 4-bit weights alive at once in one layer's backward
            (:func:`dequant_transient`); counted with the recomputed layer on the checkpointed rungs.

    Returns:
        ``{"per_layer", "layers", "loss", "recompute", "peak"}``: bytes of one layer's saved tensors,
        of all layers' as kept (checkpointing: their inputs), of the loss, of one layer recomputed
        with its gradients in flight (checkpointing), and the peak.
    """
    a = compute_bytes
    h, i, v = shape.hidden, shape.intermediate, shape.vocab
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    n = _targeted(targets)
    dims = {"attn_in": h, "attn_out": q, "mlp_in": h, "mlp_out": i}
    norm = a if kernel_norms else 4  # liger keeps the input as is; transformers upcasts it to fp32
    per_token = shape.norms * norm * h  # two RMSNorms (four in Gemma 2/3: pre and post)
    per_token += norm * (q + kv) if shape.qk_norm else 0  # q/k norms, the same
    per_token += a * (q + 2 * kv) + a * q + 4 * shape.heads  # SDPA: q, k, v, output, logsumexp
    if fused_lora:  # q/k/v share one saved input, gate/up another; gate and up kept, down recomputes
        per_token += 2 * a * i + 2 * a * h
    else:
        per_token += 3 * a * i  # SwiGLU: gate (for SiLU), SiLU(gate) and up (for the product)
    separate = dropout or a < 4  # a dropout or a dtype cast gives every LoRA layer its own input copy
    for group, count in n.items():
        if fused_lora:
            break  # the fused path's inputs are counted above
        if not count:
            continue
        d = dims[group]
        if separate:
            per_token += count * a * d - (a * d if group == "attn_out" and not dropout else 0)
        elif group != "attn_out":  # o_proj's input is the SDPA output, counted above
            per_token += a * d
        per_token += count * mask_bytes * d if dropout else 0
    per_token += sum(n.values()) * a * lora_r  # lora_B's input
    per_layer = per_token * tokens
    loss = ((2 * a + 4) * h if fused_loss else (12 if a == 4 else 10 + a) * v) * tokens
    if fused_loss and chunked_loss:  # one chunk's logits (bf16, fp32, probabilities) in flight
        loss += 12 * v * min(tokens, chunk_tokens(v))
    elif fused_loss:  # liger's: one chunk's logits in the compute dtype, its gradient written in place
        loss += a * v * min(tokens, LOSS_CHUNK_TOKENS)
    final_norm = 4 * h * tokens
    backward = a * (i + 2 * h) * tokens  # a layer's gradients in flight while it is recomputed
    backward += dequant_bytes
    recompute = per_layer + backward
    if checkpointing == "offload":
        layers = 0  # every layer's input waits in host memory
        peak = final_norm + max(loss, recompute)
    elif checkpointing:
        layers = a * h * tokens * shape.layers  # each layer keeps its input; one is recomputed at a time
        peak = layers + final_norm + max(loss, recompute)
    else:
        layers = per_layer * shape.layers
        peak = layers + final_norm + loss
    return {"per_layer": per_layer, "layers": layers, "loss": loss, "recompute": recompute, "peak": peak}


# The graphs of the layers keep at most this many step shapes, the packed rows' buckets of this many
# tokens (loading/training/layer_graphs.py imports them; docs/layer-graphs.md "CUDA graphs of the decoder
# layers").
GRAPH_SHAPES = 8
GRAPH_BUCKET = 256
# With checkpointing a capture also records the recomputation, and a short run pays for every shape it
# meets: coarser buckets, fewer captures (H200, 8B QLoRA under 8 GB, 20 steps: 3 captures against 4,
# 3 662 against 3 447 tokens/s, the first 20 steps 2 936 against 2 049; docs/benchmarks.md "Under a
# budget").
GRAPH_BUCKET_CHECKPOINTED = 512


def graph_bucket(checkpointing: bool | str) -> int:
    """The packed row's bucket where the layers run as graphs, on a rung with or without checkpointing."""
    return GRAPH_BUCKET_CHECKPOINTED if checkpointing else GRAPH_BUCKET


def graph_buffer_bytes(
    shape: ModelShape, tokens: int, *, compute_bytes: int, packed: bool = True, bucket: int = GRAPH_BUCKET
) -> int:
    """What the captured graphs hold beside one step's activations: per captured shape the stack's
    input, output and their two gradients (``4 × tokens × hidden`` elements). Fixed steps have one
    shape of ``tokens``; packed rows (``packed``) the largest :data:`GRAPH_SHAPES` buckets a step of
    up to ``tokens`` tokens can take. The activations themselves are shared across shapes in one
    memory pool, so they are counted once, as eagerly."""
    if not packed:
        return 4 * tokens * shape.hidden * compute_bytes
    largest = -(-tokens // bucket) * bucket
    buckets = [b for b in range(largest, 0, -bucket)][:GRAPH_SHAPES]
    return 4 * sum(buckets) * shape.hidden * compute_bytes
