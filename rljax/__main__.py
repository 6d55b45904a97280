"""``python -m rljax``: the ``rljax`` command."""

import sys

from rljax.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
