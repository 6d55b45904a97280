"""Training: the jitted train step, optimizer, sharding, checkpoints, metrics and the host loop."""
