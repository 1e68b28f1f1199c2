"""What the flows' metrics share (``m2flow.runners.metrics``): the ledger of each step's samples."""

import pytest

from m2flow.runners.metrics import Ledger, SamplesLost
from m2flow.workers.reports import EnvReport, GenerateReport, LMTrainReport, RewardReport, TrainReport, WeightSync


def test_the_ledger_holds_every_sample_collected_trained_once_or_dropped():
    """Embodied: two env ranks' envs, trained by two actor ranks; reasoning: a group dropped by
    the reward worker, a batch dropped as too old by an actor rank. A sample trained on twice,
    one lost and one never collected each fail the step, naming it."""
    ledger = Ledger()
    env = [EnvReport(collected=[0, 1]), EnvReport(collected=[2, 3])]
    ledger.record(1, {"env": env, "actor": [TrainReport(trained=[0, 2]), TrainReport(trained=[1, 3])],
                      "sync": WeightSync()})
    completions = [(p, j) for p in (7, 9) for j in range(2)]
    ledger.record(2, {"rollout": [GenerateReport(collected=completions)],
                      "reward": [RewardReport(dropped=[(9, 0), (9, 1)])],
                      "actor": [LMTrainReport(trained=[(7, 1)]), LMTrainReport(trained=[(7, 0)])]})
    ledger.record(3, {"rollout": [GenerateReport(collected=completions)],
                      "actor": [LMTrainReport(trained=completions[:2], dropped=completions[2:])]})
    assert ledger.trained == {1: [0, 2, 1, 3], 2: [(7, 1), (7, 0)], 3: [(7, 0), (7, 1)]}
    with pytest.raises(SamplesLost, match=r"step 4's samples: trained on twice \(1\): \[1\]"):
        ledger.record(4, {"env": env, "actor": [TrainReport(trained=[0, 1, 2]), TrainReport(trained=[1, 3])]})
    with pytest.raises(SamplesLost, match=r"lost: collected, neither trained on nor dropped \(1\): \[3\]"):
        ledger.record(4, {"env": env, "actor": [TrainReport(trained=[0, 1, 2])]})
    with pytest.raises(SamplesLost, match=r"trained on but never collected \(1\): \[4\]"):
        ledger.record(4, {"env": env, "actor": [TrainReport(trained=[0, 1, 2, 3, 4])]})
    assert 4 not in ledger.trained
    ledger.record(1, {"env": env[:1], "actor": [TrainReport(trained=[1, 0])]})  # step 1 done again: replaced
    assert ledger.trained[1] == [1, 0]
