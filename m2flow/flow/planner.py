"""The planner: every plan a workflow can take on a cluster, each simulated on the cost
model, the fastest first (a plan that runs ahead priced for the learning its lagging data
costs: ``placement.staleness_cost``).

A candidate is a named mode with one way of splitting the devices among the mode's groups,
a granularity, a number of env stages, fused or not, and run-ahead (only where the
algorithm may take data one version old). Plans over device memory, or that the flow
cannot lay out (``check``), are left out; when none is left the error names the component
and what is short.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from m2flow.flow.cost import CostModel
from m2flow.flow.plan import Plan, PlanError, Workflow
from m2flow.flow.simulate import Layout, Prediction, Shape, predict
from m2flow.runtime.placement import parse_range, rank_devices

ShapeOf = Callable[[Plan, bool], Shape]  # (plan, fused) -> the step's shape under that plan


@dataclass
class Candidate:
    plan: Plan
    mode: str
    split: tuple[int, ...]  # devices per group of the mode (collocated: all of them)
    fused: bool
    layout: Layout
    prediction: Prediction | None = None
    rejected: str | None = None

    @property
    def step_s(self) -> float:
        return self.prediction.step_s if self.prediction else float("inf")

    def describe(self) -> str:
        p = self.plan
        knobs = [self.mode, "split " + "+".join(map(str, self.split))]
        ranks = {c: p.world_size(c) for c in p.components}
        knobs.append("ranks " + " ".join(f"{c}={n}" for c, n in ranks.items() if n > 1) if max(ranks.values()) > 1
                     else "one rank each")
        if p.granularity and max(p.granularity.values()) > 1:
            knobs.append(f"granularity {max(p.granularity.values())}")
        knobs += [f"stages {p.stages}"] if p.stages > 1 else []
        knobs += ["fused"] if self.fused else []
        knobs += [f"ahead {p.run_ahead}"] if p.run_ahead else []
        knobs += ["no offload"] if not p.offload else []
        return ", ".join(knobs)


def layout_of(plan: Plan, workflow: Workflow) -> tuple[Layout, bool]:
    """Processes, devices and turns as the runner makes them (``Runner._start``)."""
    fused = plan.fused(workflow)
    process = {c: c for c in plan.components} | plan.hosts(workflow)
    devices = {c: frozenset(plan.devices(c)) for c in plan.components}
    turns = workflow.turns({c: devices[c] for c in plan.components if process[c] == c}, fused)
    turns |= {c: turns[process[c]] for c in plan.components}  # a fused component: its host's
    # Devices used by the same components behave alike under the locks: one token stands for
    # each such set (a few, however many devices), which keeps simulating 1,024 devices cheap.
    users: dict = {}
    for c, devs in devices.items():
        for d in devs:
            users.setdefault(d, set()).add(c)
    token = {d: tuple(sorted(u)) for d, u in users.items()}
    atoms = {c: frozenset(token[d] for d in devs) for c, devs in devices.items()}
    t, ranks = workflow.trainer, None
    if t in plan.components and plan.world_size(t) > 1:  # the trainer's ranks, each on its devices
        p = plan.components[t]
        parts = rank_devices(sorted(devices[t]), p.procs_per_device, p.devices_per_proc)
        ranks = {t: tuple(frozenset(token[d] for d in part) for part in parts)}
    return Layout(process, atoms, turns, {c: len(devs) for c, devs in devices.items()}, ranks), fused


def splits(groups: int, n: int) -> list[tuple[int, ...]]:
    """Ways to give ``groups`` groups at least one of ``n`` devices each: every one on up to
    16 devices, else in eighths of the cluster."""
    if groups > n:
        return []
    if n <= 16:
        return [c for c in _compositions(n, groups)]
    out = []
    for c in _compositions(8, groups):
        sizes = [max(1, n * k // 8) for k in c[:-1]]
        out.append((*sizes, n - sum(sizes)))
    return sorted(set(s for s in out if s[-1] >= 1))


def _together(groups: tuple, pair: tuple[str, str] | None) -> list[tuple]:
    """The mode's groups with the fusable pair in one group, where the mode splits them and
    leaves at least two groups (else none): planned fused only, the env workers running the
    rollout on devices of their own (unfused, two busy processes would share each CPU slot,
    which the simulator does not model: it would overlap them)."""
    if pair is None:
        return []
    where = [next((i for i, (g, _) in enumerate(groups) if c in g), None) for c in pair]
    if None in where or where[0] == where[1] or len(groups) < 3:
        return []
    a, b = where
    return [tuple((g + groups[b][0], s) if i == a else (g, s) for i, (g, s) in enumerate(groups) if i != b)]


def _fewer(n: int) -> list[int]:
    """``n`` and its halvings down to one device."""
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def _compositions(n: int, k: int) -> list[tuple[int, ...]]:
    return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, n))) for cuts in itertools.combinations(range(1, n), k - 1)]


def candidates(workflow: Workflow, num_devices: int, kind: str, components: tuple[str, ...], *,
               granularities: Sequence[int] = (1,), stages: Sequence[int] = (1,), staleness: int = 0,
               trainer_devices_per_proc: int = 1) -> list[Candidate]:
    """Every plan of the workflow's modes on ``num_devices`` devices (not yet checked)."""
    out = []
    aheads = range(staleness + 1)  # run ahead by up to the staleness the algorithm allows
    fuses = [True, False] if workflow.fusable else [False]
    # collocated on all the devices, or on fewer (a small model may run best on one)
    # (mode, split, workflow with that split, fused only)
    layouts: list[tuple[str, tuple[int, ...], Workflow, bool]] = [("collocated", (k,), workflow, False)
                                                                 for k in _fewer(num_devices)]
    for mode, groups in workflow.splits.items():
        groups = tuple((tuple(c for c in g if c in components), s) for g, s in groups)
        groups = tuple((g, s) for g, s in groups if g)
        for grouping in (groups, *_together(groups, workflow.fusable)):
            for split in splits(len(grouping), num_devices):
                wf = dataclasses.replace(workflow, splits={mode: tuple((g, n) for (g, _), n in zip(grouping, split))})
                layouts.append((mode, split, wf, grouping is not groups))
    for (mode, split, wf, fused_only), g, st, fuse, ahead in itertools.product(layouts, granularities, stages, fuses,
                                                                               aheads):
        if fused_only and not fuse:
            continue
        def make(span: int) -> Plan:
            n = split[0] if mode == "collocated" else num_devices
            return Plan.for_mode(wf, mode, n, kind, components=components, fuse=fuse, granularity=g,
                                 stages=st, run_ahead=ahead, trainer_devices_per_proc=span)
        try:
            plan = make(trainer_devices_per_proc)
            trainer_devices = len(plan.devices(workflow.trainer))
            if trainer_devices % trainer_devices_per_proc:
                plan = make(1)  # the trainer's devices do not make ranks of that many: one per device
            # and one trainer rank over all its devices (fewer all-reduces; data the flow can share out)
            plans = [plan] + ([make(trainer_devices)] if trainer_devices > 1 and plan.world_size(workflow.trainer) > 1
                              else [])
        except PlanError:
            continue
        for plan in plans:
            layout, fused = layout_of(plan, workflow)
            if fuse and not fused:
                continue  # the same plan as unfused
            out.append(Candidate(plan, mode, split, fused, layout))
    return out


def memory_shortfall(plan: Plan, layout: Layout, model: CostModel, kind: str, gpu_slots: int = 0) -> str | None:
    """What is over device memory under ``plan`` (``layout``: its turns), or None. Memory is
    counted per GPU, each rank of a component on it holding the component's measured peak;
    ``gpu_slots`` > 1: a GPU is that many consecutive devices, whose ranks all draw on its
    memory. A rank that takes device turns on a GPU leaves its memory while another has the
    devices (offload), unless the plan keeps it (``plan.offload`` false); ranks on disjoint
    devices of one GPU hold their turns at once."""
    limit = model.profile.device_memory_mb
    if not limit:
        return None
    per = max(1, gpu_slots)
    on: dict[tuple[str, int], list[tuple[str, frozenset]]] = {}  # (node group, GPU) -> (component, devices) per rank
    for c, p in plan.components.items():
        group, indices = parse_range(p.devices, c)
        for devs in rank_devices(indices, p.procs_per_device, p.devices_per_proc):
            for gpu in sorted({d // per for d in devs}):
                on.setdefault((group, gpu), []).append((c, frozenset(d % per for d in devs if d // per == gpu)))
    checked = set()  # GPUs holding the same ranks need the same: one check for each kind
    for (group, gpu), ranks in sorted(on.items()):
        if tuple(ranks) in checked:
            continue
        checked.add(tuple(ranks))
        resident = [c for c, _ in ranks if not (kind == "cuda" and layout.turns[c] and plan.offload)]
        swapped = [(sum(1 << d for d in devs), model.memory_mb(c)) for c, devs in ranks if c not in resident]
        need = sum(model.memory_mb(c) for c in resident) + _peak_together(swapped)
        if need > limit:
            comps = list(dict.fromkeys(c for c, _ in ranks))
            worst = max(comps, key=model.memory_mb)
            node = "" if group == "all" else f" of node group {group!r}"
            where = (f"GPU {gpu}{node} (devices {gpu * per}-{gpu * per + per - 1}), used by" if per > 1
                     else "a device shared by")
            return (f"{where} {'+'.join(comps)}: they need {need:,.0f} MB, it has "
                    f"{limit:,.0f} MB ({worst} alone {model.memory_mb(worst):,.0f} MB; short by {need - limit:,.0f} MB)")
    return None


def _peak_together(ranks: list[tuple[int, float]]) -> float:
    """The most memory ranks taking device turns hold at once: ``ranks`` are (their devices
    as a bit mask, their memory); ranks on disjoint devices may hold their turns together."""
    @functools.cache
    def most(free: int) -> float:  # the best over ranks within the devices ``free``
        if not free:
            return 0.0
        low = free & -free
        best = most(free & ~low)  # no rank holds the lowest free device
        for mask, mb in ranks:
            if mask & low and mask & free == mask:
                best = max(best, mb + most(free & ~mask))
        return best

    return most(functools.reduce(operator.or_, (m for m, _ in ranks), 0))


@dataclass
class Choice:
    best: Candidate
    ranked: list[Candidate]  # feasible, the least priced step first (no ``staleness_cost``: fastest first)
    rejected: list[Candidate]
    planning_s: float
    notes: list[str] = dataclasses.field(default_factory=list)  # what the predictions leave out
    staleness_cost: tuple[float, ...] = ()  # the extra steps to the same learning, at 1, 2, ... versions ahead

    def priced_s(self, c: Candidate) -> float:
        return priced(c.step_s, c.plan.run_ahead, self.staleness_cost)

    def report(self, top: int = 5) -> str:
        b = self.best
        aheads = sorted({c.plan.run_ahead for c in self.ranked if c.plan.run_ahead})
        lags = any(priced(1.0, a, self.staleness_cost) != 1.0 for a in aheads)
        factors = ", ".join(f"x{priced(1.0, a, self.staleness_cost):.3g} at {a} ahead" for a in aheads)
        lines = [f"planned {len(self.ranked) + len(self.rejected)} plans in {self.planning_s:.2f} s "
                 f"({len(self.rejected)} rejected); predicted step times"
                 + (f" (priced for the learning that lagging data loses, {factors}):" if lags else ":")]
        for i, c in enumerate(self.ranked[:top]):
            price = f" (priced {self.priced_s(c):.3f} s)" if self.priced_s(c) != c.step_s else ""
            lines.append(f"  {'*' if i == 0 else ' '} {c.step_s:9.3f} s  {c.describe()}{price}")
        best_per_mode = {}
        for c in self.ranked:
            best_per_mode.setdefault(c.mode, c)
        why = [f"{m} at best {self.priced_s(c) / self.priced_s(b):.2f}x the {'priced ' if lags else ''}time"
               for m, c in best_per_mode.items() if c is not b and c.mode != b.mode]
        busy = b.prediction.busy_s
        bottleneck = max(busy, key=busy.get)
        fastest = min(self.ranked, key=lambda c: c.step_s)
        if fastest.step_s < b.step_s and fastest.plan.run_ahead > b.plan.run_ahead:
            lead = (f"{b.describe()} is the least priced: the fastest predicted, {fastest.describe()} "
                    f"({fastest.step_s:.3f} s), is {b.step_s / fastest.step_s:.2f}x as fast with data "
                    f"{fastest.plan.run_ahead - b.plan.run_ahead} version(s) older")
        else:
            lead = f"{b.describe()} is the fastest predicted"
        lines.append(f"why: {lead}; " + "; ".join(why))
        lines.append(f"  its busiest process: {bottleneck} ({busy[bottleneck] / b.step_s:.0%} of the step)")
        lines.append("predicted step (one steady-state step; # work, T train, s switch, w weight sync):")
        lines.append(b.prediction.timeline())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def predicted(model: CostModel, shape: Shape, layout: Layout, run_ahead: int = 0, offload: bool = True) -> Prediction:
    """A plan's steps on ``model``: with its switch costs (none where nothing moves out between
    turns: ``offload`` false) and contention, the trainer's rows varying from step to step as
    at the model's share."""
    return predict(shape, layout, model, model.switch_s if offload else {}, run_ahead, contention=model.contention,
                   train_scale=model.train_scales(shape.row_groups))


def priced(step_s: float, run_ahead: int, staleness_cost: Sequence[float] = ()) -> float:
    """A step's time per on-policy step's worth of learning: a run ``run_ahead`` versions ahead
    takes 1 + ``staleness_cost[run_ahead - 1]`` times the steps of an on-policy run to the same
    learning; further ahead than the list goes, its last entry's rate per version goes on."""
    n = len(staleness_cost)
    if not run_ahead or not n:
        return step_s
    if run_ahead <= n:
        return step_s * (1.0 + staleness_cost[run_ahead - 1])
    return step_s * (1.0 + staleness_cost[-1]) ** (run_ahead / n)


def preference(plan: Plan, step_s: float, staleness_cost: Sequence[float] = ()) -> tuple:
    """The order of plans: the least time per step's worth of learning first (with no
    ``staleness_cost``, the fastest); on a tie, the simpler plan (fewer stages, no run-ahead,
    one message per item)."""
    return (round(priced(step_s, plan.run_ahead, staleness_cost), 9), plan.stages, plan.run_ahead,
            max(plan.granularity.values(), default=1))


def plan(workflow: Workflow, shape_of: ShapeOf, model: CostModel, num_devices: int, kind: str,
         components: tuple[str, ...], check: Callable[[Plan], None] | None = None, gpu_slots: int = 0,
         staleness_cost: Sequence[float] = (), **options) -> Choice:
    """Simulates every candidate plan; the fastest that fits first, a plan that runs ahead
    priced by the steps it takes to the same learning (``staleness_cost``, see ``priced``;
    ``gpu_slots``: devices per GPU, for the memory each GPU's ranks share)."""
    start = time.perf_counter()
    ranked, rejected = [], []
    for c in candidates(workflow, num_devices, kind, components, **options):
        if kind == "cuda" and any(c.layout.turns.values()):  # kept where they are, if it all fits at once
            kept = dataclasses.replace(c.plan, offload=False)
            if memory_shortfall(kept, c.layout, model, kind, gpu_slots) is None:
                c.plan = kept
        reason = memory_shortfall(c.plan, c.layout, model, kind, gpu_slots)
        if reason is None and check is not None:
            try:
                check(c.plan)
            except (PlanError, ValueError) as e:
                reason = str(e)
        if reason is not None:
            c.rejected = reason
            rejected.append(c)
            continue
        c.prediction = predicted(model, shape_of(c.plan, c.fused), c.layout, c.plan.run_ahead, c.plan.offload)
        ranked.append(c)
    if not ranked:
        reasons = sorted({c.rejected for c in rejected if c.rejected}) or [f"no plan of {workflow.name} fits "
                                                                            f"{num_devices} device(s)"]
        raise PlanError(f"no plan fits: {reasons[0]}" + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""))
    ranked.sort(key=lambda c: preference(c.plan, c.step_s, staleness_cost))
    notes = [f"{gpu_slots} devices per GPU: their ranks share its memory (counted) and its compute, which the "
             "predictions leave out (each slot is priced as a GPU of its own)"] if gpu_slots > 1 else []
    if not ranked[0].plan.offload:
        notes.append("the components taking turns keep their memory on the GPU (it all fits at once): priced with no "
                     "switch cost, the turns' handover left out")
    if kind == "cpu" and ranked[0].mode != "collocated" and not model.contention:
        notes.append("components on CPU slots of their own compute at once and share the node's memory and "
                     "caches, which slows each; the predictions leave that out (each is priced as if it ran alone)")
    return Choice(ranked[0], ranked, rejected, time.perf_counter() - start, notes, tuple(staleness_cost))
