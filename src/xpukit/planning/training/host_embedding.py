"""Whether a frozen input embedding lives in host memory while the adapters train (pure;
docs/training-plan.md "The input embedding in host memory").

A LoRA run never trains the input embedding, and a step reads only the rows of its own tokens: on the
8B shape the table is 1.24 GB of a device's memory (151 936 words × 4 096 × bf16) of which a step of
2 048 tokens reads 16 MB. Under a budget those 1.24 GB are worth more as room for the step: the plan
moves the table to host memory when that lets a faster step fit, and only then (the gather then runs
on the host and its rows are copied to the device, one copy a step).

It may move when the embedding is not tied to the output head (the head reads the whole table every
step), is not trained (``modules_to_save``, ``trainable_token_indices`` or a LoRA target), the device
is a CUDA or XPU GPU (on the CPU and on unified memory there is nothing to gain) and one process
trains (a distributed wrapper expects every parameter on one device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from xpukit.planning.budgets import format_bytes
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from xpukit.planning.model.shape import ModelShape
    from xpukit.planning.training.lora_request import LoraRequest
    from xpukit.planning.training.rungs import Choice, Rung

__all__ = ["EMBEDDING_NAMES", "embedding_decision", "host_embedding_bytes"]

# Module names of input embeddings across the families xpukit plans for; a LoRA request naming one
# (target, modules_to_save) trains it.
EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings", "embeddings", "tok_embeddings")
_DEVICES = ("cuda", "xpu")


def host_embedding_bytes(
    config: PreTrainedConfig | None,
    shape: ModelShape,
    request: LoraRequest,
    *,
    backend: str,
    compute_bytes: int,
    single_process: bool,
) -> int:
    """Bytes of the input embedding (``shape.vocab × shape.hidden``) that may move to host memory
    (module docstring), else 0; ``config`` says whether it is tied to the head."""
    if backend not in _DEVICES or not single_process or config is None:
        return 0
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # transformers' own default ties the two (PretrainedConfig.tie_word_embeddings=True).
    if getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", True)) is not False:
        return 0
    lora = request.config
    named: list[str] = []
    for key in ("target_modules", "modules_to_save"):
        value = lora.get(key)
        named += [value] if isinstance(value, str) else list(value or ())
    if lora.get("trainable_token_indices") or any(
        any(n in str(name) for n in EMBEDDING_NAMES) for name in named
    ):
        return 0
    return shape.vocab * shape.hidden * compute_bytes


def _rank(choice: Choice, room: int, ladder: list[Rung]) -> tuple[bool, int, bool, int]:
    """How fast a choice runs, higher first: one that fits, then the larger micro-batch, then the whole
    batch in one pass over passes split by tokens, then the earlier rung (or, split by tokens, the
    larger pass). The last option tried is the one chosen (:func:`.rungs.choose`)."""
    return (
        choice.tried[-1][1] <= room,
        choice.micro,
        not choice.by_tokens,
        choice.pass_tokens if choice.by_tokens else -ladder.index(choice.rung),
    )


def embedding_decision(
    choice: Choice,
    choose_with: Callable[[int], Choice],
    embedding: int,
    room: int,
    batch: int,
    ladder: list[Rung],
) -> tuple[Choice, Decision | None]:
    """The choice to run and the ``input_embedding`` decision: the table moves to host memory (value
    ``"host"``) only where the step chosen with its bytes freed (``choose_with(embedding)``: the fit
    with that much more ``room``) is faster than ``choice``, or where no step fits and it brings the
    leanest one closer to fitting. No decision where the fastest step fits beside it (nothing to
    decide: the plan says nothing of it)."""
    size = format_bytes(embedding)
    fastest = choice.rung == ladder[0] and choice.micro == batch and not choice.by_tokens
    if fastest and choice.tried[-1][1] <= room:
        return choice, None
    freed = choose_with(embedding)
    better = _rank(freed, room + embedding, ladder) > _rank(choice, room, ladder)
    if not better and choice.tried[-1][1] > room:  # nothing fits: the smaller overshoot
        better = freed.tried[-1][1] - (room + embedding) < choice.tried[-1][1] - room
    if not better:
        return choice, Decision(
            name="input_embedding",
            value="device",
            reason=f"on the device: its {size} in host memory would not let a faster step fit",
        )
    return freed, Decision(
        name="input_embedding",
        value="host",
        reason=f"in host memory ({size}, frozen, not tied to the head): the room it frees lets a "
        "faster step fit; each step gathers its tokens' rows on the host and copies them over "
        '(docs/training-plan.md "The input embedding in host memory")',
        rejected=(("on the device", "the fit keeps a slower step"),),
    )
