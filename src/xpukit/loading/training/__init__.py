"""Acting on the training plan's speed and memory decisions, once the adapters are on.

``fused_lora`` computes 4-bit LoRA blocks in fused functions (``fused_blocks`` patches one block,
``fused_check`` proves each block type against peft's at load); ``layer_graphs`` captures the decoder
layers as device graphs; ``liger`` applies liger-kernel's fused kernels; ``chunked_loss`` computes
the cross-entropy chunk by chunk; ``offload`` moves saved activations to pinned host memory.
"""
