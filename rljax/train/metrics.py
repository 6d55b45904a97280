"""The metric writers of a run, re-exported from :mod:`rljax.report.metrics` (their home since the
report layer gained its sink interface, :mod:`rljax.report.sinks`); kept so that existing imports
``from rljax.train import metrics`` go on working.

>>> from rljax.train.metrics import format_value
>>> format_value(0.5, 8)
'     0.5'
"""

from rljax.report.metrics import *  # noqa: F403
from rljax.report.metrics import (  # noqa: F401  (names outside __all__ that callers and tests use)
    JSONL_NAME,
    PLOT_NAME,
    RESERVED_KEYS,
    TB_DIR,
    __all__,
    _series,
    _trailing_mean,
)
