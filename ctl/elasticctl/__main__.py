"""``python -m elasticctl``: the same as the ``elasticctl`` command."""
import sys

from elasticctl.cli import main

if __name__ == "__main__":
    sys.exit(main())
