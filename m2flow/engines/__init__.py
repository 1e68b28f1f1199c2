"""LM backends. Generation: one interface (``GenerationEngine``), a torch backend for any
device and an optional vLLM backend for GPUs (vLLM imported only when asked for), built by
name with ``build_engine``. Training and scoring: ``m2flow.engines.batch`` (the data),
``m2flow.engines.scoring`` (log-probs), ``m2flow.engines.trainer`` (``LMTrainer``),
``m2flow.engines.weights`` (weight sync and hashes), ``m2flow.engines.critic`` (PPO's critic).
Off-policy control: ``m2flow.engines.sac`` (``SACLearner``: SAC's networks and gradient step)."""

from m2flow.engines.factory import BACKENDS, build_engine
from m2flow.engines.generation import Completion, GenerationEngine, SamplingParams
from m2flow.engines.torch_engine import TorchEngine

__all__ = ["BACKENDS", "Completion", "GenerationEngine", "SamplingParams", "TorchEngine", "build_engine"]
