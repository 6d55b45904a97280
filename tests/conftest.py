"""Test-wide settings: 8 fake CPU devices for sharding tests, float64 available for references."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # shared helpers: tolerances

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
