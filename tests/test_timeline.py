"""A run's trace read back: states of spans, waits taken off the calls they happen in."""

from m2flow.runners import timeline


def _meta(pid, name):
    return {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}


def _span(pid, tid, name, cat, start_s, dur_s):
    return {"name": name, "cat": cat, "ph": "X", "ts": start_s * 1e6, "dur": dur_s * 1e6, "pid": pid, "tid": tid}


EVENTS = [
    _meta(1, "env-ab12cd:0"), _meta(2, "actor-ab12cd:0"), _meta(3, "pytest"),
    # env: a 10 s call with a 2 s lock wait and a 1 s receive inside; a put waiting 0.5 s in
    # the channel's own thread (not inside the call)
    _span(1, 11, "env-ab12cd.interact", "call", 0, 10), _span(1, 11, "wait devices [0]", "lock", 1, 2),
    _span(1, 11, "recv rollout:0", "recv", 4, 1), _span(1, 12, "put trajectories", "channel", 9.5, 0.5),
    _span(1, 11, "hold devices [0]", "lock", 3, 7),  # a hold is no state of its own
    # actor: a 6 s call waiting 4 s for its data, then 1 s of onload; a 2 s weight push
    _span(2, 21, "actor-ab12cd.train", "call", 0, 6), _span(2, 21, "get trajectories", "channel", 0, 4),
    _span(2, 21, "onload_optimizer", "switch", 4, 1), _span(2, 21, "actor-ab12cd.push_weights", "call", 6, 2),
    _span(3, 31, "update 0", "update", 0, 8),  # the driver's
]


def test_seconds_by_state_takes_waits_off_their_calls():
    got = timeline.seconds_by_state(EVENTS)
    assert got["env-ab12cd:0"] == {"computing": 7.0, "syncing weights": 0.0, "waiting on channel": 0.5,
                                   "waiting on lock": 2.0, "waiting on message": 1.0, "switching": 0.0}
    assert got["actor-ab12cd:0"] == {"computing": 1.0, "syncing weights": 2.0, "waiting on channel": 4.0,
                                     "waiting on lock": 0.0, "waiting on message": 0.0, "switching": 1.0}
    assert "pytest" not in got
    window = timeline.seconds_by_state(EVENTS, 5e6, 8e6)  # the last 3 s: each span clipped to it
    assert window["actor-ab12cd:0"]["computing"] == 1.0 and window["actor-ab12cd:0"]["syncing weights"] == 2.0


def test_summary_per_component_and_a_picture(tmp_path):
    text = timeline.summary(EVENTS)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["component", "ranks", "computing"]
    actor = next(line for line in lines if line.startswith("actor ")).split()
    assert actor[1:4] == ["1", "1.00", "2.00"] and actor[-1] == "12%"  # 1 s of 8 computing
    assert timeline.component_of("rollout-ab12cd:3") == "rollout"
    png = timeline.render(EVENTS, tmp_path / "t.png", (0, 10e6), title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
