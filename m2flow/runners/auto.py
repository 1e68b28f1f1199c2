"""Profiling a flow on the hardware it runs on, and ``placement.mode=auto``: profile (or reuse
a profile), plan, print the plan and why, run it.

A profile runs the flow itself for a few updates under three probe plans (every component
on all the devices; the same at another size, on one device or on all; one split mode), on
one cluster and one set of worker processes (re-initialised from run to run, not
restarted), and reads each component's busy time per update from the metrics (the trainer's
per row it forwarded: ``cost.trained_rows``). The switch cost and the cost of a message
between processes, which busy times cannot show, are read off the probes' whole step times
through the simulator.

On CPU slots, components of a split plan compute at once and slow each other (they share the
node's memory and caches: SmolLM2's actor trained 14-20% slower per row beside the rollout
than alone). Where the config may run ahead (``runner.max_staleness >= 1``, the plans whose
components overlap most) and the flow has one (``Schedule.overlap_probe_updates``), a fourth
probe runs the split plan one version ahead; each component's slowdown while another computes
(``Profile.contention``) is read off its busy time against the model's, through the simulator,
which then slows overlapping tasks by it.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from m2flow.flow import Plan, PlanError
from m2flow.flow.cost import (CostModel, Profile, ProfileError, calibrate, hardware, points_from_rows, profile_key,
                             trained_rows)
from m2flow.flow.planner import Choice, layout_of, plan, predicted
from m2flow.flow.simulate import Layout, Shape, simulate, step_tasks
from m2flow.runners.start import gpu_slots_of, local_devices, start_cluster
from m2flow.runners.schedule import Schedule, schedule_of
from m2flow.runtime import Cluster
from m2flow.runtime.pool import WorkerPool
from m2flow.runtime.stop import RunStopped

# Keys whose value does not change what a step costs: a profile is reused across them.
RUN_KEYS = ("total_env_steps", "steps", "out_dir", "resume", "progress", "checkpoint_every", "checkpoint_every_min",
            "target_return", "eval_every", "eval_episodes", "eval_deferred", "max_staleness", "stages",
            "hang_timeout_s", "max_restarts", "on_node_loss", "on_node_return", "stall_warning")


# Off-policy corrections that cost nothing beyond the loss's own arithmetic (the decoupled
# objective's proximal log-probs are another forward: ``algorithm.old_logprobs`` keys that).
FREE_CORRECTIONS = ("none", "tis")


def key_of(cfg: DictConfig) -> str:
    """The key of what ``cfg``'s steps cost: its config less the run's length and bookkeeping
    (``RUN_KEYS``), its placement and a free off-policy correction, so that an on-policy config
    and its asynchronous variant (``runner.max_staleness``, ``algorithm.off_policy=tis``) share
    a profile."""
    d = OmegaConf.to_container(cfg, resolve=True)
    d.pop("placement")
    d["runner"] = {k: v for k, v in d["runner"].items() if k not in RUN_KEYS}
    algorithm = d.get("algorithm", {})
    if algorithm.get("off_policy") in FREE_CORRECTIONS:
        algorithm["off_policy"] = "none"
        algorithm.pop("is_cap", None)
    return profile_key(d["name"], d)


def profile_path(cfg: DictConfig) -> Path:
    p = cfg.placement
    if p.profile is not None:
        return Path(p.profile)
    return Path("runs/profiles") / (key_of(cfg).replace(":", "-").replace("/", "_") + ".json")


@dataclass
class ProbeRun:
    name: str
    role: str  # "collocated", "sized" (the other size), "split" or "overlap" (the split plan run ahead)
    plan: Plan
    overrides: dict[str, Any]  # the config of this run, over the flow's
    updates: int | None = None  # its updates, all timed (default: the schedule's probe_updates)


def measures_contention(s: Schedule, kind: str) -> bool:
    """Whether a profile of this config measures contention (``overlap`` probe): on CPU, for a
    config that may run ahead, of a flow that has the probe."""
    return kind == "cpu" and s.cfg.runner.max_staleness >= 1 and s.overlap_probe_updates > 0


def probes(s: Schedule, n: int, kind: str) -> list[ProbeRun]:
    """The profiling runs on ``n`` devices: every component on every device; on one device
    (or on every device: ``Schedule.sized_on_one_device``) at the other size
    (``Schedule.probe_sizes``); the first split mode that fits (to time messages between
    processes); and where it ``measures_contention``, that split mode one version ahead."""
    wf, opts = s.workflow, s.plan_options() | {"stages": 1, "run_ahead": 0}
    every, variant, variant_overrides = s.probe_sizes(n)

    def of(mode: str, devices: int, **changes: Any) -> Plan:
        p = Plan.for_mode(wf, mode, devices, kind, components=s.components, **opts | changes)
        if not fits(p) and len(p.devices(wf.trainer)) > 1:
            # the trainer's ranks may not share its devices (the slots of one GPU): one rank
            # over all of them, as the planner's candidates also have it
            one = Plan.for_mode(wf, mode, devices, kind, components=s.components,
                                **opts | changes | {"trainer_devices_per_proc": len(p.devices(wf.trainer))})
            return one if fits(one) else p
        return p

    def fits(p: Plan) -> bool:
        try:
            p.check(wf, n, s.components, gpu_slots=gpu_slots_of(s.cfg, kind))
            s.check(p)
            return True
        except ValueError:  # PlanError and ConfigError among them
            return False

    sized = ", ".join(f"{k} {v}" for k, v in variant.items())
    out = [ProbeRun("collocated", "collocated", of("collocated", n), every)]
    if n > 1 and s.sized_on_one_device:
        out.append(ProbeRun(f"collocated on device 0, {sized}", "sized",
                            of("collocated", 1, trainer_devices_per_proc=1, **variant),
                            every | variant_overrides))
    else:
        out.append(ProbeRun(f"collocated, {sized}", "sized", of("collocated", n, **variant),
                            every | variant_overrides))
    for mode in wf.splits:
        try:
            p = of(mode, n, fuse=False)
        except PlanError:
            continue
        if fits(p):
            out.append(ProbeRun(mode, "split", p, every))
            ahead = of(mode, n, fuse=False, run_ahead=1)
            if measures_contention(s, kind) and fits(ahead):
                out.append(ProbeRun(f"{mode}, one ahead", "overlap", ahead, every, s.overlap_probe_updates))
            break
    return [r for r in out if fits(r.plan)]


def probe_config(s: Schedule, run: ProbeRun, tmp: Path, updates: int) -> DictConfig:
    cfg = copy.deepcopy(s.cfg)
    slug = run.name.replace(" ", "-").replace(",", "").replace("=", "")
    for k, v in s.length(updates).items() | run.overrides.items() | {
            "runner.out_dir": str(tmp / slug), "runner.progress": False, "runner.resume": None,
            "runner.max_staleness": run.plan.run_ahead,
            "placement.plan": str(run.plan.save(tmp / f"{slug}.yaml"))}.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def profile(cfg: DictConfig, cluster: Cluster | None = None, log=print) -> Profile:
    """Measures the flow of ``cfg`` on this hardware (see the module's docstring). The
    profiling time counts from a started cluster (a run starts one anyway: ``run`` lends the
    profile its own)."""
    s = schedule_of(cfg)
    own = cluster is None
    cluster = cluster or start_cluster(cfg.cluster)
    start = time.perf_counter()
    n, kind = len(cluster.devices), cluster.device_kind
    prof = Profile(key_of(cfg), hardware() | {"devices": n, "kind": kind})
    pool = WorkerPool()  # the runs share their worker processes: each is started once
    forwarded_all, made_all = 0.0, 0  # the trainer's rows over the probes' timed updates
    try:
        with tempfile.TemporaryDirectory(prefix="m2flow-profile-") as tmp:
            runs = probes(s, n, kind)
            for run in runs:  # every process any run needs starts now, beside the first run's
                s.flow.prestart(s.cfg, run.plan, cluster, pool)
            for i, run in enumerate(runs):
                t0 = time.perf_counter()
                # The first run's first update is left out (warm-up); later runs find the
                # processes warm and time every update they make, one fewer. On GPUs, where a
                # process moves only with its devices, a later run that starts one anew leaves
                # its first update out too: that update would pay the GPU's first use.
                fresh = kind == "cuda" and not s.flow.warm_in(s.cfg, run.plan, cluster, pool)
                warm_up = int(i == 0 or fresh)
                run_cfg = probe_config(s, run, Path(tmp), run.updates or s.probe_updates - 1 + warm_up)
                runner = s.runner(run_cfg, cluster=cluster, pool=pool)
                if i == 0:
                    pool.ready()  # none is still starting while a run is timed
                try:
                    rows = runner.train(evaluate=False, checkpoint=False, trace=False)[warm_up:]
                except RunStopped as e:
                    raise RunStopped(f"stopped by {e.name} while profiling (probe "
                                     f"{i + 1} of {len(runs)}, {run.name}): no profile stored, nothing to resume",
                                     e.signum) from None
                finally:
                    runner.close()
                layout, fused = layout_of(run.plan, s.workflow)
                shape = schedule_of(run_cfg).shape(run.plan, fused)
                if run.role != "overlap":  # its components slowed each other: the model's costs are of each alone
                    prof.points += points_from_rows(shape, layout, rows)
                forwarded = [trained_rows(shape, r) for r in rows]
                shares = [f / shape.batch for f in forwarded]
                forwarded_all, made_all = forwarded_all + sum(forwarded), made_all + shape.batch * len(rows)
                step = statistics.median(r[s.duration] for r in rows)
                for c in s.components:
                    mem = [r[f"{c}_peak_memory_mb"] for r in rows if f"{c}_peak_memory_mb" in r]
                    if mem:
                        prof.memory_mb[c] = max(prof.memory_mb.get(c, 0.0), max(mem))
                prof.runs.append({"probe": run.name, "role": run.role, "plan": run.plan.to_dict(), "overrides": run.overrides,
                                  "step_s": step, "run_s": time.perf_counter() - t0,
                                  "updates_timed": len(rows), "updates_left_out": warm_up,
                                  "trained_share": statistics.mean(shares) if shares else 1.0,
                                  "trained_shares": shares,
                                  "busy_s": {c: statistics.mean(r[f"{c}_busy_s"] for r in rows) for c in s.components
                                             if rows and all(f"{c}_busy_s" in r for r in rows)}}
                                 # recorded: a language model's step costs with its tokens, the model counts completions
                                 | ({"completion_length": statistics.median(r["completion_length"] for r in rows)}
                                    if rows and all("completion_length" in r for r in rows) else {}))
                log(f"profile: {run.name}: {step:.3f} s a step ({time.perf_counter() - t0:.1f} s)")
    finally:
        pool.close()
        stop = time.perf_counter()  # shutting the cluster down is no part of profiling
        if own:
            cluster.shutdown()
    start += time.perf_counter() - stop
    prof.trained_share = forwarded_all / made_all if made_all else 1.0
    if prof.trained_share == 0.0:
        log("profile: the trainer forwarded no row (every one of zero gradient): its cost per row is not "
            "measured, and its training is predicted as free")
    measured = refit_hidden_costs(cfg, prof)
    model = CostModel(prof)
    for m in measured:  # in-sample: the hidden costs were read off these
        if m.role == "overlap":  # its busy times (its first steps fill the pipeline: no steady state)
            busy = m.busy_s or {}
            log(f"profile: {m.name}: busy per update measured " + ", ".join(
                f"{c} {busy[c]:.3f} s (the model says {m.busy(model, c):.3f} s)" for c in prof.contention if c in busy))
        else:
            log(f"profile: {m.name}: measured {m.step_s:.3f} s, the model says {m.predicted(model):.3f} s")
    log(f"profile: switch {max(prof.switch_s.values(), default=0.0) * 1e3:.1f} ms, "
        f"message between processes {prof.hop_s * 1e3:.2f} ms")
    if prof.contention:
        log("profile: " + model.contention_report().strip())
    prof.profiling_s = time.perf_counter() - start
    if kind == "cuda":
        import torch

        prof.device_memory_mb = torch.cuda.get_device_properties(0).total_memory / 2**20
    return prof


@dataclass
class Probe:
    name: str
    role: str  # ProbeRun's
    shape: Shape
    layout: Layout
    step_s: float  # measured: the median over its updates
    trained_share: float = 1.0  # of the trainer's rows, over its updates
    run_ahead: int = 0  # its plan's
    updates: int = 1  # timed
    busy_s: dict[str, float] | None = None  # measured, per component: the mean over its updates
    trained_shares: list[float] | None = None  # of the trainer's rows, per update

    def predicted(self, model: CostModel) -> float:
        """Its step time as ``model`` predicts it, with its profile's switch, hop and contention
        costs as they are now and the trainer forwarding as many rows as in this probe."""
        return predicted(model.at_share(self.trained_share), self.shape, self.layout, self.run_ahead).step_s

    def busy(self, model: CostModel, component: str) -> float:
        """``component``'s busy time per update, as ``model`` predicts it over this probe's
        updates (its first streams, made before any update, too: they were timed), each update
        forwarding the rows it did; its messages left out, as a busy time leaves them out."""
        shares, mean = self.trained_shares or [], self.trained_share
        scale = [x / mean for x in shares] if len(shares) == self.updates and mean > 0 else []
        at = model.at_share(mean)

        def cost(c: str, phase: str, items: float, devices: int) -> float:
            return 0.0 if phase == "hop" else at(c, phase, items, devices)

        tasks = step_tasks(self.shape, self.layout, cost, self.updates, self.run_ahead, scale)
        spans = simulate(tasks, model.switch_s, model.contention)
        return sum(sp.end - sp.start for sp in spans if tasks[sp.task].component == component
                   and sp.kind != "sync") / self.updates


def fit_hidden_costs(prof: Profile, measured: list[Probe], heavy: list[str]) -> None:
    """The switch cost (from the collocated probe, its components taking turns) and the cost
    of a message between processes (from the split mode's), each read off a whole step's
    time with the other held; twice, as each changes what the other probe predicts."""
    role = {m.role: m for m in measured}
    first, split = role["collocated"], role.get("split")
    model = CostModel(prof)  # fitted once: the switch and hop costs are read from ``prof`` as they change

    def switch(x: float) -> float:
        prof.switch_s = dict.fromkeys(heavy, x)
        return first.predicted(model)

    def hop(x: float) -> float:
        prof.hop_s = x
        return split.predicted(model)

    for _ in range(2):
        if any(first.layout.turns.values()):
            switch(calibrate(first.step_s, switch))
        if split is not None:
            hop(calibrate(split.step_s, hop))


def fit_contention(prof: Profile, overlap: Probe, heavy: list[str]) -> None:
    """Each heavy component's slowdown while another process computes beside it: the value at
    which the simulator, the components of the ``overlap`` probe computing at once, gives the
    busy time it measured (none where it measured no more than alone); twice, as each
    component's slowdown changes how long the others overlap it."""
    model = CostModel(prof)  # reads the contention from ``prof`` as it changes
    measured = overlap.busy_s or {}
    prof.contention = dict.fromkeys(heavy, 0.0)

    def of(c: str):
        def slowed(x: float) -> float:
            prof.contention[c] = x
            return overlap.busy(model, c)
        return slowed

    for _ in range(2):
        for c in heavy:
            if measured.get(c, 0.0) > 0:
                slowed = of(c)
                slowed(calibrate(measured[c], slowed))


def refit_hidden_costs(cfg: DictConfig, prof: Profile) -> list[Probe]:
    """Reads the switch and hop costs off the probes a profile stored (their plans, configs
    and measured step times), with the simulator as it is now (so a profile measured by an
    earlier version need not be measured again when only the model changed); returns them."""
    s = schedule_of(cfg)
    measured = []
    for r in prof.runs:
        plan = Plan.from_dict(r["plan"])
        run_cfg = copy.deepcopy(s.cfg)
        for k, v in r.get("overrides", {}).items():
            OmegaConf.update(run_cfg, k, v, merge=False)
        layout, fused = layout_of(plan, s.workflow)
        role = r.get("role") or ("split" if not r["probe"].startswith("collocated")  # a profile that names none
                                 else "collocated" if r["probe"] == "collocated" else "sized")
        measured.append(Probe(r["probe"], role, schedule_of(run_cfg).shape(plan, fused), layout, r["step_s"],
                              r.get("trained_share", 1.0), plan.run_ahead, r.get("updates_timed", 1), r.get("busy_s"),
                              r.get("trained_shares")))
    prof.switch_s, prof.hop_s, prof.contention = {}, 0.0, {}
    heavy = [c for c in s.components if c not in s.workflow.light]  # who may pay a switch
    fit_hidden_costs(prof, [m for m in measured if m.role != "overlap"], heavy)
    overlap = [m for m in measured if m.role == "overlap"]
    if overlap:
        fit_contention(prof, overlap[0], heavy)
    return measured


def load_or_profile(cfg: DictConfig, cluster: Cluster | None = None, log=print) -> tuple[Profile, Path]:
    """The profile of ``cfg`` on this hardware: the stored one when its preset, config and
    hardware match, else a new one (stored), measured on ``cluster`` if given."""
    path = profile_path(cfg)
    known = (len(cluster.devices), cluster.device_kind) if cluster else local_devices(cfg.cluster)
    prof = None
    if path.is_file() and known:
        try:
            prof = Profile.load(path)
        except ProfileError as e:
            log(f"profile: {e}: profiling again")
    if prof is not None and prof.matches(key_of(cfg), hardware() | {"devices": known[0], "kind": known[1]}):
        roles = {r.get("role") for r in prof.runs}
        if measures_contention(schedule_of(cfg), known[1]) and "split" in roles and "overlap" not in roles:
            log(f"profile: {path} has no measure of contention, which this config's plans (ahead by up to "
                f"{cfg.runner.max_staleness}) need: profiling again")
        else:
            log(f"profile: reusing {path} (measured in {prof.profiling_s:.1f} s)")
            return prof, path
    prof = profile(cfg, cluster, log=log)
    prof.config = OmegaConf.to_container(cfg, resolve=True)
    prof.save(path)
    log(f"profile: {path}, measured in {prof.profiling_s:.1f} s")
    return prof, path


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


def auto_plan(cfg: DictConfig, cluster: Cluster | None = None, log=print) -> DictConfig:
    """``placement.mode=auto``: a copy of ``cfg`` that runs the plan chosen for it (profiled
    on ``cluster`` if a profile is to be made)."""
    prof, _ = load_or_profile(cfg, cluster, log)
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
