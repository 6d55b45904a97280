"""Training building blocks: the jitted train step, the optimizer, shardings, checkpoints, the
multi-process runtime, PPO's critic, the warm start and step memory figures.

The run that puts them together is :mod:`rljax.run`.
"""
