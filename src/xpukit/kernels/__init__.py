"""Compute kernels: nf4 dequantisation and the fused 4-bit LoRA autograd functions for training, and
weight-only quantized products for decoding.

A low wing (beside ``planning``/``select``): it depends on torch only, imported lazily inside its
functions so that importing any xpukit module stays torch-free; ``xpukit.loading`` uses it, never the
reverse.

- :mod:`xpukit.kernels.nf4`: ``dequantize_nf4`` (Triton on CUDA/XPU, bitsandbytes elsewhere) and its
  plain PyTorch reference, bit-identical to bitsandbytes' ``dequantize_4bit`` for nf4.
- :mod:`xpukit.kernels.lora_ops`: autograd functions computing 4-bit projections together with their
  LoRA adapters (one projection; q/k/v over a shared input; a gated MLP: SwiGLU or GeGLU, gate/up or gate_up).
- :mod:`xpukit.kernels.woq`: ``weight_only_linear``, xpukit's Triton products of torchao int8
  weight-only and tinygemm int4 weights for a decode step's few rows (custom ops with PyTorch
  references; tinygemm's layout in :mod:`xpukit.kernels.int4_tile`).
"""
