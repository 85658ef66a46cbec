"""sat-jax: staleness-adaptive trust regions (SAT) for asynchronous RL of MoE language models."""

__version__ = "0.1.0"
