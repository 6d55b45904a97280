"""Makes the helpers of this directory (``wandb_log.py``) importable by the report tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
