"""``python -m xpukit ...``: the same command line as the ``xpukit`` script.

Useful where the script's directory is not on ``PATH`` (a virtualenv that is not activated, a
Windows user install). Only ``python -m xpukit`` runs this module; ``import xpukit`` never does.
"""

from __future__ import annotations

import sys

from xpukit.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
