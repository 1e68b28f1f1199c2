"""Policies for embodied RL; causal LMs for reasoning RL (``m2flow.models.lm``)."""

from m2flow.models.flat import flatten_parameters
from m2flow.models.policies import CategoricalMLPPolicy, GaussianMLPPolicy, NatureCNN, build_policy

__all__ = ["TINY_CONFIGS", "CategoricalMLPPolicy", "GaussianMLPPolicy", "NatureCNN", "build_policy", "flatten_parameters",
           "load_lm", "materialize_smollm2"]


def __getattr__(name: str):
    # Importing transformers takes seconds: embodied runs that only need a policy skip it.
    if name in ("load_lm", "materialize_smollm2", "TINY_CONFIGS"):
        from m2flow.models import lm

        return getattr(lm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
