"""Makes the shared builders of ``train_fixtures.py`` importable by the train tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
