"""m2flow: flexible, efficient, large-scale reinforcement-learning training on Ray."""

__version__ = "0.1.0"
