"""Macro flows: the short loops a user reads."""

from __future__ import annotations

from omegaconf import DictConfig


def run(cfg: DictConfig) -> list[dict[str, float]]:
    """Runs the flow a config names and returns its per-update metrics. With
    ``placement.mode=auto`` the plan is chosen first (``runners.auto``), on the cluster the
    run then uses."""
    from m2flow.runners.start import claim_out_dir, start_cluster
    from m2flow.runners.flow import flow_named
    from m2flow.runtime.stop import StopRequest

    runner_cls = flow_named(cfg.flow).runner  # an unknown flow fails here, before a cluster starts
    cluster, replan, status, pool = None, None, None, None
    # SIGINT or SIGTERM from here on: the run stops after its update in progress (before the
    # first, if it comes while the run starts), with a checkpoint
    with StopRequest("stopping after the update in progress, with a checkpoint"), claim_out_dir(cfg):
        if cfg.placement.mode == "auto":
            from m2flow.runners.auto import auto_plan, replanner
            from m2flow.runners.status import RunStatus

            from m2flow.runtime.pool import WorkerPool

            status = RunStatus(cfg.runner.out_dir)  # starting: profiling
            pool = WorkerPool(for_one_run=True)  # the run keeps the probes' processes that it can use
            try:
                cluster = start_cluster(cfg.cluster)
                cfg = auto_plan(cfg, cluster, pool=pool)
                replan = replanner(cfg)  # for a run that goes on after its cluster lost a node
            except BaseException as e:
                status.failed(e)
                if cluster is not None:
                    pool.close()
                    cluster.shutdown()
                raise
        try:
            try:
                runner = runner_cls(cfg, cluster=cluster, replanner=replan, pool=pool)
            except BaseException as e:
                if status is not None:  # profiled: the file the profiling wrote says how it ended
                    status.failed(e)
                raise
            try:
                return runner.train()
            finally:
                runner.close()
        finally:
            if cluster is not None:
                pool.close()
                cluster.shutdown()
