"""`python -m sglang_p2p_lb` and the `sglang-p2p-lb` console script."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
