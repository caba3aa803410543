"""Acting on the decode plan: ``fast_decode=True`` and xpukit's decode loop.

``fast_decode`` applies the plan (generation config, warm-up); ``loop`` is xpukit's decode loop behind
``generate()``, which ``request`` triages per call and ``step`` computes; ``attention`` is the grouped
decode attention; ``compile_cache`` keeps compiled artifacts between processes.
"""
