"""Stage 1, facts: what the machine is.

``facts`` (the frozen fact types), ``probe`` (``detect()``, the only code that touches the
machine), ``profiles`` (recorded device facts for tests and ``--assume``) and ``precision`` (the one
place dtype rules live). Nothing here imports a higher stage.
"""
