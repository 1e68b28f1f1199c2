"""Policies for embodied RL."""

from m2flow.models.policies import CategoricalMLPPolicy, GaussianMLPPolicy, NatureCNN, build_policy

__all__ = ["CategoricalMLPPolicy", "GaussianMLPPolicy", "NatureCNN", "build_policy"]
