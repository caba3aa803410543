"""``xpukit doctor``: what this machine has and what is wrong with it.

``checks`` gathers host facts and diagnoses them (a pure function of facts); ``selftest`` runs small
real operations per device.
"""
