"""``placement.mode=auto``: profile (or reuse a profile: ``runners/profiling.py``), plan, print
the plan and why, run it; ``replanner``, the pick for a run that lost devices; and ``m2flow
plan``, the best plan from a profile (given, stored, or measured now), on any number of
devices and nodes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from m2flow.flow import Plan
from m2flow.flow.cost import CostModel, Profile, ProfileError
from m2flow.flow.planner import Choice, plan
from m2flow.runners.profiling import load_or_profile, profile_path
from m2flow.runners.schedule import schedule_of
from m2flow.runners.start import gpu_slots_of
from m2flow.runtime import Cluster
from m2flow.runtime.pool import WorkerPool


def choose(cfg: DictConfig, prof: Profile, num_devices: int | None = None, nodes: int = 1,
           internode: float = 1.0, model: CostModel | None = None) -> Choice:
    """The best plan for ``cfg`` on ``num_devices`` devices (default: the profile's), as the
    cost model fitted from ``prof`` (or ``model``, fitted from it already) predicts it."""
    s = schedule_of(cfg)
    n = num_devices or prof.hardware["devices"]
    kind = prof.hardware["kind"]
    if model is None:
        model = CostModel(prof, internode=internode, devices_per_node=max(1, n // nodes) if nodes > 1 else None)
    opts = s.plan_options()

    slots = gpu_slots_of(cfg, kind)

    def check(p: Plan) -> None:
        p.check(s.workflow, n, s.components, gpu_slots=slots, devices_per_node=n // nodes if nodes > 1 else 0)
        s.check(p)

    return plan(s.workflow, s.shape, model, n, kind, s.components, check=check, gpu_slots=slots,
                staleness=cfg.runner.max_staleness, staleness_cost=tuple(cfg.placement.staleness_cost),
                trainer_devices_per_proc=opts.get("trainer_devices_per_proc", 1), **s.knobs())


def auto_plan(cfg: DictConfig, cluster: Cluster | None = None, log=print, pool: WorkerPool | None = None) -> DictConfig:
    """``placement.mode=auto``: a copy of ``cfg`` that runs the plan chosen for it (profiled
    on ``cluster`` if a profile is to be made, the probes' processes left in ``pool``)."""
    prof, _ = load_or_profile(cfg, cluster, log, pool)
    model = CostModel(prof)
    err, share, slow = model.held_out_error(), model.share_report(), model.contention_report()
    log("cost model (held-out error per fit: leave one point out):\n" + model.report()
        + (f"\n  median held-out error {err:.1%}" if err is not None else "")
        + "".join(f"\n{x}" for x in (share, slow) if x))
    choice = choose(cfg, prof, model=model)
    log(choice.report())
    out = Path(cfg.runner.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = choice.best.plan.save(out / "plan.yaml")
    cfg = copy.deepcopy(cfg)
    OmegaConf.update(cfg, "placement.plan", str(path), merge=False)
    return cfg


def replanner(cfg: DictConfig) -> Callable[[int], Plan]:
    """For a run of ``cfg`` as ``auto_plan`` made it: the planner's pick for it on ``n``
    devices, from the profile it was planned with (a run that goes on after its cluster lost a
    node)."""
    return lambda n: choose(cfg, Profile.load(profile_path(cfg)), num_devices=n).best.plan


def plan_command(preset: str | None, overrides: list[str], profile_file: str | None, devices: int | None,
                 nodes: int, internode: float, out: str | None, log=print) -> Choice:
    """``m2flow plan``: the best plan from a profile (given, stored, or measured now)."""
    from m2flow.config import ConfigError, load_config
    from omegaconf.errors import OmegaConfBaseException

    from m2flow.config.loader import apply_override, translate
    from m2flow.config.flows import UnknownFlow, root_of

    for flag, value, least in (("--devices", devices, 1), ("--nodes", nodes, 1)):
        if value is not None and value < least:
            raise ConfigError(flag, f"must be >= {least}, got {value}")
    if not internode > 0:
        raise ConfigError("--internode", f"must be > 0 (how much slower a cross-node exchange is), got {internode}")
    if profile_file:
        path = Path(profile_file)
        if not path.is_file():
            raise ConfigError("--profile", f"no such profile file {profile_file!r} (m2flow profile writes one)")
        try:
            prof = Profile.load(path)
        except ProfileError as e:
            raise ConfigError("--profile", f"{e} (m2flow profile writes one)") from None
        if preset:
            cfg = load_config(preset, overrides)
        else:  # the config the profile was measured with
            try:
                root = root_of(prof.config.get("flow"))
            except UnknownFlow:
                raise ConfigError("--profile", f"{profile_file} holds no config of a flow: give its preset "
                                               "too") from None
            try:
                cfg = OmegaConf.merge(OmegaConf.structured(root), prof.config)
            except OmegaConfBaseException as e:
                raise ConfigError("--profile", f"{profile_file} holds a config this version does not read "
                                               f"({translate(e, root)}): give its preset too, or profile again") from None
            for item in overrides:
                apply_override(cfg, root, item)
    elif preset:
        cfg = load_config(preset, overrides)
        prof, _ = load_or_profile(cfg, log=log)
    else:
        raise ConfigError("plan", "give a preset or --profile FILE")
    if (devices or prof.hardware["devices"]) % nodes:
        raise ConfigError("--nodes", f"{devices or prof.hardware['devices']} device(s) do not spread evenly over "
                                     f"{nodes} node(s)")
    start = time.perf_counter()
    choice = choose(cfg, prof, devices, nodes, internode)
    log(f"{devices or prof.hardware['devices']} {prof.hardware['kind']} device(s) on {nodes} node(s), "
        f"profile {prof.key} ({prof.hardware['cpu']}; {prof.hardware['gpus'] or 'no GPU'})")
    log(choice.report())
    log(choice.best.plan.table(schedule_of(cfg).workflow))
    log(f"planning time {time.perf_counter() - start:.2f} s")
    if out:
        try:
            log(f"plan written to {choice.best.plan.save(out)}")
        except OSError as e:
            raise ConfigError("--out", f"cannot write {out!r}: {e.strerror or e}") from None
    return choice
