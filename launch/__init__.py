"""absl entry points of rljax (``python -m launch.train --config=configs/default.py``)."""
