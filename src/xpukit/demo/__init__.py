"""The main job on an embedded default: ``xpukit demo``.

``tiny`` builds tiny random-weight models and an offline tokenizer; ``run`` is the demo itself.
"""
