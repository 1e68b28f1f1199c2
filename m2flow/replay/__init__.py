"""Replay buffers for off-policy RL: transitions stored once, sampled uniformly or by priority
(n-step optional) or from several sources at set shares, saved as safetensors. No Ray here."""

from m2flow.replay.buffer import ReplayBuffer, Transitions, sample_mixed

__all__ = ["ReplayBuffer", "Transitions", "sample_mixed"]
