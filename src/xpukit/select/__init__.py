"""Stage 2, device selection: which devices a process sees.

``spec`` parses and validates a device spec (pure), ``devices`` turns it into a
:class:`~xpukit.select.devices.DeviceSelection` (the environment for a child, or applied in-process
before the runtime starts). Reads machine facts; never plans or loads.
"""
