"""`python -m simworker`: one simulated SGLang PD server (see cli.py for the flags)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
