"""The NF4 code book, shared by the reference path (``nf4.py``) and the Triton kernel
(``_nf4_triton.py``), which both read it from here so neither imports the other."""

from __future__ import annotations

__all__ = ["NF4_VALUES"]

# The NF4 code book (QLoRA paper, appendix E; bitsandbytes' _NF4_QUANT_TABLE), as fp32 values.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
