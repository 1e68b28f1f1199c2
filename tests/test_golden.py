"""Seeded runs reach bitwise the weights they reached when the digests below were recorded.

A refactoring that changes what a run computes (the order of a reduction, an RNG draw, a
default) changes the digest. If a change is meant to alter the computation, record the new
digests and say why in the commit. The digests depend on the CPU's float kernels (the
instruction set torch's and MKL's kernels take, and the processor): they were recorded with
torch 2.13.0+cpu on x86-64, one pair per kind of CPU; on a kind with none the tests skip and
name it, so that its digests can be recorded. The reasoning digest also depends on the
transformers release (on one AVX-512 AMD EPYC: 5.17.0 and 5.23.0 reach different weights,
5.23.0 and 5.24.0 the same): it is checked with the release it was recorded with
(``TRANSFORMERS``, the one ``make`` installs) and skipped, naming both, under another.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from m2flow.config import load_config
from m2flow.engines.weights import weights_hash
from m2flow.flow.cost import hardware
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runners.reasoning import ReasoningRunner

# CPU kind -> (embodied digest, reasoning digest); a kind of instruction set alone stands for
# every processor with it that has no entry of its own. The "AVX512" pair was recorded on machines
# whose processor was not written down; an AVX-512 AMD EPYC reaches the AVX2 AMD EPYC's embodied
# weights and reasoning weights of its own. The reasoning digests of the first two kinds were
# recorded under the transformers release of their day (not written down, 5.23.0 or earlier; on
# the AVX-512 AMD EPYC 5.23.0 and 5.24.0 agree): one that fails under TRANSFORMERS is to be
# recorded again on its kind of CPU.
DIGESTS = {
    "AVX512": ("f25b181c72b6bcd8eeeedb57ba00400604bfc6a4d2968d68609adf9914e515af",
               "cb47aea00eb545a39f694b5ec03803124b4ba22713b4992b4f302daf9ed162c2"),
    "AVX2 AMD EPYC": ("7005f7680967b735e2f06443f6c4771e41071396a4c26b0162ef51cb808944a1",
                      "212d383488a2e1bf8efb24c752d1b375e2f877ee56300d6ae805d7918240236c"),
    "AVX512 AMD EPYC": ("7005f7680967b735e2f06443f6c4771e41071396a4c26b0162ef51cb808944a1",
                        "ece2e7e6974905aaf5f86a0290f7214cc8344c449ab67a55f13088a318a36165"),
}
TRANSFORMERS = "5.24.0"  # the release the reasoning digests are checked with (the Makefile's TRANSFORMERS_SPEC)
# CPU kind -> the digest of an embodied run collecting one update ahead (runner.max_staleness=1,
# env and rollout on one slot, the actor on another): recorded with the code of b5027a7, before
# the runner's weight sync and run-ahead streams became a part of their own (runners/streams.py).
AHEAD_DIGESTS = {"AVX512 AMD EPYC": "75d13caa65e3ebbeb984a9a008353a6a92d0ae182ee4652ce69b2789395c592a"}

pytestmark = pytest.mark.skipif(not torch.__version__.endswith("+cpu"), reason="digests recorded with CPU kernels")


def cpu_kind() -> str:
    """The instruction set torch's CPU kernels use, and the processor's name."""
    return f"{torch.backends.cpu.get_cpu_capability()} {hardware()['cpu']}"


def digests() -> tuple[str, str]:
    kind = cpu_kind()
    found = DIGESTS.get(kind) or DIGESTS.get(kind.split()[0])
    if found is None:
        pytest.skip(f"no digests recorded for this kind of CPU ({kind})")
    return found


def embodied_run(cluster, pool, tmp_path, *overrides) -> tuple[list[dict], set[str]]:
    """A seeded CartPole run's rows and the digests of its actor ranks' weights."""
    cfg = load_config("embodied/ppo_cartpole", [f"runner.out_dir={tmp_path}", "runner.progress=false",
                                                 "env.num_envs=16", *overrides])
    runner = EmbodiedRunner(cfg, cluster, pool=pool)
    try:
        history = runner.train()
        states = runner.groups["actor"].call("state").wait()
    finally:
        runner.close()
    return history, {weights_hash(s["policy"].items()) for s in states}


def test_embodied_cartpole_weights(cluster, pool, tmp_path):
    embodied, _ = digests()
    history, found = embodied_run(cluster, pool, tmp_path, "runner.total_env_steps=1024")  # 2 updates
    assert len(history) == 2
    assert len(found) == 1  # every actor rank holds the same weights
    assert found.pop() == embodied


def test_reasoning_tiny_weights(cluster, pool, tmp_path):
    _, reasoning = digests()
    if transformers.__version__ != TRANSFORMERS:
        pytest.skip(f"the reasoning digests are checked with transformers {TRANSFORMERS}, this is "
                    f"{transformers.__version__}")
    cfg = load_config("reasoning/grpo_arith_tiny", [f"runner.out_dir={tmp_path}", "runner.progress=false",
                                                     "runner.steps=3", "placement.mode=custom",
                                                     *(f"placement.components.{c}=0" for c in ("rollout", "reward",
                                                                                               "inference", "actor"))])
    # On one slot: with several threads, a CPU reduction in the LM's backward is not bitwise repeatable.
    runner = ReasoningRunner(cfg, cluster, pool=pool)
    try:
        runner.train()
        hashes = runner.groups["actor"].weights_hash().wait()
    finally:
        runner.close()
    assert hashes == [reasoning]


def test_embodied_cartpole_weights_one_update_ahead(cluster, pool, tmp_path):
    """Collecting ahead without in-flight updates is as repeatable as on-policy: each stream is
    launched once the one before it is made, on the weights synced before it."""
    digests()  # the kinds the other digests know
    kind = cpu_kind()
    if kind not in AHEAD_DIGESTS:
        pytest.skip(f"no run-ahead digest recorded for this kind of CPU ({kind})")
    history, found = embodied_run(
        cluster, pool, tmp_path, "runner.total_env_steps=2048", "runner.max_staleness=1", "placement.mode=custom",
        "placement.components.env=0", "placement.components.rollout=0", "placement.components.actor=1",
        "placement.actor_devices_per_proc=1")
    assert [row["policy_lag"] for row in history] == [0, 1, 1, 1]  # 4 updates, each after the first a version behind
    assert found == {AHEAD_DIGESTS[kind]}
