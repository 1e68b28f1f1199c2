"""What a flow declares, and where a flow is found by its name.

A flow is one module (``runners/embodied.py``, ``reasoning.py``, ``rejection.py``, or a user's
own) that ends with ``FLOW = Flow(...)``: its components and worker classes, its macro flow
(the ``Runner`` subclass with ``launch`` and ``step``, which makes the flow's metrics rows),
its config root and checks, and the facts the shared machinery asks of it, each a plain
function of the config (and the plan): who receives the trainer's weights, who takes them in
flight, the shape of a step the scheduler simulates and the knobs its plans may turn, what
``m2flow eval`` reports. The runner, recovery, profiling, ``placement=auto`` and eval read
those facts here, and nowhere else (docs/flows.md writes a flow step by step).

``flow_named`` finds a flow by the name a config's ``flow`` key gives (``config/flows.py``): a
flow shipped in this package by its short name, any other by its module's import path
(``my_package.my_flow``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from m2flow.config.flows import UnknownFlow, declared
from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape

if TYPE_CHECKING:
    from m2flow.runtime import Cluster
    from m2flow.runtime.pool import WorkerPool
    from m2flow.runtime.placement import ComponentPlacement

def _rollout(cfg: DictConfig) -> list[str]:
    return ["rollout"]


def _none(*args: Any) -> Any:
    return None


@dataclass(frozen=True)
class Flow:
    """A flow, as the shared machinery sees it. The callables take the run's config (and plan)."""

    name: str
    workflow: Workflow  # its components, channels and how named modes split the devices
    workers: Mapping[str, type]  # component -> worker class
    runner: type  # the macro flow: a ``runners.base.Runner`` with ``launch`` and ``step``
    config: type  # the root section of its configs (a dataclass: ``config.schema``'s sections)
    check: Callable[[Mapping, bool], None]  # the rules between its config's keys (resolved; training or not)
    length_key: str  # the config key that sets how long a run is
    # the scheduler's view (``runners.schedule.Schedule``): one step's shape under a plan,
    # whether its rollout runs in its env workers' processes; and the values its knobs may take
    shape: Callable[[DictConfig, Plan, bool], Shape]
    knobs: Callable[[DictConfig], dict[str, Any]]
    length: Callable[[DictConfig, int], dict[str, Any]]  # overrides that make a run of n updates
    # the profiling runs on n devices: overrides for all, and the plan settings and overrides
    # of the one that sees each component at another size (``Schedule.probe_sizes``)
    probe_sizes: Callable[[DictConfig, int], tuple[dict, dict, dict]]
    # ``m2flow eval``: the scores of a checkpoint (``runners.checkpoint.load``'s) under a config,
    # in this process, and one row per example scored (a prompt, an episode); the int: episodes,
    # for a flow that plays them
    score: Callable[[DictConfig, dict, int], tuple[dict[str, Any], list[dict[str, Any]]]]
    duration: str  # the metrics' column of a step's wall time
    probe_updates: int  # updates of the first profiling run (its first left out as warm-up)
    sized_on_one_device: bool = True  # the probe at the other size runs on one device
    overlap_probe_updates: int = 0  # updates of the probe that measures contention; 0: none
    stateful: tuple[str, ...] = ()  # components whose state a checkpoint holds
    resume_keys: tuple[str, ...] = ()  # config keys a resumed run must share with its checkpoint
    prefetch: Mapping[str, int] = field(default_factory=dict)  # channel -> items a reader takes ahead
    # the components and workflow a config makes (a config may leave a component out, or
    # without a model); None: the workflow's own
    components_for: Callable[[DictConfig], tuple[str, ...]] | None = None
    workflow_for: Callable[[DictConfig], Workflow] | None = None
    receivers: Callable[[DictConfig], list[str]] = _rollout  # the components that take the trainer's weights
    # the receivers that take the trainer's pushes themselves while streams run ahead
    # (in-flight weight updates): no pull call is queued for them
    refreshing: Callable[[DictConfig, Plan], set[str]] = lambda cfg, plan: set()
    plan_options: Callable[[DictConfig], dict[str, Any]] = lambda cfg: {}  # ``Plan.for_mode``'s keywords
    # fails (ConfigError) unless the flow can lay its work out on the plan (beyond ``Plan.check``)
    check_plan: Callable[[DictConfig, Plan], None] = _none

    def components(self, cfg: DictConfig) -> tuple[str, ...]:
        return self.components_for(cfg) if self.components_for else self.workflow.components

    def workflow_of(self, cfg: DictConfig) -> Workflow:
        return self.workflow_for(cfg) if self.workflow_for else self.workflow

    def in_flight(self, cfg: DictConfig, plan: Plan) -> bool:
        """Every receiver takes pushes itself: a stream ahead is launched at once, after only
        the trainer's push, not once the last stream is made (``Runner.stream``)."""
        fresh = self.refreshing(cfg, plan)
        return bool(fresh) and fresh >= set(self.receivers(cfg))

    def pooled_groups(self, cfg: DictConfig, plan: Plan, cluster: Cluster,
                      pool: WorkerPool) -> Iterator[tuple[type, ComponentPlacement, str]]:
        """The worker groups a run of ``cfg`` under ``plan`` on ``cluster`` makes (a fused
        component runs in its host's): each one's worker class, placement and name, as
        ``pool``'s runs name them."""
        placement, host = plan.placement(cluster), plan.hosts(self.workflow)
        for c in self.components(cfg):
            if c not in host:
                yield self.workers[c], placement[c], f"{c}-{pool.tag}"

    def prestart(self, cfg: DictConfig, plan: Plan, cluster: Cluster, pool: WorkerPool) -> None:
        """Starts, in the background, the worker processes a run of ``cfg`` under ``plan`` would start."""
        for group in self.pooled_groups(cfg, plan, cluster, pool):
            pool.prestart(*group)

    def warm_in(self, cfg: DictConfig, plan: Plan, cluster: Cluster, pool: WorkerPool) -> bool:
        """Whether a run of ``cfg`` under ``plan`` would take every worker process from
        ``pool``, starting none anew (``WorkerPool.holds``)."""
        return all(pool.holds(*group) for group in self.pooled_groups(cfg, plan, cluster, pool))


def flow_named(name: str) -> Flow:
    """The flow a config's ``flow`` key names (``config.flows.declared``): a shipped one's
    ``FLOW``, or that of the module at that import path. ``ValueError`` where there is none."""
    found = declared(name)
    if not isinstance(found, Flow):
        raise UnknownFlow(f"{name!r} declares FLOW, but not as a m2flow.runners.flow.Flow")
    return found
