"""One batch size's buffers of xpukit's decode loop (docs/decode-internals.md "How the loop works").

Their addresses never change, so a device graph captured over them replays them: the static cache,
the current token and its position, the 2-D mask over the whole cache, the finished flags, the
output, the step index, and per prompt bucket the prompt's ids; the attention windows are views of
the mask, one object per length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import StaticCache

    from xpukit.loading.decode.interfaces import DecodeModel
    from xpukit.loading.decode.request import DecodeRequest

__all__ = ["DecodeState", "fill_constants", "new_state"]


@dataclass(slots=True)
class DecodeState:
    """One batch size's buffers, at fixed addresses."""

    cache: StaticCache
    tokens: torch.Tensor  # (b, 1) long: the last token, the next step's input
    positions: torch.Tensor  # (b, 1) long: its position id (left padding shifts it)
    mask: (
        torch.Tensor
    )  # (b, cache_len) bool: False on left padding, True elsewhere (causality masks the future)
    unfinished: torch.Tensor  # (b,) bool
    out: torch.Tensor  # (b, cache_len) long: the new tokens, at [0, new_tokens)
    index: torch.Tensor  # (1,) long: the step's column in ``out``
    owner: tuple[int, int]  # (batch, cache length): its key among the kept states
    prompts: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt length → (b, length) long ids
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # window length → mask[:, :length]

    def prompt(self, length: int) -> torch.Tensor:
        """The fixed ids buffer of prompts ``length`` tokens long."""
        if length not in self.prompts:
            self.prompts[length] = self.tokens.new_zeros((self.tokens.shape[0], length))
        return self.prompts[length]

    def window(self, length: int) -> torch.Tensor:
        """The first ``length`` columns of the mask, one view per length (its size is the window; a
        compiled step sees the length as a symbol, so one graph serves every window)."""
        if length not in self.windows:
            import torch

            view = self.mask[:, :length]
            torch._dynamo.maybe_mark_dynamic(view, 1)
            self.windows[length] = view
        return self.windows[length]


def new_state(model: DecodeModel, batch: int, length: int) -> DecodeState:
    """Buffers for ``batch`` rows and a static cache of ``length`` tokens on ``model``'s device."""
    import torch
    from transformers import StaticCache

    device = model.device
    state = DecodeState(
        cache=StaticCache(config=model.config, max_cache_len=length),
        tokens=torch.zeros((batch, 1), dtype=torch.long, device=device),
        positions=torch.zeros((batch, 1), dtype=torch.long, device=device),
        mask=torch.ones((batch, length), dtype=torch.bool, device=device),
        unfinished=torch.ones(batch, dtype=torch.bool, device=device),
        out=torch.zeros((batch, length), dtype=torch.long, device=device),
        index=torch.zeros(1, dtype=torch.long, device=device),
        owner=(batch, length),
    )
    # Fixed addresses (as transformers marks its cache): a CUDA graph mutates them in place. Marked
    # even while eager, so that a loop compiled later (doctor's selftest) captures them too.
    for name in ("tokens", "positions", "mask", "unfinished", "out", "index"):
        torch._dynamo.mark_static_address(getattr(state, name))
    return state


def fill_constants(
    model: DecodeModel, consts: dict[str, torch.Tensor], request: DecodeRequest
) -> dict[str, torch.Tensor]:
    """The step's constants for ``request`` (EOS ids, pad, minimum length, temperature, top-p), in
    tensors made once per model at fixed addresses (``consts`` is filled on the first call)."""
    import torch

    if not consts:
        device = model.device
        head = model.get_output_embeddings()
        vocab = int(head.weight.shape[0]) if head is not None else model.config.get_text_config().vocab_size
        consts.update(
            is_eos=torch.zeros(vocab, dtype=torch.bool, device=device),
            pad=torch.zeros((), dtype=torch.long, device=device),
            min_new=torch.zeros(1, dtype=torch.long, device=device),
            temperature=torch.ones((), dtype=torch.float32, device=device),
            top_p=torch.ones((), dtype=torch.float32, device=device),
        )
        for tensor in consts.values():
            torch._dynamo.mark_static_address(tensor)
    consts["is_eos"].zero_()
    eos = [e for e in request.eos_ids if 0 <= e < consts["is_eos"].shape[0]]
    if eos:
        consts["is_eos"][torch.tensor(eos, device=consts["is_eos"].device)] = True
    consts["pad"].fill_(request.pad_id)
    consts["min_new"].fill_(request.min_new_tokens)
    consts["temperature"].fill_(request.temperature)
    consts["top_p"].fill_(request.top_p)
    return consts
