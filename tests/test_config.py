"""The typed config: every preset loads and checks; malformed configs fail on the command line
with one line naming the key, before Ray starts; the presets ship inside the package."""

import dataclasses
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import ray
import yaml
from omegaconf import OmegaConf
from safetensors.numpy import save_file

from m2flow import cli
from m2flow.config import ConfigError, load_config, presets, root_of, shipped, to_yaml, validate
from m2flow.config import schema

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if anything starts Ray."""

    def init(*args, **kwargs):
        raise AssertionError("ray.init was called: the config error came too late")

    monkeypatch.setattr(ray, "init", init)


def cli_error(capsys, argv: list[str]) -> str:
    """The one stderr line of ``m2flow ARGV``, which must exit with status 2."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("m2flow: error: "), lines[0]
    return lines[0]


def _files(tmp: Path) -> dict[str, str]:
    """Files for the cases below: a data file too short to hold out a test set, a data file
    of the wrong kind, a preset with a misspelt nested key, and one that leaves keys unset."""
    (tmp / "three.jsonl").write_text("".join(f'{{"question": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(3)))
    (tmp / "problems.csv").write_text("question,answer\n1+1,2\n")
    (tmp / "broken.jsonl").write_text('{"question": "1+1", "answer": "2"}\n{"question": "1+2", "answer": \n')
    (tmp / "no-config").mkdir()  # a folder, but no model in it
    (tmp / "no-tokenizer").mkdir()
    (tmp / "no-tokenizer" / "config.json").write_text("{}")
    save_file({"w": np.zeros(4, np.float32)}, tmp / "no-tokenizer" / "model.safetensors")
    for name in ("no-weights", "cut-weights"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text("{}")
    save_file({"w": np.zeros(1024, np.float32)}, tmp / "cut-weights" / "model.safetensors")
    with open(tmp / "cut-weights" / "model.safetensors", "r+b") as f:
        f.truncate(2000)  # a copy cut short
    (tmp / "q.jsonl").write_text("".join(f'{{"q": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(200)))
    text = (ROOT / "m2flow/presets/embodied/ppo_cartpole.yaml").read_text()
    (tmp / "typo.yaml").write_text(text + "policy:\n  hiden: [32, 32]\n")
    (tmp / "mine.yaml").write_text("flow: embodied\nname: mine\nenv:\n  id: CartPole-v1\n")  # keys left unset
    plan = {c: "0" for c in ("rollout", "reward", "inference", "actor")}
    (tmp / "far.yaml").write_text(yaml.safe_dump({"components": plan | {"actor": "0-5"}}))  # 6 devices
    (tmp / "four_actors.yaml").write_text(yaml.safe_dump({"components": {
        "env": "0", "rollout": "0", "actor": {"devices": "0", "procs_per_device": 4}}}))
    (tmp / "wide.yaml").write_text(yaml.safe_dump({"components": plan | {"reward": "0-1"}}))  # reward as 2 ranks
    (tmp / "ahead.yaml").write_text(yaml.safe_dump({"components": plan, "run_ahead": 1}))
    return {"tmp": str(tmp)}


E, RG = "embodied/ppo_cartpole", "embodied/grpo_cartpole"
R, RP = "reasoning/grpo_arith_tiny", "reasoning/ppo_arith_tiny"
# (preset, overrides, the key the message starts with); {tmp} is a temporary directory.
MALFORMED = [
    # unknown keys, at several depths, and suggestions
    (E, ["algo.lr=1"], "algo"),
    (E, ["runner.totl_env_steps=5"], "runner.totl_env_steps"),
    (E, ["runner.lr=0.1"], "runner.lr"),
    (E, ["algorithm.lr.scale=2"], "algorithm.lr.scale"),
    (R, ["env.id=CartPole-v1"], "env"),
    ("{tmp}/typo.yaml", [], "policy.hiden"),
    ("{tmp}/mine.yaml", ["env.num_envs=4"], "algorithm.epochs"),
    (E, ["totl_env_steps"], "totl_env_steps"),
    ("embodied/ppo_cartpol", [], "preset"),
    # wrong types
    (R, ["algorithm.lr=abc"], "algorithm.lr"),
    (E, ["runner.total_env_steps=1.5"], "runner.total_env_steps"),
    (E, ["algorithm.anneal_lr=maybe"], "algorithm.anneal_lr"),
    (E, ["policy.hidden=[64,wide]"], "policy.hidden[1]"),
    (E, ["algorithm.gamma=null"], "algorithm.gamma"),
    (E, ["algorithm=fast"], "algorithm"),
    (R, ["reward.functions.math=lots"], "reward.functions.math"),
    (R, ["runner.out_dir=runs/${{nme}}"], "runner.out_dir"),
    (E, ["flow=reasoning"], "flow"),
    # impossible values
    (R, ["rollout.temperature=-0.5"], "rollout.temperature"),
    (R, ["rollout.top_p=0"], "rollout.top_p"),
    (R, ["rollout.top_p=1.5"], "rollout.top_p"),
    (E, ["algorithm.lr=0"], "algorithm.lr"),
    (E, ["algorithm.clip=-0.2"], "algorithm.clip"),
    (RP, ["rollout.n=0"], "rollout.n"),
    (R, ["data.prompts_per_step=0"], "data.prompts_per_step"),
    (E, ["env.num_envs=0"], "env.num_envs"),
    (E, ["algorithm.gamma=1.01"], "algorithm.gamma"),
    (R, ["algorithm.epochs=0"], "algorithm.epochs"),
    (R, ["placement.granularity=0"], "placement.granularity"),
    (R, ["cluster.gpu_slots=0"], "cluster.gpu_slots"),
    (E, ["policy.hidden=[64,0]"], "policy.hidden"),
    (R, ["rollout.gpu_memory_utilization=1.2"], "rollout.gpu_memory_utilization"),
    (R, ["data.levels=[1,9]"], "data.levels"),
    # choices
    (E, ["algorithm.name=a2c"], "algorithm.name"),
    (R, ["algorithm.name=dpo"], "algorithm.name"),
    (R, ["rollout.backend=tgi"], "rollout.backend"),
    (E, ["placement.mode=spread"], "placement.mode"),
    (R, ["placement.mode=pipelined"], "placement.mode"),
    (R, ["algorithm.loss_agg=sum"], "algorithm.loss_agg"),
    (R, ["algorithm.kl_kind=k4"], "algorithm.kl_kind"),
    (R, ["algorithm.old_logprobs=actor"], "algorithm.old_logprobs"),
    (R, ["algorithm.data_parallel=zero3"], "algorithm.data_parallel"),
    (R, ["model.dtype=fp8"], "model.dtype"),
    (E, ["policy.activation=gelu"], "policy.activation"),
    # files
    (R, ["data.source={tmp}/missing.jsonl"], "data.source"),
    (R, ["data.source={tmp}/problems.csv"], "data.source"),
    (R, ["data.source={tmp}/broken.jsonl"], "data.source"),  # line 2 is not JSON
    (R, ["data.source={tmp}/q.jsonl"], "data.source"),  # no field "question"
    (R, ["model.path={tmp}/no-such-model"], "model.path"),
    (R, ["model.path=tiny-mistral"], "model.path"),
    (R, ["model.path={tmp}/no-config"], "model.path"),
    (R, ["model.path={tmp}/no-tokenizer"], "model.path"),
    (R, ["model.path={tmp}/no-weights"], "model.path"),
    (R, ["model.path={tmp}/cut-weights"], "model.path"),
    (E, ["runner.resume={tmp}/update_000010.safetensors"], "runner.resume"),
    (E, ["runner.resume={tmp}/three.jsonl"], "runner.resume"),  # a file, but no checkpoint
    (E, ["runner.out_dir={tmp}/three.jsonl"], "runner.out_dir"),  # a file, not a directory
    (R, ["reward.functions.my_reward=1.0"], "reward.functions.my_reward"),
    (R, ["reward.functions={{nomod.rewards:score: 1.0}}"], "reward.functions.nomod.rewards:score"),
    (R, ["reward.functions={{m2flow.rewards.toy:no_such: 1.0}}"], "reward.functions.m2flow.rewards.toy:no_such"),
    (R, ["rollout.backend=vllm"], "rollout.backend"),  # vLLM is not installed here
    # envs that cannot be made
    (E, ["env.id=NoSuchEnv-v0"], "env.id"),
    (E, ["env.id=CartPole-v9"], "env.id"),
    (E, ["env.kwargs.foo=1"], "env.kwargs"),
    (E, ["env.kwargs.max_episode_steps=-5"], "env.kwargs"),  # a keyword the env takes, a value it refuses
    # rules between keys (embodied GRPO, reasoning groups and PPO, data sizes, placement)
    (E, ["algorithm.name=grpo", "algorithm.norm_adv=false"], "env.group_size"),
    (RG, ["env.group_size=3"], "env.num_envs"),
    (RG, ["algorithm.norm_adv=true"], "algorithm.norm_adv"),
    (RG, ["runner.stages=8"], "runner.stages"),
    (E, ["runner.stages=3"], "runner.stages"),
    (E, ["placement.mode=custom", "placement.components.env=0"], "placement.components.rollout"),
    (R, ["rollout.n=1"], "rollout.n"),
    (RP, ["algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling"),
    (R, ["algorithm.kl_in_reward=true"], "algorithm.kl_in_reward"),
    (RP, ["placement.mode=custom", *(f"placement.components.{c}=0" for c in ("rollout", "reward", "inference",
                                                                            "actor"))], "placement.components.critic"),
    (R, ["data.prompts_per_step=513"], "data.prompts_per_step"),
    (R, ["data.source={tmp}/three.jsonl"], "data.test_size"),
    (R, ["reward.overlong_buffer=17"], "reward.overlong_buffer"),
    (R, ["placement.components.actor=7"], "placement.components.actor"),  # ignored unless placement.mode=custom
    (E, ["placement.mode=hybrid", "placement.components.env=0-1"], "placement.components.env"),
    (R, ["rollout.max_new_tokens=1e9"], "rollout.max_new_tokens"),  # past the model's positions
    (E, ["runner.log_every=5"], "runner.log_every"),  # removed
    # plans that do not fit the cluster (4 CPU slots unless said), and envs the ranks cannot share
    (E, ["placement.mode=disaggregated", "cluster.cpu_slots=2"], "placement.mode"),
    (R, ["placement.mode=hybrid", "cluster.cpu_slots=1"], "placement.mode"),
    (R, ["placement=@{tmp}/far.yaml", "cluster.cpu_slots=4"], "placement"),
    (R, ["placement=@{tmp}/wide.yaml", "cluster.cpu_slots=4"], "placement"),
    (R, ["placement=@{tmp}/nope.yaml"], "placement.plan"),
    # a plan file that runs ahead sets runner.max_staleness: the rules that depend on it hold
    (R, ["placement=@{tmp}/ahead.yaml", "rollout.backend=vllm", "cluster.cpu_slots=4"], "rollout.partial"),
    (E, ["cluster.address=127.0.0.1:1"], "cluster.address"),  # nothing listens there
    (E, ["env.num_envs=6", "placement=@{tmp}/four_actors.yaml"], "env.num_envs"),  # 6 envs, 4 actor ranks
]


def test_malformed_configs_fail_before_ray_with_one_line_naming_the_key(tmp_path, capsys, no_ray):
    files = _files(tmp_path)
    messages = []
    for preset, overrides, key in MALFORMED:
        argv = ["train", preset.format(**files), *(o.format(**files) for o in overrides)]
        line = cli_error(capsys, argv)
        assert line.startswith(f"m2flow: error: {key}: "), (argv, line)
        messages.append(line)
    assert len(set(messages)) == len(messages) >= 16, [m for m in messages if messages.count(m) > 1]
    print("\n".join(messages))  # pytest -s shows them all


def test_some_messages_in_full(capsys, no_ray):
    cases = [
        ([R, "algorithm.lr=abc"], "algorithm.lr: expected a float, got 'abc'"),
        ([E, "runner.totl_env_steps=5"], "runner.totl_env_steps: no such key; did you mean runner.total_env_steps?"),
        ([E, "runner.lr=0.1"], "runner.lr: no such key; did you mean algorithm.lr?"),
        ([R, "rollout.top_p=0"], "rollout.top_p: must be in (0, 1], got 0.0"),
        ([E, "algorithm.gamma=null"], "algorithm.gamma: expected a float, got null"),
        ([R, "model.dtype=fp8"], "model.dtype: must be one of float32 | bfloat16 | float16, got 'fp8'"),
        ([E, "runner.on_node_loss=wait"], "runner.on_node_loss: must be one of continue | fail, got 'wait'"),
        ([RG, "algorithm.norm_adv=true"], "algorithm.norm_adv: must be false for algorithm.name=grpo: its advantages "
                                          "are already normalised within each group"),
        ([E, "runner.collect_ahead=true"], "runner.collect_ahead: renamed: use runner.max_staleness (true: 1)"),
        ([R, "placement.staleness=1"], "placement.staleness: renamed: use runner.max_staleness"),
        ([E, "runner.log_every=5"], "runner.log_every: removed: every update is logged (metrics.csv, TensorBoard): "
                                    "drop the key"),
        ([R, "placement.components.actor=7"], "placement.components.actor: takes effect only with "
                                              "placement.mode=custom, not collocated (which lays the devices out "
                                              "itself): set placement.mode=custom, or drop the key"),
        ([R, "data.levels=[1,2"], "data.levels: cannot read '[1,2' (while parsing a flow sequence): quote it, or "
                                  "mend its brackets"),
    ]
    for argv, message in cases:
        assert cli_error(capsys, ["train", *argv]) == f"m2flow: error: {message}"


def test_debug_shows_the_traceback(no_ray):
    with pytest.raises(ConfigError, match="algorithm.lr: expected a float"):
        cli.main(["--debug", "train", R, "algorithm.lr=abc"])


def test_a_text_key_takes_the_text_as_typed():
    """A key whose type is a string takes the override's text itself: not cut at a YAML
    comment, not read as a number or a boolean; one pair of quotes around it goes, null
    clears an optional one, and an interpolation still resolves."""
    cfg = load_config(R, ["data.instruction=Show the work #then box it", "name=0001", "runner.out_dir=/tmp/${name}",
                          "model.autocast=null", "rollout.dtype='bfloat16'"])
    assert cfg.data.instruction == "Show the work #then box it" and cfg.name == "0001"
    assert cfg.runner.out_dir == "/tmp/0001" and cfg.model.autocast is None and cfg.rollout.dtype == "bfloat16"
    assert load_config(R, ["data.instruction=Answer as: \\boxed{N}"]).data.instruction == "Answer as: \\boxed{N}"
    assert load_config(E, ["name=yes"]).name == "yes"


def test_an_integral_float_sets_an_int_key():
    cfg = load_config(E, ["runner.total_env_steps=1e6", "algorithm.lr=1"])
    assert cfg.runner.total_env_steps == 1_000_000 and type(cfg.runner.total_env_steps) is int
    assert cfg.algorithm.lr == 1.0 and type(cfg.algorithm.lr) is float


def test_open_mappings_take_any_key():
    cfg = load_config("embodied/ppo_maniskill_pushcube", ["env.kwargs.control_mode=pd_ee_delta_pose"])
    assert dict(cfg.env.kwargs) == {"ignore_terminations": True, "control_mode": "pd_ee_delta_pose"}
    cfg = load_config(R, ["reward.functions.format=0.5"])
    assert dict(cfg.reward.functions) == {"m2flow.rewards.toy:digit_share": 1.0, "format": 0.5}
    cfg = load_config(E, ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
                          "placement.components.actor={devices: 0-1, devices_per_proc: 2}"])
    assert cfg.placement.components.actor == {"devices": "0-1", "devices_per_proc": 2}


# ------------------------------------------------------------------ presets


@pytest.mark.parametrize("preset", presets())
def test_every_preset_loads_and_validates(preset):
    cfg = load_config(preset)
    validate(cfg)
    assert cfg.name == preset.split("/")[1] and cfg.flow == preset.split("/")[0]
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["runner"]["out_dir"] == f"runs/{cfg.name}"
    assert yaml.safe_load(to_yaml(cfg)) == plain  # what `m2flow config` prints is the config


def test_the_maniskill_preset_holds_its_task_settings():
    """Read without ManiSkill installed: the preset is only config."""
    cfg = load_config("embodied/ppo_maniskill_pushcube", ["runner.total_env_steps=3200"])
    assert cfg.env.id == "maniskill:PushCube-v1" and cfg.algorithm.gamma == 0.8 and cfg.env.kwargs.ignore_terminations
    assert cfg.runner.rollout_steps * cfg.env.num_envs % cfg.algorithm.minibatch_size == 0


@pytest.mark.parametrize("preset", presets())
def test_presets_hold_only_what_differs_from_the_defaults(preset):
    delta = yaml.safe_load((ROOT / "m2flow/presets" / f"{preset}.yaml").read_text())
    defaults = OmegaConf.to_container(OmegaConf.structured(root_of(delta["flow"])))

    def same(d, base, path):
        for k, v in d.items():
            if isinstance(v, dict) and isinstance(base.get(k), dict) and k not in ("kwargs", "functions"):
                yield from same(v, base[k], f"{path}{k}.")
            elif k in base and base[k] == v and type(base[k]) is type(v) and path + k != "flow":
                yield path + k

    assert list(same(delta, defaults, "")) == []


def test_presets_are_listed_and_a_config_printed_with_docs(capsys):
    cli.main(["presets"])
    listed = capsys.readouterr().out.split()
    assert listed == presets() and {"embodied/ppo_cartpole", "reasoning/grpo_arith_tiny"} <= set(listed)
    cli.main(["config", RP, "algorithm.lr=1e-4", "--docs"])
    out = capsys.readouterr().out
    assert "  lr: 0.0001  # the actor's AdamW learning rate\n" in out
    assert all("  # " in line for line in out.splitlines())  # every key has its doc
    assert yaml.safe_load(out) == OmegaConf.to_container(load_config(RP, ["algorithm.lr=1e-4"]), resolve=True)


def test_every_key_has_a_doc():
    def undocumented(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("doc"):
                yield prefix + f.name
            if dataclasses.is_dataclass(hints[f.name]):
                yield from undocumented(hints[f.name], f"{prefix}{f.name}.")

    assert [k for flow in shipped() for k in undocumented(root_of(flow))] == []


def test_the_schemas_names_are_the_codes():
    """The schema lists what the code accepts without importing it (torch); the lists agree."""
    from m2flow.data.arithmetic import LEVELS
    from m2flow.engines import BACKENDS
    from m2flow.models.lm import SMOLLM2, TINY_CONFIGS
    from m2flow.models.policies import ACTIVATIONS
    from m2flow.rewards.scorer import BUILTIN
    from m2flow.workers.lm_actor import ALGORITHMS
    from m2flow.workers.lm_common import DTYPES

    assert schema.REASONING_ALGORITHMS == ALGORITHMS and schema.BACKENDS == BACKENDS
    assert set(schema.DTYPES) == set(DTYPES) and set(schema.ACTIVATIONS) == set(ACTIVATIONS)
    assert set(schema.BUILTIN_MODELS) == {SMOLLM2, *TINY_CONFIGS} and set(schema.BUILTIN_REWARDS) == set(BUILTIN)
    assert set(schema.ARITHMETIC_LEVELS) == set(LEVELS)


# ------------------------------------------------------------------ installed


@pytest.mark.slow  # 20 s: a wheel built and installed, then a run
def test_a_plain_install_ships_the_presets_and_trains(tmp_path):
    """``pip install .`` (not editable) of a copy of this tree into a fresh directory, then the
    installed ``m2flow`` lists the presets and trains one, from a directory outside the tree.

    How the installed copy, and not this tree, is what runs: ``pip install --target T
    --no-deps --no-build-isolation`` builds a wheel with this interpreter's setuptools and
    unpacks it into T (torch, Ray and the rest stay those of this interpreter's environment).
    The commands then run with ``PYTHONPATH=T`` alone and a working directory outside the tree:
    T comes first on sys.path, ahead of site-packages, so ``import m2flow`` finds T's copy even
    where this environment has an editable install of m2flow (its finder is consulted only
    after sys.path). The test asserts ``m2flow.__file__`` lies in T, and Ray's workers inherit
    the same PYTHONPATH."""
    src, target, work = tmp_path / "src", tmp_path / "site", tmp_path / "work"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", ".m2flow", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", "MUJOCO_LOG.TXT"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    shutil.rmtree(src)  # nothing of the tree is left to import from
    work.mkdir()
    # T first; other PYTHONPATH entries (an environment whose packages come that way) after it,
    # the source tree left out.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not Path(p).resolve().is_relative_to(ROOT)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": os.pathsep.join([str(target), *kept])}

    def m2flow(*args, timeout=60):
        done = subprocess.run([str(target / "bin" / "m2flow"), *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    where = subprocess.run([sys.executable, "-c", "import m2flow.config as c; print(c.__file__, c.PRESET_DIR)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr[-3000:]
    module, preset_dir = where.stdout.split()
    assert Path(module).is_relative_to(target) and Path(preset_dir).is_relative_to(target), where.stdout + where.stderr
    assert m2flow("presets").split() == presets()
    out = m2flow("train", "embodied/ppo_cartpole", "runner.total_env_steps=512", "runner.progress=false",
                 f"runner.out_dir={work / 'run'}", "cluster.num_cpus=2", timeout=240)
    assert "updates 0-1" in out, out
    assert (work / "run" / "metrics.csv").read_text().count("\n") == 1 + 2  # header and 2 updates


def test_scoring_a_file_needs_no_training_set_beside_it(tmp_path):
    """``m2flow eval`` scores every row of a data file and trains on none: a file of 3 rows
    loads for it (training=False), though a training run of the preset refuses it (it holds
    out 32 and takes 4 a step)."""
    (tmp_path / "three.jsonl").write_text("".join(f'{{"question": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(3)))
    source = f"data.source={tmp_path / 'three.jsonl'}"
    with pytest.raises(ConfigError, match="data.test_size: .* has 3 problems, not enough to hold out 32"):
        load_config(R, [source])
    assert load_config(R, [source], training=False).data.source.endswith("three.jsonl")
    with pytest.raises(ConfigError, match="data.source: no such file"):
        load_config(R, [f"data.source={tmp_path / 'none.jsonl'}"], training=False)
