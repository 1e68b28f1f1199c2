"""Profiling a flow on the hardware it runs on: ``profile`` measures it, ``load_or_profile``
reuses a stored profile where its config and hardware match (``key_of``) or measures one and
stores it.

A profile runs the flow itself for a few updates under the probe plans (``runners/probes.py``),
on one cluster and one set of worker processes (re-initialised from run to run, not
restarted), and reads each component's busy time per update from the metrics (the trainer's
per row it forwarded: ``cost.trained_rows``). The costs busy times cannot show (the switch
cost, the cost of a message between processes and, from a probe run ahead, each component's
slowdown while another computes: ``Profile.contention``) are read off the probes' whole step
and busy times through the simulator (``flow/hidden_costs.py``; ``refit_hidden_costs`` reads
them again off a stored profile).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from m2flow.flow import Plan
from m2flow.flow.cost import CostModel, Profile, ProfileError, hardware, points_from_rows, profile_key, trained_rows
from m2flow.flow.hidden_costs import Probe, fit_probes
from m2flow.flow.planner import layout_of
from m2flow.runners.probes import measures_contention, probe_config, probes
from m2flow.runners.schedule import schedule_of
from m2flow.runners.start import local_devices, start_cluster
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


def profile(cfg: DictConfig, cluster: Cluster | None = None, log=print, pool: WorkerPool | None = None) -> Profile:
    """Measures the flow of ``cfg`` on this hardware (see the module's docstring). The
    profiling time counts from a started cluster (a run starts one anyway: ``run`` lends the
    profile its own). ``pool``: the probes' processes are left in it, for the run that
    profiling plans (else they end with it)."""
    s = schedule_of(cfg)
    own = cluster is None
    cluster = cluster or start_cluster(cfg.cluster)
    start = time.perf_counter()
    n, kind = len(cluster.devices), cluster.device_kind
    prof = Profile(key_of(cfg), hardware() | {"devices": n, "kind": kind})
    own_pool = pool is None
    pool = pool or WorkerPool()  # the runs share their worker processes: each is started once
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
        if own_pool:
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


def refit_hidden_costs(cfg: DictConfig, prof: Profile) -> list[Probe]:
    """Reads the switch, hop and contention costs off the probes a profile stored (their plans, configs
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
    heavy = [c for c in s.components if c not in s.workflow.light]  # who may pay a switch
    fit_probes(prof, measured, heavy)
    return measured


def load_or_profile(cfg: DictConfig, cluster: Cluster | None = None, log=print,
                    pool: WorkerPool | None = None) -> tuple[Profile, Path]:
    """The profile of ``cfg`` on this hardware: the stored one when its preset, config and
    hardware match, else a new one (stored), measured on ``cluster`` if given (its processes
    left in ``pool``, if given)."""
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
    prof = profile(cfg, cluster, log=log, pool=pool)
    prof.config = OmegaConf.to_container(cfg, resolve=True)
    prof.save(path)
    log(f"profile: {path}, measured in {prof.profiling_s:.1f} s")
    return prof, path
