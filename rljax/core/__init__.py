"""The pure functions of rljax (design §3): segments, advantage estimators, policy losses and the
other per-token terms, off-policy correction, and the objective that combines them.

Every function maps arrays to arrays under ``jit``, ``vmap`` and mesh sharding, with no I/O and no
Python loops over data; ``rljax.core`` imports nothing else from rljax (``tests/test_layering.py``).
Each submodule is imported on its own: :mod:`rljax.core.segments`, :mod:`rljax.core.advantages`,
:mod:`rljax.core.losses`, :mod:`rljax.core.off_policy`, :mod:`rljax.core.objective` and
:mod:`rljax.core.registry`.
"""
