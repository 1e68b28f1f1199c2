"""A discrete-event simulation of training steps under a plan.

The runtime's rules, on known costs: each process runs its calls in the order they were
made; a task starts once the tasks it needs are done; a task of a component that shares its
devices with another (collocated, hybrid) first takes its devices' lock, granted first come,
first served (a request waits behind an earlier one on the same devices), and pays the
component's switch cost when another process held the devices last (offload/onload and the
lock's hand-over). A task may go to a pool of processes instead of one (the trainer's ranks
taking streamed chunks): whichever member is free first, with its devices free, takes it.
With ``contention`` (a component's slowdown while another process computes at once, as a
fraction: 0.2 is 20% slower, measured by the profile on a CPU node where processes share
the memory and caches), a task's work goes at ``1 / (1 + contention)`` of its speed for as
long as a task of another process runs beside it.
``step_tasks`` lays a flow's steps out as tasks: the makers' chain per chunk (the plan's
granularity or env stages) repeated per rollout step, the trainer on the chunks, and the
weight sync that lets the next step's stream start (one update late when the plan runs
ahead).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Task:
    name: str
    process: str  # the process that runs it (a fused pair shares one)
    component: str  # whose switch cost it pays
    seconds: float
    deps: tuple[int, ...] = ()  # indices of the tasks it needs
    devices: frozenset = frozenset()  # the devices whose lock it holds while it runs (none: no turns)
    step: int = 0
    kind: str = "work"  # work | train | sync
    keep: bool = False  # its process keeps the devices after it (a turn that spans several tasks)
    # (process, devices) of each member of a pool: the first free one, its devices free, runs it
    # (``process`` then names the pool's queue: its tasks are taken in order)
    pool: tuple[tuple[str, frozenset], ...] = ()


@dataclass(frozen=True)
class Span:
    task: int
    name: str
    process: str
    step: int
    kind: str
    start: float
    end: float
    switch_s: float


class SimulationError(ValueError):
    pass


def simulate(tasks: Sequence[Task], switch_s: Mapping[str, float] | None = None,
             contention: Mapping[str, float] | None = None) -> list[Span]:
    """Runs ``tasks`` on the runtime's rules; returns when each ran, in task order."""
    switch_s = switch_s or {}
    slow = {c: x for c, x in (contention or {}).items() if x > 0}
    queues: dict[str, deque[int]] = {}
    for i, t in enumerate(tasks):
        if any(d >= i for d in t.deps):
            raise SimulationError(f"task {t.name!r} needs a task made after it")
        queues.setdefault(t.process, deque()).append(i)
    finish: list[float | None] = [None] * len(tasks)
    spans: list[Span | None] = [None] * len(tasks)
    ran: dict[int, tuple[str, frozenset]] = {}  # a pool's task: the member and the devices it ran on
    busy: set[str] = set()
    held: dict = {}  # device -> the process holding it now
    holder: dict = {}  # device -> the process that held it last
    requests: list[tuple[float, int]] = []  # (requested at, task), waiting for devices
    requested: set[int] = set()
    running: list[tuple[float, int]] = []
    work: dict[int, float] = {}  # with contention: a running task's work left (seconds alone) since ``since``
    since = 0.0
    now, left = 0.0, len(tasks)

    def reprice() -> None:
        """With contention, the running tasks' ends at the speeds they go at from ``now`` on."""
        nonlocal since
        speeds = {i: speed(i) for _, i in running}  # the same since the last change, and from now on
        for i, v in speeds.items():  # the work done since the last change
            rest = work[i] - (now - since) * v
            work[i] = rest if rest > 1e-9 else 0.0  # done (its round-off left out): it ends now
        since = now
        running[:] = [(now + work[i] / v, i) for i, v in speeds.items()]
        heapq.heapify(running)

    def speed(i: int) -> float:
        mine = ran.get(i, (tasks[i].process,))[0]
        beside = any(ran.get(j, (tasks[j].process,))[0] != mine for _, j in running)
        return 1.0 / (1.0 + slow.get(tasks[i].component, 0.0)) if beside else 1.0

    def start(i: int, process: str, devices: frozenset) -> None:
        """Task ``i`` on ``process`` (a pool's member: the pool holds the devices, so that its
        members, ranks on devices that one token stands for, run side by side)."""
        t = tasks[i]
        switch = switch_s.get(t.component, 0.0) if any(holder.get(d, t.process) != t.process
                                                       for d in devices) else 0.0
        end = now + switch + t.seconds
        spans[i] = Span(i, t.name, process, t.step, t.kind, now, end, switch)
        held.update(dict.fromkeys(devices, t.process))
        holder.update(dict.fromkeys(devices, t.process))
        busy.add(process)
        queues[t.process].popleft()
        if slow:
            reprice()  # the others' work up to now, at the speeds before this task came
            work[i] = switch + t.seconds
            running.append((end, i))
            reprice()
        else:
            heapq.heappush(running, (end, i))

    def dispatch() -> bool:
        """Starts what can start now; whether anything did."""
        started = False
        for p, q in queues.items():
            if p not in busy and q and q[0] not in requested and not tasks[q[0]].pool:
                i = q[0]
                if all(finish[d] is not None for d in tasks[i].deps):
                    requests.append((now, i))
                    requested.add(i)
        requests.sort()
        blocked: set = set()
        for r in list(requests):
            i = r[1]
            t = tasks[i]
            kept = bool(t.devices) and all(held.get(d) == t.process for d in t.devices)  # its process's turn goes on
            if not kept and (t.devices & blocked or any(held.get(d, t.process) != t.process for d in t.devices)):
                blocked |= t.devices  # first come, first served: a later request does not overtake
                continue
            requests.remove(r)
            start(i, t.process, t.devices)
            started = True
        for p, q in queues.items():  # a pool's next tasks, each to the first member free with its devices free
            while q and tasks[q[0]].pool and all(finish[d] is not None for d in tasks[q[0]].deps):
                free = [(m, devs) for m, devs in tasks[q[0]].pool
                        if m not in busy and not devs & blocked and all(held.get(d, p) == p for d in devs)]
                if not free:
                    break
                ran[q[0]] = free[0]
                start(q[0], *free[0])
                started = True
        return started

    while left:
        while dispatch():  # a start may free the next task of its queue to start at once
            pass
        if not running:
            stuck = [tasks[q[0]].name for q in queues.values() if q]
            raise SimulationError(f"no task can start: {stuck} wait on each other")
        now = running[0][0]
        if slow:
            reprice()
        while running and running[0][0] == now:
            _, i = heapq.heappop(running)
            finish[i] = now
            if slow:
                spans[i] = dataclasses.replace(spans[i], end=now)
                del work[i]
            process, devices = ran.get(i, (tasks[i].process, tasks[i].devices))
            busy.discard(process)
            if not tasks[i].keep:
                for d in devices:
                    held.pop(d, None)
            left -= 1
        if slow:
            reprice()  # the tasks left beside fewer others
    return spans  # type: ignore[return-value]


# -- a flow's steps as tasks ---------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One step of a flow, as far as timing goes.

    Every step, ``items`` items (envs, or samples) are cut into ``chunks``; each chunk passes
    through ``chain`` (component names in order), the whole chain ``repeats`` times (the
    rollout steps of an env loop). The trainer then trains on the chunks: chunk by chunk as
    they arrive when ``trainer_streams`` (plus a final ``update`` task), else on the whole
    batch at once. A ``batched`` link (a generator) works on all the chunks at once and
    finishes them one after another, the first once ``first_out`` of its work is done (a
    rollout that decodes its sequences in W waves completes its first group after about one
    wave: 1/W; with one wave, every group at the end); taking device turns, it holds the
    devices for all of them. A ``whole_turns`` link that takes device turns takes one per
    step: from its first task to its last (a fused process's links share it). ``receivers``
    take the trainer's weights before a step's stream starts; ``in_flight``: they also take the
    pushes that come while it runs, so a stream ahead is launched without waiting for the one
    before it to be made.

    The chain need not be a line: ``beside`` maps a link to a component it calls while it works
    (a rollout and its tool workers; a learner and the replay buffer it samples): that
    component's work runs on its own process, chunk for chunk beside the link's, and a chunk
    goes on once both are done. A cycle (rollout -> tools -> rollout, each trajectory several
    times) is priced as its two sides' work per step side by side: while some sequences wait on
    their tools the others decode, so the slower side sets the pace."""

    chain: tuple[str, ...]
    trainer: str
    items: int
    chunks: int
    repeats: int = 1
    trainer_streams: bool = False
    receivers: tuple[str, ...] = ("rollout",)
    batched: tuple[str, ...] = ()  # links that work on the whole batch at once, its chunks done in turn
    samples: int | None = None  # what the trainer trains on per step (default: items)
    whole_turns: tuple[str, ...] = ()  # links whose device turn spans their whole call (the step's stream)
    first_out: float = 0.0  # the share of a batched link's work done when its first chunk comes out
    in_flight: bool = False  # run ahead, the receivers take pushes themselves: no wait for the last stream
    # The trainer skips its rows a group at a time (a reasoning step's prompt groups whose samples
    # all got one reward): how many it forwards varies from step to step. 0: it does not skip.
    row_groups: int = 0
    beside: Mapping[str, str] = field(default_factory=dict)  # a link -> the component it calls as it works

    @property
    def batch(self) -> int:
        return self.items if self.samples is None else self.samples


@dataclass(frozen=True)
class Layout:
    """Where a plan puts each component: its process (a fused pair shares one), its devices,
    and whether it takes device turns (it shares a device with another component)."""

    process: Mapping[str, str]
    devices: Mapping[str, frozenset]  # (what stands for) its devices: only sharing matters here
    turns: Mapping[str, bool]
    counts: Mapping[str, int] | None = None  # devices per component (default: len(devices))
    # a component of several ranks: (what stands for) each rank's devices (default: one rank)
    ranks: Mapping[str, tuple[frozenset, ...]] | None = None

    def held(self, component: str) -> frozenset:
        return self.devices[component] if self.turns[component] else frozenset()

    def count(self, component: str) -> int:
        return self.counts[component] if self.counts is not None else len(self.devices[component])

    def rank_devices(self, component: str) -> tuple[frozenset, ...]:
        return (self.ranks or {}).get(component) or (self.devices[component],)


# cost(component, phase, items, devices) -> seconds; the phases: "work" (a link of the chain on
# a chunk), "hop" (its message to the next link's process), "train" (the trainer on a chunk or
# batch), "update" (its optimizer step), "sync" (the weight broadcast).
Cost = Callable[[str, str, float, int], float]


def step_tasks(shape: Shape, layout: Layout, cost: Cost, steps: int, run_ahead: int = 0,
               train_scale: Sequence[float] = ()) -> list[Task]:
    """``steps`` steps of ``shape`` under ``layout`` as tasks, in the order the runner makes
    its calls. With ``run_ahead = a`` streams 0..a start on the first weights, each queued
    behind the one before on its processes; at step k >= 1 the runner waits for the receivers
    to finish stream k+a-1, syncs the weights of update k-1 and launches stream k+a, then the
    trainer's update k (the runner's ``stream``). With ``shape.in_flight`` the runner does not
    wait: it pushes the weights (the trainer's process) and launches the stream, which starts
    on them once its processes are done with the stream before. ``train_scale``: step k's
    trainer trains on ``train_scale[k % len]`` times its rows (steps that forward more or fewer
    rows than the mean; none: all alike)."""
    tasks: list[Task] = []
    trained: list[int] = []  # the last trainer task of each step
    last_made: list[int] = []  # the last task of each stream on a receiver (a sync after it waits for it)

    def add(task: Task) -> int:
        tasks.append(task)
        return len(tasks) - 1

    if any(c in shape.batched for c in shape.chain[1:]):
        raise SimulationError(f"a batched link must come first in the chain, got {shape.chain}")
    sizes = _chunk_sizes(shape.items, shape.chunks)
    trainer_dev = layout.count(shape.trainer)

    def sync(k: int, deps: tuple[int, ...], changed: bool) -> int:
        t = shape.trainer
        s = cost(t, "sync", shape.batch, trainer_dev) if changed else 0.0
        return add(Task(f"sync[{k}]", layout.process[t], t, s, deps, frozenset(), k, "sync"))

    def stream(k: int, synced: int) -> list[tuple[int, ...]]:
        """Its tasks; for each chunk, the tasks the trainer's on it waits for."""
        first = len(tasks)  # the stream's tasks follow, together
        prev: list[tuple[int, ...]] = [(synced,)] * len(sizes)
        for r in range(shape.repeats):
            for c, size in enumerate(sizes):
                for j, comp in enumerate(shape.chain):
                    devices, name = layout.count(comp), f"{comp}[{k}.{r}.{c}]"
                    last = j + 1 == len(shape.chain)
                    nxt = shape.trainer if last and r + 1 == shape.repeats else shape.chain[0 if last else j + 1]
                    # a message to another process costs a hop (none within a fused process)
                    hop = cost(comp, "hop", size, devices) if layout.process[nxt] != layout.process[comp] else 0.0
                    if comp not in shape.batched:
                        deps = prev[c]
                        prev[c] = (add(Task(name, layout.process[comp], comp, cost(comp, "work", size, devices) + hop,
                                            deps, layout.held(comp), k)),) + beside(comp, name, size, deps, k)
                    elif c == 0:  # the whole batch: its chunks end in turn (at once under a device turn)
                        whole = cost(comp, "work", shape.items, devices)
                        deps = tuple(d for p in prev for d in p)
                        if layout.turns[comp]:
                            prev = [(add(Task(name, layout.process[comp], comp, whole + hop * len(sizes), deps,
                                              layout.held(comp), k)),)] * len(sizes)
                            partner = [beside(comp, name, shape.items, deps, k)] * len(sizes)
                        else:
                            f = shape.first_out
                            partner = []
                            for i, part in enumerate(sizes):
                                share = (1 - f) * part / shape.items + (f if i == 0 else 0.0)
                                ahead = deps if i == 0 else ()
                                prev[i] = (add(Task(f"{comp}[{k}.{r}.{i}]", layout.process[comp], comp,
                                                    whole * share + hop, ahead, frozenset(), k)),)
                                partner.append(beside(comp, f"{comp}[{k}.{r}.{i}]", shape.items, ahead, k, share))
                        prev = [p + q for p, q in zip(prev, partner)]
        _one_turn(tasks, first, shape, layout)
        on_receiver = [i for i in range(first, len(tasks)) if tasks[i].component in shape.receivers]
        last_made.append(on_receiver[-1] if on_receiver else prev[-1][0])
        return prev

    def beside(comp: str, name: str, items: float, deps: tuple[int, ...], k: int,
               share: float = 1.0) -> tuple[int, ...]:
        """The work of the component ``comp`` calls as it works (``share`` of it on ``items``),
        on that component's process, beside ``comp``'s task ``name``: no task where it calls none."""
        other = shape.beside.get(comp)
        if other is None:
            return ()
        seconds = cost(other, "work", items, layout.count(other)) * share
        return (add(Task(f"{other}<{name}>", layout.process[other], other, seconds, deps, layout.held(other), k)),)

    ranks = layout.rank_devices(shape.trainer)
    # Streamed to several ranks, each chunk goes to whichever rank is free, its devices free (the
    # runner's ``batches`` channel; a rank beside a component that holds its devices waits for
    # them); ranks on the same devices behave alike: as many as there are chunks stand for them.
    pool: list[tuple[str, frozenset]] = []
    if shape.trainer_streams and len(ranks) > 1:
        alike: dict[frozenset, int] = {}
        turns = layout.turns[shape.trainer]
        for devs in ranks:
            if alike.get(devs, 0) < len(sizes):
                alike[devs] = alike.get(devs, 0) + 1
                pool.append((f"{layout.process[shape.trainer]}#{len(pool)}", devs if turns else frozenset()))

    def train(k: int, ends: list[tuple[int, ...]]) -> None:
        t, proc, held = shape.trainer, layout.process[shape.trainer], layout.held(shape.trainer)
        scale = train_scale[k % len(train_scale)] if train_scale else 1.0
        if shape.trainer_streams:
            last, parts = None, []
            per_rank = max(1, trainer_dev // len(ranks))
            for c, (end, size) in enumerate(zip(ends, sizes)):
                part = size * shape.batch / shape.items * scale
                if pool:  # any rank, in the order the chunks come; all of them then update together
                    parts.append(add(Task(f"{t}[{k}.{c}]", proc, t, cost(t, "train", part, per_rank), end,
                                          frozenset(), k, "train", pool=tuple(pool))))
                    continue
                deps = end + ((last,) if last is not None else ())
                last = add(Task(f"{t}[{k}.{c}]", proc, t, cost(t, "train", part, trainer_dev), deps, held, k, "train"))
            trained.append(add(Task(f"{t}.update[{k}]", proc, t, cost(t, "update", shape.batch, trainer_dev),
                                    tuple(parts) or (last,), held, k, "train")))
        else:
            trained.append(add(Task(f"{t}[{k}]", proc, t, cost(t, "train", shape.batch * scale, trainer_dev),
                                    tuple(d for end in ends for d in end), held, k, "train")))

    if not run_ahead:
        for k in range(steps):
            ends = stream(k, sync(k, (trained[-1],) if trained else (), changed=True))
            train(k, ends)
        return tasks
    # Ahead by a: step 0 launches streams 0..a on the first weights, each once the one before
    # is made; step k >= 1 waits for the receivers to finish stream k+a-1, syncs update k-1's
    # weights and launches stream k+a.
    fly = shape.in_flight
    streams = [stream(0, sync(0, (), changed=True))]
    for j in range(1, min(run_ahead, steps - 1) + 1):
        # the first weights are in already: no push (the runner's send_weights sends none)
        streams.append(stream(j, sync(j, () if fly else (last_made[j - 1],), changed=False)))
    for k in range(steps):
        if k >= 1 and k + run_ahead < steps:
            deps = (trained[k - 1],) if fly else (trained[k - 1], last_made[k + run_ahead - 1])
            streams.append(stream(k + run_ahead, sync(k + run_ahead, deps, changed=True)))
        train(k, streams[k])
    return tasks


def _one_turn(tasks: list[Task], first: int, shape: Shape, layout: Layout) -> None:
    """A stream's tasks (``tasks[first:]``) of each process whose links hold their turn for
    the whole call: every one but the process's last keeps the devices."""
    procs = {layout.process[c] for c in shape.whole_turns if c in layout.turns and layout.turns[c]}
    last = {tasks[i].process: i for i in range(first, len(tasks)) if tasks[i].process in procs}
    for i in range(first, len(tasks)):
        if tasks[i].process in procs and i != last[tasks[i].process]:
            tasks[i] = dataclasses.replace(tasks[i], keep=True)


def _chunk_sizes(items: int, chunks: int) -> list[int]:
    chunks = max(1, min(chunks, items))
    base, extra = divmod(items, chunks)
    return [base + (c < extra) for c in range(chunks)]


@dataclass
class Prediction:
    step_s: float  # steady-state seconds per step
    spans: list[Span] = field(repr=False)
    busy_s: dict[str, float] = field(default_factory=dict)  # per process, per step
    shown: str = ""  # what the spans are of, when not the whole step
    last_step: int | None = None  # the last timed step (spans of later ones: streams made ahead)

    def timeline(self, width: int = 60, step: int | None = None) -> str:
        """A text picture of the spans, one row per process (the last simulated step by default)."""
        if step is None:
            step = max(s.step for s in self.spans) if self.last_step is None else self.last_step
        spans = [s for s in self.spans if s.step == step and s.end > s.start]
        t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
        scale = width / max(t1 - t0, 1e-12)
        rows = {}
        for s in spans:
            row = rows.setdefault(s.process, [" "] * width)
            a, b = int((s.start - t0) * scale), max(int((s.start - t0) * scale) + 1, int(math.ceil((s.end - t0) * scale)))
            mark = {"train": "T", "sync": "w"}.get(s.kind, "#")
            for x in range(a, min(b, width)):
                row[x] = "s" if x < a + int(s.switch_s * scale) else mark
        name = max(len(p) for p in rows)
        lines = [f"  {p:<{name}} |{''.join(r)}|" for p, r in rows.items()]
        lines.append(f"  {'':<{name}}  0{'':>{width - 8}}{t1 - t0:6.2f}s")
        return "\n".join(lines + ([f"  ({self.shown})"] if self.shown else []))


def predict(shape: Shape, layout: Layout, cost: Cost, switch_s: Mapping[str, float] | None = None,
            run_ahead: int = 0, steps: int = 6, contention: Mapping[str, float] | None = None,
            train_scale: Sequence[float] = ()) -> Prediction:
    """The steady-state step time of ``shape`` under ``layout``: the trainer's finishing times
    over ``steps`` simulated steps, the first (pipeline fill) left out, and with run-ahead the
    streams of the steps after them made too (no drain).

    A long env loop (``repeats`` over 16) is simulated at 8 and 16 repeats with the trainer's
    per-step costs scaled alike (so the same component is the bottleneck), and the step time
    is extrapolated along that line to the full loop: exact for the loop's steady state, the
    per-step constants (device hand-overs, pipeline fill and drain) counted once.
    ``contention``: as ``simulate``'s. ``train_scale``: as ``step_tasks``'s; at least as many
    steps as it has values are timed (a stream ahead absorbs a long update only as far as it
    is ahead: steps that vary wait on each other where steps alike would not)."""
    steps = max(steps, len(train_scale))
    if shape.repeats <= 16:
        return _predict(shape, layout, cost, switch_s, run_ahead, steps, contention, train_scale)
    r = shape.repeats
    small, big = (_predict(dataclasses.replace(shape, repeats=k), layout, _scaled(cost, k / r), switch_s, run_ahead,
                           steps, contention, train_scale) for k in (8, 16))
    grow = (r - 16) / 8
    busy = {p: big.busy_s[p] + grow * (big.busy_s[p] - small.busy_s.get(p, 0.0)) for p in big.busy_s}
    return Prediction(big.step_s + grow * (big.step_s - small.step_s), big.spans, busy,
                      f"16 of the {r} rollout steps, the trainer's time scaled to match", big.last_step)


def _scaled(cost: Cost, factor: float) -> Cost:
    def scaled(comp: str, phase: str, items: float, devices: int) -> float:
        s = cost(comp, phase, items, devices)
        return s * factor if phase in ("train", "update", "sync") else s
    return scaled


def _predict(shape: Shape, layout: Layout, cost: Cost, switch_s: Mapping[str, float] | None, run_ahead: int,
             steps: int, contention: Mapping[str, float] | None = None, train_scale: Sequence[float] = ()) -> Prediction:
    # Ahead by a, the last a updates of a run have no stream left to make beside them: they
    # train on data made already, faster than any update of the steady state. ``steps`` updates
    # are timed, with the streams of a more made after them (their updates not counted).
    spans = simulate(step_tasks(shape, layout, cost, steps + run_ahead, run_ahead, train_scale), switch_s, contention)
    ends = [max(s.end for s in spans if s.step == k and s.kind == "train") for k in range(steps)]
    step_s = (ends[-1] - ends[0]) / (steps - 1) if steps > 1 else ends[0]
    busy: dict[str, float] = {}
    for s in spans:
        if 0 < s.step < steps:
            busy[s.process] = busy.get(s.process, 0.0) + (s.end - s.start) / (steps - 1)
    return Prediction(step_s, spans, busy, last_step=steps - 1)
