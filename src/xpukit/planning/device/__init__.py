"""Where the model goes and how it runs there: the main device, dtype-dependent placement and
``device_map``, quantization, attention, Hub kernels, distributed ranks and fast decoding. Uses
``planning/model/`` and the vocabulary below it, never ``planning/training/``."""
