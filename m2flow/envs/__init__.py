"""Simulator adapters: one constructor for every simulator, a synchronous env batch and its snapshots."""

from m2flow.envs.batch import ChunkResult, EnvBatch, StepResult
from m2flow.envs.normalize import RunningMeanStd
from m2flow.envs.registry import make_env

__all__ = ["ChunkResult", "EnvBatch", "RunningMeanStd", "StepResult", "make_env"]
