"""What a user runs first: the README example and `make run`'s demo, as subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, timeout=240):
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_readme_example(tmp_path):
    code = (ROOT / "README.md").read_text().split("```python\n")[1].split("```")[0]
    (tmp_path / "example.py").write_text(code)
    out = run(["example.py"], tmp_path)
    assert "devices disjoint" in out
    assert out.strip().splitlines()[-1] == "25 [None]"  # 100 puts x 64 samples = 25 batches of 256


@pytest.mark.slow  # 17 s; the runtime it shows runs by default in test_group.py, test_channel.py, test_comm.py
def test_runtime_demo_writes_a_trace(tmp_path):
    out = run(["-m", "m2flow.cli", "demo", "--out", str(tmp_path / "demo")], tmp_path)
    assert "devices overlapping" in out and "took 12288 rows" in out and "via shm" in out
    events = json.loads((tmp_path / "demo" / "trace.json").read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"driver", "producer:0", "consumer:0", "learner:0", "learner:1"} <= processes
    cats = {e.get("cat") for e in events if e.get("ph") == "X"}
    assert {"call", "send", "recv", "lock", "channel"} <= cats


@pytest.mark.slow  # 22 s; the command line's train runs by default in test_stop.py (an embodied preset)
def test_reasoning_tiny_preset_from_the_command_line(tmp_path):
    out = run(["-m", "m2flow.cli", "train", "reasoning/grpo_arith_tiny", "runner.steps=2", "runner.progress=false",
               f"runner.out_dir={tmp_path / 'run'}"], tmp_path)
    assert "grpo: steps 0-1" in out
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and len(rows) == 1 + 3  # the evaluation before step 1, then 2 steps
    assert (tmp_path / "run" / "checkpoints" / "step_000002.safetensors").is_file()
