import json
import os
import threading
import time

import pytest

from m2flow.runtime.trace import Tracer, get_tracer, set_process_name, write_chrome_trace


def spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X"]


def test_nested_spans_lie_inside_their_parent_and_keep_args():
    tracer = Tracer("test")
    with tracer.span("outer", cat="call", step=1) as args:
        with tracer.span("inner", cat="send", nbytes=10):
            time.sleep(0.002)
        args["tokens"] = 7
    inner, outer = spans(tracer.drain())  # a span is recorded when it ends
    assert (outer["name"], outer["cat"], outer["args"]) == ("outer", "call", {"step": 1, "tokens": 7})
    assert (inner["name"], inner["cat"], inner["args"]) == ("inner", "send", {"nbytes": 10})
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert inner["dur"] >= 2000  # microseconds
    # The epoch clock (comparable across processes), not a per-boot monotonic one: the two differ by decades.
    assert abs(outer["ts"] / 1e6 - time.time()) < 86400


def test_span_that_raises_is_recorded_with_the_error():
    tracer = Tracer("test")
    with pytest.raises(ValueError):
        with tracer.span("boom"):
            raise ValueError
    (span,) = spans(tracer.drain())
    assert span["args"] == {"error": "ValueError"}


def test_record_converts_seconds_to_microseconds():
    tracer = Tracer("test")
    tracer.record("recv", 100.0, 100.5, cat="recv", peer="actor:0")
    (span,) = spans(tracer.drain())
    assert span["ts"] == pytest.approx(100e6) and span["dur"] == pytest.approx(0.5e6)
    assert span["cat"] == "recv" and span["args"] == {"peer": "actor:0"}


def test_threads_get_their_own_tid_and_name():
    tracer = Tracer("test")

    def work() -> None:
        for _ in range(100):
            with tracer.span("work"):
                pass

    threads = [threading.Thread(target=work, name=f"worker-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = tracer.drain()
    assert len(spans(events)) == 400
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == [f"worker-{i}" for i in range(4)]
    assert {e["tid"] for e in spans(events)} == set(names)


def test_drain_clears_and_metadata_names_the_process():
    tracer = Tracer("rollout:0")
    with tracer.span("a"):
        pass
    events = tracer.drain()
    (meta,) = [e for e in events if e["name"] == "process_name"]
    assert meta == {"name": "process_name", "ph": "M", "pid": os.getpid(), "tid": 0, "args": {"name": "rollout:0"}}
    assert all(e["pid"] == os.getpid() for e in events)
    assert tracer.drain() == []


def test_disabled_tracer_records_nothing_but_span_args_still_work():
    tracer = Tracer("test", enabled=False)
    with tracer.span("a") as args:
        args["x"] = 1
    tracer.record("b", 0.0, 1.0)
    assert tracer.drain() == []


def test_written_trace_loads_with_chrome_fields(tmp_path):
    tracer = Tracer("driver")
    with tracer.span("step", cat="call", n=3):
        pass
    path = write_chrome_trace(tmp_path / "deep" / "dir" / "trace.json", tracer.drain())
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    (span,) = spans(doc["traceEvents"])
    assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= span.keys()


def test_process_global_tracer():
    assert get_tracer() is get_tracer()
    set_process_name("tester")
    with get_tracer().span("x"):
        pass
    events = get_tracer().drain()
    assert any(e["name"] == "process_name" and e["args"]["name"] == "tester" for e in events)
