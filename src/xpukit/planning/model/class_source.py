"""Where decoder_layout.py finds the installed transformers' classes: read by
:mod:`xpukit.machine.library_source` (planning reads no file itself). New code imports from there."""

from __future__ import annotations

from xpukit.machine.library_source import MISSING, ModuleSource, module_source, pretrained_defaults

__all__ = ["MISSING", "ModuleSource", "module_source", "pretrained_defaults"]
