"""``python3 -m sglang_router.launch_router ...`` -> our LB with the same arguments (see __init__)."""
import sys

from sglang_p2p_lb.cli import main

if __name__ == "__main__":
    sys.exit(main())
