"""The OpenAI-compatible gateway in front of the run's engine, and agents that run against it."""
