"""``python -m elasticd``: the daemon's command line (cli.py)."""
import sys

from .cli import main

sys.exit(main())
