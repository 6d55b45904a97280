"""Makes ``gateway_helpers.py`` importable by the gateway tests; LiteLLM uses its bundled cost map
(no network)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
