"""``python -m elasticd``: the daemon's command line (node/cli.py)."""
import sys

from .node.cli import main

sys.exit(main())
