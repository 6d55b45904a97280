"""``python -m rljax``: the ``rljax`` command."""

import sys

from rljax.cli.main import main

sys.exit(main())
