"""`python -m sglang_p2p_backend.launch ...`: see cli.py."""

from .cli import main

main()
