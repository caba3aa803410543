"""Stage 3, acting: ``load_for_xpu`` carries out a plan and records what really happened.

``load`` runs ``from_pretrained`` under the plan; ``lora`` attaches PEFT adapters (part of the load
when ``lora=`` is given); ``liger`` patches liger-kernel's fused kernels in; ``bnb_cpu`` undoes
bitsandbytes' CPU repacking of 4-bit weights.
"""
