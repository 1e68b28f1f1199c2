"""The costs a profile's busy times cannot show, read off its probes' whole step times through
the simulator: the switch cost (a component taking the devices from another) and the cost of
a message between processes; and, from a probe whose components computed at once (a split
plan run ahead), each component's slowdown while another computes beside it
(``Profile.contention``), read off its busy time against the model's.

A ``Probe`` is one profiling run as measured (``runners/profiling.py`` runs them and stores
them in the profile); each cost is the value at which the simulator gives what the probe
measured (``cost.calibrate``). Pure: no Ray, no runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2flow.flow.cost import CostModel, Profile, calibrate
from m2flow.flow.planner import predicted
from m2flow.flow.simulate import Layout, Shape, simulate, step_tasks


@dataclass
class Probe:
    name: str
    role: str  # "collocated", "sized", "split" or "overlap" (``runners.probes.ProbeRun``'s)
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


def fit_probes(prof: Profile, measured: list[Probe], heavy: list[str]) -> None:
    """Every cost of ``prof`` that its busy times cannot show, fitted afresh from ``measured``:
    the switch and hop costs from the probes that ran alone, the contention from the one whose
    components overlapped (``role == "overlap"``), if any. ``heavy``: the components that may
    pay a switch."""
    prof.switch_s, prof.hop_s, prof.contention = {}, 0.0, {}
    fit_hidden_costs(prof, [m for m in measured if m.role != "overlap"], heavy)
    overlap = [m for m in measured if m.role == "overlap"]
    if overlap:
        fit_contention(prof, overlap[0], heavy)
