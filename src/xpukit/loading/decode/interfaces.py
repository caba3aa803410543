"""The types the decode modules share: the model the loop serves, its step, and what it records.

:class:`DecodeModel` is what xpukit's loop reads and calls of a transformers causal LM (the base
model under a ``PeftModel``); :data:`StepFn` is the prefill or decode step the loop calls, eager or
compiled; :class:`LastDecode` is ``model.xpukit_last_decode``, which loop served the last
``generate()`` call (docs/decode-internals.md "Which loop runs").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, TypedDict

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedConfig
    from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["DecodeModel", "LastDecode", "StepFn"]

# The prefill or decode step as the loop calls it (step.py's functions, regional.py's, and what
# torch.compile or its ahead-of-time build makes of them): the loop's buffers, the attention window
# and the call's constants in; nothing out, every result is written into a buffer.
StepFn: TypeAlias = Callable[..., None]


class _Served(TypedDict):
    loop: Literal["xpukit", "transformers"]
    reason: str


class LastDecode(_Served, total=False):
    """``model.xpukit_last_decode``: which loop served the last ``generate()`` call, and why.

    ``loop`` and ``reason`` always; the rest when xpukit's loop served it: the batch, the new tokens
    asked, whether the step is compiled (with inductor's CUDA graphs, with xpukit's step graphs,
    per decoder layer) and, tiered, the tokens each tier made (``prefill``, ``graph`` or ``eager``,
    ``compiled``).
    """

    batch: int
    new_tokens: int
    compiled: bool
    cudagraphs: bool
    step_graphs: bool
    regional: bool
    tiers: dict[str, int]


class DecodeModel(Protocol):
    """What xpukit's decode loop reads and calls of the model it serves: a transformers
    ``PreTrainedModel`` that generates (``xpukit_last_decode`` is set when the loop is installed)."""

    config: PreTrainedConfig
    generation_config: GenerationConfig
    xpukit_last_decode: LastDecode | None

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, **kwargs: object) -> CausalLMOutputWithPast: ...

    def forward(self, *args: object, **kwargs: object) -> CausalLMOutputWithPast: ...

    def get_output_embeddings(self) -> torch.nn.Module | None: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def buffers(self) -> Iterator[torch.Tensor]: ...
