"""Stage 1, reading: what planning needs from files, gathered before any decision is taken.

Beside ``xpukit.machine`` (the machine's facts), this wing reads the request's other sources
(a trained adapter's files) into plain frozen values, so that every decider in ``xpukit.planning``
is a pure function of them (tests hand-make them).
"""
