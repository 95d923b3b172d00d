"""``python -m bench.sweep``: see cli.py."""
import sys

from .cli import main

sys.exit(main())
