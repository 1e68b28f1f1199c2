"""The step simulator against timelines worked out by hand."""

import dataclasses

import pytest

from m2flow.flow.simulate import Layout, Shape, SimulationError, Task, predict, simulate, step_tasks


def spans_of(spans, process):
    return [(s.start, s.end) for s in spans if s.process == process]


def table_cost(table):
    """cost(component, phase, items, devices) from {(component, phase): seconds per item}."""
    return lambda comp, phase, items, devices: table.get((comp, phase), 0.0) * items


def test_two_stage_pipeline():
    # Three chunks through a (2 s) then b (3 s) on processes of their own: b is the bottleneck.
    tasks = []
    for c in range(3):
        tasks.append(Task(f"a{c}", "a", "a", 2.0))
        tasks.append(Task(f"b{c}", "b", "b", 3.0, deps=(len(tasks) - 1,)))
    spans = simulate(tasks)
    assert spans_of(spans, "a") == [(0, 2), (2, 4), (4, 6)]
    assert spans_of(spans, "b") == [(2, 5), (5, 8), (8, 11)]


def test_two_stage_pipeline_step_with_sync_and_trainer():
    # Per step: sync 0.5, three chunks of a (2 s) then b (1 s), the trainer (4 s) on the batch.
    # a: 0.5-2.5, 2.5-4.5, 4.5-6.5; b: 2.5-3.5, 4.5-5.5, 6.5-7.5; train 7.5-11.5: 11.5 s a step.
    shape = Shape(chain=("a", "b"), trainer="t", items=3, chunks=3, receivers=("a",))
    layout = Layout({c: c for c in "abt"}, {c: frozenset([i]) for i, c in enumerate("abt")}, dict.fromkeys("abt", False))
    cost = table_cost({("a", "work"): 2.0, ("b", "work"): 1.0, ("t", "train"): 4 / 3, ("t", "sync"): 0.5 / 3})
    p = predict(shape, layout, cost, steps=4)
    first = [s for s in p.spans if s.step == 0]
    assert [(s.name, s.start, s.end) for s in first if s.process == "b"] == [
        ("b[0.0.0]", 2.5, 3.5), ("b[0.0.1]", 4.5, 5.5), ("b[0.0.2]", 6.5, 7.5)]
    assert [(s.start, s.end) for s in first if s.kind == "train"] == [(7.5, 11.5)]
    assert p.step_s == pytest.approx(11.5)


def test_collocated_chain_pays_the_switch_cost():
    # a (2 s) and the trainer (3 s) share device 0; each pays 0.5 s when it takes the device
    # from the other. Step 0: a 0-2 (nobody held it), t 2-5.5; step 1: a 5.5-8, t 8-11.5.
    shape = Shape(chain=("a",), trainer="t", items=1, chunks=1, receivers=("a",))
    dev = frozenset([0])
    layout = Layout({"a": "a", "t": "t"}, {"a": dev, "t": dev}, {"a": True, "t": True})
    cost = table_cost({("a", "work"): 2.0, ("t", "train"): 3.0})
    p = predict(shape, layout, cost, switch_s={"a": 0.5, "t": 0.5}, steps=3)
    assert spans_of(p.spans, "a") == [(0, 2), (5.5, 8), (11.5, 14)]
    assert [(s.start, s.end) for s in p.spans if s.kind == "train"] == [(2, 5.5), (8, 11.5), (14, 17.5)]
    assert [s.switch_s for s in p.spans if s.kind == "train"] == [0.5, 0.5, 0.5]
    assert p.step_s == pytest.approx(6.0)


def test_device_lock_is_first_come_first_served():
    # x holds device 0 until 4; y asks for devices {0, 1} at 1, z for device 1 at 2: z waits
    # behind y although device 1 is free, as the lock grants requests in order.
    tasks = [Task("x", "x", "x", 4.0, devices=frozenset([0])),
             Task("wy", "y", "y", 1.0), Task("y", "y", "y", 1.0, deps=(1,), devices=frozenset([0, 1])),
             Task("wz", "z", "z", 2.0), Task("z", "z", "z", 1.0, deps=(3,), devices=frozenset([1]))]
    spans = simulate(tasks)
    assert (spans[2].start, spans[2].end) == (4, 5)
    assert (spans[4].start, spans[4].end) == (5, 6)


@pytest.mark.parametrize("make, train, expected", [(3.0, 2.0, 3.0), (2.0, 3.0, 3.0)])
def test_run_ahead_by_one_version(make, train, expected):
    # Makers and trainer on devices of their own. On-policy a step is make + train; one
    # version ahead the next stream is made while the trainer trains: max(make, train).
    # By hand (make 3, train 2): a0 0-3, a1 3-6 (same weights), train0 3-5; a2 starts when
    # a1 is done and update 0 is in (6): 6-9, train1 6-8; train ends 5, 8, 11, ...
    shape = Shape(chain=("a",), trainer="t", items=1, chunks=1, receivers=("a",))
    layout = Layout({"a": "a", "t": "t"}, {"a": frozenset([0]), "t": frozenset([1])}, {"a": False, "t": False})
    cost = table_cost({("a", "work"): make, ("t", "train"): train})
    assert predict(shape, layout, cost, steps=5).step_s == pytest.approx(make + train)
    ahead = predict(shape, layout, cost, run_ahead=1, steps=5)
    assert ahead.step_s == pytest.approx(expected)
    if make == 3.0:
        assert [(s.start, s.end) for s in ahead.spans if s.kind == "train"][:3] == [(3, 5), (6, 8), (9, 11)]
        # stream k+1 uses the weights of update k-1: its sync waits for that update
        syncs = {s.name: s.start for s in ahead.spans if s.kind == "sync"}
        assert syncs["sync[2]"] == 6.0 and syncs["sync[3]"] == 9.0


def test_run_ahead_by_two_versions():
    # Make 3, train 2, two versions ahead: streams 0-2 on the first weights, each launched once
    # the one before is made (a0 0-3, a1 3-6, a2 6-9), then update 0: 6-8. At step k >= 1 the
    # runner waits for the maker to finish stream k+1, syncs update k-1's weights and launches
    # stream k+2, then the update: sync[3] at 9, a3 9-12, train1 9-11; sync[4] at 12, a4 12-15,
    # train2 12-14; sync[5] at 15, a5 15-18, train3 15-17; sync[6] at 18, train4 18-20. The
    # steady state is the maker's 3 s. Five updates timed: the streams of two more are made
    # (a5, a6), else train3 and train4 would follow train2 at once (14-16, 16-18: a drain
    # that no steady-state step has).
    shape = Shape(chain=("a",), trainer="t", items=1, chunks=1, receivers=("a",))
    layout = Layout({"a": "a", "t": "t"}, {"a": frozenset([0]), "t": frozenset([1])}, {"a": False, "t": False})
    p = predict(shape, layout, table_cost({("a", "work"): 3.0, ("t", "train"): 2.0}), run_ahead=2, steps=5)
    assert spans_of(p.spans, "a") == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 18), (18, 21)]
    assert [(s.start, s.end) for s in p.spans if s.kind == "train"][:5] == [(6, 8), (9, 11), (12, 14), (15, 17),
                                                                            (18, 20)]
    syncs = {s.name: s.start for s in p.spans if s.kind == "sync"}
    assert [syncs[f"sync[{k}]"] for k in range(1, 7)] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
    assert p.step_s == pytest.approx(3.0)


def test_in_flight_updates_launch_ahead_without_waiting():
    # Make 2, train 3, two versions ahead, on devices of their own. Without in-flight updates
    # the runner launches stream j once stream j-1 is made (its sync on the trainer's process
    # waits for it): a0 0-2, a1 2-4, sync[2] at 4, train0 4-7; at step 1 it waits for a2 (4-6)
    # and update 0 (7): train1 7-10. In flight, every launch is a push, at once: train0 2-5
    # (stream 0 is made at 2); at step 1 update 0's push at 5, a3 6-8 (after a2), train1 5-8.
    # The steady state is the trainer's 3 s either way: in flight, an update starts sooner,
    # the throughput is the same.
    shape = Shape(chain=("a",), trainer="t", items=1, chunks=1, receivers=("a",))
    layout = Layout({"a": "a", "t": "t"}, {"a": frozenset([0]), "t": frozenset([1])}, {"a": False, "t": False})
    cost = table_cost({("a", "work"): 2.0, ("t", "train"): 3.0})
    waiting = predict(shape, layout, cost, run_ahead=2, steps=5)
    flying = predict(dataclasses.replace(shape, in_flight=True), layout, cost, run_ahead=2, steps=5)
    assert [(s.start, s.end) for s in waiting.spans if s.kind == "train"][:3] == [(4, 7), (7, 10), (10, 13)]
    assert [(s.start, s.end) for s in flying.spans if s.kind == "train"][:3] == [(2, 5), (5, 8), (8, 11)]
    assert spans_of(flying.spans, "a")[:4] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert waiting.step_s == pytest.approx(3.0) and flying.step_s == pytest.approx(3.0)


def test_env_stages_pipeline_the_rollout():
    # Two env stages: while the rollout acts on one half of the envs, the other half steps.
    # env 1 s and rollout 1 s per half, 2 rollout steps: one stage takes 2 * (2 + 2) = 8 s,
    # two stages overlap them: env 0-1, 1-2, 2-3, 3-4; rollout 1-2, 2-3, 3-4, 4-5.
    shape = Shape(chain=("env", "rollout"), trainer="t", items=2, chunks=2, repeats=2, receivers=("rollout",))
    layout = Layout({"env": "env", "rollout": "rollout", "t": "t"},
                    {"env": frozenset([0]), "rollout": frozenset([1]), "t": frozenset([2])},
                    {"env": False, "rollout": False, "t": False})
    cost = table_cost({("env", "work"): 1.0, ("rollout", "work"): 1.0})
    tasks = step_tasks(shape, layout, cost, steps=1)
    spans = simulate(tasks)
    assert spans_of(spans, "env") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert spans_of(spans, "rollout") == [(1, 2), (2, 3), (3, 4), (4, 5)]
    one = simulate(step_tasks(Shape(("env", "rollout"), "t", 2, 1, repeats=2), layout, cost, steps=1))
    assert max(s.end for s in one) == 8


def test_streaming_trainer_starts_on_the_first_chunk():
    shape = Shape(chain=("a",), trainer="t", items=2, chunks=2, trainer_streams=True, receivers=("a",))
    layout = Layout({"a": "a", "t": "t"}, {"a": frozenset([0]), "t": frozenset([1])}, {"a": False, "t": False})
    cost = table_cost({("a", "work"): 2.0, ("t", "train"): 1.0, ("t", "update"): 0.5})
    spans = simulate(step_tasks(shape, layout, cost, steps=1))
    assert [(s.name, s.start, s.end) for s in spans if s.kind == "train"] == [
        ("t[0.0]", 2, 3), ("t[0.1]", 4, 5), ("t.update[0]", 5, 6.0)]


def test_tasks_that_wait_on_each_other_are_reported():
    # p runs its calls in order: its first call needs its second.
    tasks = [Task("q0", "q", "q", 1.0), Task("p0", "p", "p", 1.0, deps=(2,)), Task("p1", "p", "p", 1.0)]
    with pytest.raises(SimulationError, match="made after it"):
        simulate(tasks)


def test_timeline_draws_each_process():
    shape = Shape(chain=("a",), trainer="t", items=1, chunks=1, receivers=("a",))
    layout = Layout({"a": "a", "t": "t"}, {"a": frozenset([0]), "t": frozenset([0])}, {"a": True, "t": True})
    p = predict(shape, layout, table_cost({("a", "work"): 1.0, ("t", "train"): 1.0}), steps=2)
    picture = p.timeline(width=20)
    rows = picture.splitlines()
    assert rows[0].split("|")[1] == "#" * 10 + " " * 10
    assert rows[1].split("|")[1] == " " * 10 + "T" * 10


@pytest.mark.parametrize("train, ahead", [(20.0, 0), (20.0, 1), (200.0, 1), (5.0, 1)])
def test_long_env_loops_are_extrapolated_to_the_full_loop(train, ahead):
    # 64 rollout steps, two stages, a device hand-over between makers and trainer: the
    # extrapolation from 8 and 16 repeats agrees with simulating all 64.
    from m2flow.flow.simulate import _predict

    shape = Shape(chain=("env", "rollout"), trainer="t", items=8, chunks=2, repeats=64)
    dev = frozenset([0, 1])
    layout = Layout({"env": "env", "rollout": "env", "t": "t"}, {"env": dev, "rollout": dev, "t": frozenset([2])},
                    {"env": False, "rollout": False, "t": False})
    cost = table_cost({("env", "work"): 0.1, ("rollout", "work"): 0.05, ("t", "train"): train / 8, ("t", "sync"): 0.01})
    full = _predict(shape, layout, cost, None, ahead, 6)
    fast = predict(shape, layout, cost, run_ahead=ahead)
    assert fast.step_s == pytest.approx(full.step_s, rel=0.02)
    assert fast.busy_s["t"] == pytest.approx(full.busy_s["t"], rel=0.02)


def test_a_turn_kept_across_tasks_holds_the_devices_between_them():
    # p takes device 0 for p0 and keeps it until p1 (which waits for r0 until 2): q1, asking
    # for device 0 at 0.5, gets it only when p1 ends at 3. Without keep it runs at 1-2.
    def tasks(keep):
        return [Task("r0", "r", "r", 2.0), Task("p0", "p", "p", 1.0, devices=frozenset([0]), keep=keep),
                Task("q0", "q", "q", 0.5), Task("q1", "q", "q", 1.0, deps=(2,), devices=frozenset([0])),
                Task("p1", "p", "p", 1.0, deps=(0,), devices=frozenset([0]))]
    kept = simulate(tasks(True))
    assert (kept[3].start, kept[3].end) == (3, 4) and (kept[4].start, kept[4].end) == (2, 3)
    loose = simulate(tasks(False))
    assert (loose[3].start, loose[3].end) == (1, 2) and (loose[4].start, loose[4].end) == (2, 3)


def test_a_whole_call_turn_pays_one_switch_per_step():
    # Collocated, env and rollout in processes of their own: the env takes no turns, the
    # rollout holds device 0 for its whole call, the trainer takes it after. By hand (env 1,
    # rollout 1, two rollout steps, train 2, switch 0.5): step 1: env 6.5-7.5, rollout
    # 7.5-9 (switch), env 9-10, rollout 10-11 (kept: no switch), train 11-13.5: 7 s a step.
    shape = Shape(chain=("env", "rollout"), trainer="t", items=1, chunks=1, repeats=2, receivers=("rollout",),
                  whole_turns=("env", "rollout"))
    dev = frozenset([0])
    layout = Layout({"env": "env", "rollout": "rollout", "t": "t"}, {"env": dev, "rollout": dev, "t": dev},
                    {"env": False, "rollout": True, "t": True})
    cost = table_cost({("env", "work"): 1.0, ("rollout", "work"): 1.0, ("t", "train"): 2.0})
    tasks = step_tasks(shape, layout, cost, steps=2)
    assert [t.keep for t in tasks if t.process == "rollout" and t.step == 0] == [True, False]
    spans = simulate(tasks, {"rollout": 0.5, "t": 0.5})
    step1 = [(s.name, s.start, s.end) for s in spans if s.step == 1 and s.end > s.start]
    assert step1 == [("env[1.0.0]", 6.5, 7.5), ("rollout[1.0.0]", 7.5, 9.0), ("env[1.1.0]", 9.0, 10.0),
                     ("rollout[1.1.0]", 10.0, 11.0), ("t[1]", 11.0, 13.5)]


@pytest.mark.parametrize("first_out, expected", [(0.0, 5.0), (0.5, 6.5), (1.0, 8.0)])
def test_a_generator_releases_its_first_chunk_after_first_out_of_its_work(first_out, expected):
    # g makes 4 chunks in 4 s on its own device; t trains each (1 s) as it comes.
    # first_out 0 (spread evenly): chunks at 1, 2, 3, 4; t 1-2, ..., 4-5.
    # 0.5 (two waves): at 2.5, 3, 3.5, 4; t 2.5-3.5, 3.5-4.5, 4.5-5.5, 5.5-6.5.
    # 1 (one wave: every group at the end): all at 4; t 4-8.
    shape = Shape(chain=("g",), trainer="t", items=4, chunks=4, trainer_streams=True, batched=("g",),
                  first_out=first_out)
    layout = Layout({"g": "g", "t": "t"}, {"g": frozenset([0]), "t": frozenset([1])}, {"g": False, "t": False})
    cost = table_cost({("g", "work"): 1.0, ("t", "train"): 1.0})
    assert predict(shape, layout, cost, steps=1).step_s == pytest.approx(expected)


def test_trainer_ranks_take_streamed_chunks_as_they_are_free():
    # Hybrid: the maker a holds device 0 for its whole stream (4 chunks, 1 s each); the trainer
    # has a rank on device 0 (beside a) and one on device 1, each chunk 3 s on a rank. Rank 1
    # takes chunk 0 at 1 (4); rank 0 waits for a's turn to end at 4, then takes chunk 1 while
    # rank 1 takes chunk 2 (both 4-7); chunk 3 goes to the first free, rank 0 (7-10); then
    # both update together (1 s, all the trainer's devices): 10-11.
    shape = Shape(chain=("a",), trainer="t", items=4, chunks=4, receivers=("a",), trainer_streams=True,
                  whole_turns=("a",))
    d0, d1 = frozenset([0]), frozenset([1])
    layout = Layout({"a": "a", "t": "t"}, {"a": d0, "t": d0 | d1}, {"a": True, "t": True}, ranks={"t": (d0, d1)})
    cost = table_cost({("a", "work"): 1.0, ("t", "train"): 3.0, ("t", "update"): 0.25})
    spans = simulate(step_tasks(shape, layout, cost, steps=1))
    train = [(s.name, s.process, s.start, s.end) for s in spans if s.kind == "train"]
    assert train == [("t[0.0]", "t#1", 1, 4), ("t[0.1]", "t#0", 4, 7), ("t[0.2]", "t#1", 4, 7),
                     ("t[0.3]", "t#0", 7, 10), ("t.update[0]", "t", 10, 11)]
    # One rank over both devices (3 s a chunk too) waits for a's turn and trains the 4 in turn: 16 s.
    one = dataclasses.replace(layout, ranks=None)
    spans = simulate(step_tasks(shape, one, cost, steps=1))
    assert max(s.end for s in spans) == 4 + 4 * 3 + 1


def test_contention_slows_a_task_while_another_process_computes_beside_it():
    # a and b, 10 s alone each, start together; a works at 1/1.5 while b runs (b unslowed):
    # b ends at 10, a has done 10/1.5 of its 10 s and does the rest alone, ending at 13.33.
    tasks = [Task("a", "a", "a", 10.0), Task("b", "b", "b", 10.0)]
    spans = simulate(tasks, contention={"a": 0.5})
    assert spans_of(spans, "a") == [(0, pytest.approx(10 + 10 / 3))]
    assert spans_of(spans, "b") == [(0, 10)]
    # Both slowed by 25%: both at 0.8 for the 5 s b needs at that pace (4 s of work), then a
    # alone for its 6 s left: b 0-5, a 0-11.
    tasks = [Task("a", "a", "a", 10.0), Task("b", "b", "b", 4.0)]
    spans = simulate(tasks, contention={"a": 0.25, "b": 0.25})
    assert spans_of(spans, "b") == [(0, pytest.approx(5))]
    assert spans_of(spans, "a") == [(0, pytest.approx(11))]


def test_contention_leaves_tasks_that_run_alone_or_in_one_process_as_they_are():
    # a0 then a1 in one process, b after a0 (1 s) on its own; b's 2 s overlap a1 (3 s): a is
    # slowed by half for as long as b runs beside it, b nothing (no contention of its own).
    tasks = [Task("a0", "a", "a", 1.0), Task("a1", "a", "a", 3.0, deps=(0,)), Task("b", "b", "b", 2.0, deps=(0,))]
    spans = simulate(tasks, contention={"a": 1.0})
    assert spans_of(spans, "a") == [(0, 1), (1, pytest.approx(5))]  # 1 s of work in 1-3, the 2 s left in 3-5
    assert spans_of(spans, "b") == [(1, 3)]
    # With none, or contention of 0, the timeline is the one without.
    assert simulate(tasks, contention={"a": 0.0}) == simulate(tasks)


def test_contention_slows_a_split_step_run_ahead():
    # Rollout (4 s) and trainer (6 s) on processes of their own, one ahead: they overlap the
    # rollout's whole 4 s each step. The trainer 20% slower beside it: 4 s at 1/1.2 do 3.33 s
    # of its work, the 2.67 s left alone: 6.67 s a step.
    shape = Shape(chain=("r",), trainer="t", items=1, chunks=1, receivers=("r",))
    layout = Layout({"r": "r", "t": "t"}, {"r": frozenset([0]), "t": frozenset([1])}, {"r": False, "t": False})
    cost = table_cost({("r", "work"): 4.0, ("t", "train"): 6.0})
    assert predict(shape, layout, cost, run_ahead=1, steps=5).step_s == pytest.approx(6.0)
    p = predict(shape, layout, cost, run_ahead=1, steps=5, contention={"t": 0.2})
    assert p.step_s == pytest.approx(4 + (6 - 4 / 1.2))


def test_steps_that_vary_wait_on_a_stream_one_ahead_and_not_two():
    # Rollout 4 s a stream; the trainer 6 s on average, alternately 3 s and 9 s (its rows
    # forwarded vary); streams launched with weights taken in flight. One ahead, a 3 s update
    # leaves the next stream unmade. Worked out by hand: updates end at 7, 17, 20, 30, 33, 43,
    # 46: 13 s every two steps, 6.5 s a step where steps alike take 6 s. Two ahead, the stream
    # is made by then: 7, 17, 20, 29, 32, 41, 44, the trainer never waits after the fill.
    shape = Shape(chain=("r",), trainer="t", items=1, chunks=1, receivers=("r",), in_flight=True)
    layout = Layout({"r": "r", "t": "t"}, {"r": frozenset([0]), "t": frozenset([1])}, {"r": False, "t": False})
    cost = table_cost({("r", "work"): 4.0, ("t", "train"): 6.0})

    def ends(p):
        return [s.end for s in p.spans if s.kind == "train"][:7]

    one = predict(shape, layout, cost, run_ahead=1, steps=7, train_scale=[0.5, 1.5])
    assert ends(one) == pytest.approx([7, 17, 20, 30, 33, 43, 46]) and one.step_s == pytest.approx(6.5)
    assert predict(shape, layout, cost, run_ahead=1, steps=7).step_s == pytest.approx(6.0)
    two = predict(shape, layout, cost, run_ahead=2, steps=7, train_scale=[0.5, 1.5])
    assert ends(two) == pytest.approx([7, 17, 20, 29, 32, 41, 44]) and two.step_s == pytest.approx(37 / 6)
    # at least as many steps are timed as the scale has values
    assert len({s.step for s in predict(shape, layout, cost, train_scale=[1.0] * 9).spans}) == 9
