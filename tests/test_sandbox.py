"""The python tool's sandbox (m2flow/tools/python.py, jail.py; docs/tools.md), tried from
inside: a loopback connect, writes outside its working directory, a fork bomb, a memory hog,
an endless loop, megabytes of output, processes left behind; and its refusal to start where
there is no sandbox mechanism. Each run is bounded by a few seconds of wall clock."""

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from m2flow.tools import Toolbox, ToolCall, ToolError, load
from m2flow.tools.python import UID_BASE, PythonSandbox, SandboxUnavailable

ROOT = Path(__file__).resolve().parents[1]


def namespaces_refused() -> str:
    """Why this machine's kernel gives no namespaces to ``unshare`` ('' when it does): then the
    sandbox cannot work here, and these tests are skipped; anything else that stops it fails them."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux) here"
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    done = subprocess.run(["unshare", *user, "--mount", "--net", "--pid", "--fork", "true"], capture_output=True,
                          text=True, timeout=30)
    return "" if done.returncode == 0 else f"the kernel refuses namespaces: {done.stderr.strip()}"


pytestmark = pytest.mark.skipif(bool(namespaces_refused()), reason=namespaces_refused() or "-")


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(timeout=2.0, memory_mb=256, processes=16, max_output_bytes=4096)


def sandbox_processes() -> list[str]:
    """The host's processes that run as a sandbox's user (as root, each sandbox has its own)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if uid >= UID_BASE:
            found.append(status.parent.name)
    return found


def run(sandbox, code) -> tuple[str, str | None, float]:
    """``(observation, error kind or None, seconds)`` of one program."""
    started = time.monotonic()
    try:
        text, kind = sandbox.call(code), None
    except ToolError as e:
        text, kind = str(e), e.kind
    return text, kind, time.monotonic() - started


def test_prints_and_returns_output(sandbox):
    text, kind, took = run(sandbox, "import sys\nprint(sum(range(10)))\nprint('to stderr', file=sys.stderr)")
    assert (text, kind) == ("45\nto stderr\n", None) and took < 2
    text, kind, _ = run(sandbox, "pass")
    assert (text, kind) == ("(no output)", None)
    text, kind, _ = run(sandbox, "print('before')\n1 / 0")
    assert kind == "exit" and text.startswith("before\nTraceback") and "ZeroDivisionError" in text
    assert text.endswith("[exit status 1]")


def test_loopback_connect_fails():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the host reaches it
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\n"
                "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('connected')\n"
                "except OSError as e:\n    print('refused', e.errno)\n")
        text, kind, _ = run(PythonSandbox(timeout=3.0), code)
    import errno
    assert (text, kind) == (f"refused {errno.ENETUNREACH}\nrefused {errno.ENETUNREACH}\n", None)


def test_writes_outside_the_working_directory_fail(sandbox):
    name = f"m2flow-escape-{uuid.uuid4().hex}"
    outside = [Path("/tmp") / name, Path(os.environ["HOME"]) / name, Path("/dev/shm") / name, ROOT / name]
    code = ("import os\nfor path in %r:\n    try:\n        open(path, 'w').write('out')\n        print('wrote', path)\n"
            "    except OSError as e:\n        print('refused', e.strerror)\n"
            "open('inside.txt', 'w').write('in')\nprint(open('inside.txt').read(), os.getcwd().startswith('/tmp/'))\n"
            % [str(p) for p in outside])
    text, kind, _ = run(sandbox, code)
    lines = text.splitlines()
    assert kind is None and lines[-1] == "in True", text
    # read-only mounts; a $HOME in a directory that is root's alone is not even the program's to enter
    home_closed = not Path(os.environ["HOME"]).parent.stat().st_mode & 0o001
    home = "Permission denied" if home_closed else "Read-only file system"
    assert lines[:4] == [f"refused {why}" for why in ("Read-only file system", home, "Read-only file system",
                                                      "Read-only file system")], text
    assert not any(p.exists() for p in outside)
    # and nothing of the working directory stays behind on the host
    assert not list(Path("/tmp").glob("m2flow-python-*/inside.txt"))


def test_the_program_cannot_remount_anything_writable(sandbox):
    """Not in the sandbox's namespaces (it has no capability there), nor in a user and mount
    namespace of its own (the read-only mounts it inherits are locked)."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "def remount():\n    if libc.mount(None, b'/', None, 32 | 4096, None) == 0:  # MS_REMOUNT | MS_BIND\n"
            "        return 'remounted'\n    return os.strerror(ctypes.get_errno())\n"
            "print(remount())\nprint('own namespaces', libc.unshare(0x10000000 | 0x20000) == 0)\nprint(remount())\n"
            "try:\n    open('/tmp/m2flow-remount-escape', 'w')\nexcept OSError as e:\n    print(e.strerror)\n")
    text, kind, _ = run(sandbox, code)
    assert kind is None and text.splitlines() == ["Operation not permitted", "own namespaces True",
                                                  "Operation not permitted", "Read-only file system"], text
    assert not Path("/tmp/m2flow-remount-escape").exists()


def test_a_fork_bomb_is_contained(sandbox):
    counted = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
               "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('forks', n, e.strerror)\n")
    text, kind, took = run(sandbox, counted)
    assert kind is None and text == "forks 15 Resource temporarily unavailable\n", text  # 16 processes in all
    endless = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    text, kind, took = run(sandbox, endless)
    assert kind == "timeout" and took < 4.0
    assert _gone(sandbox_processes), sandbox_processes()
    assert subprocess.run(["true"]).returncode == 0  # the host forks as ever


def test_a_memory_hog_is_stopped(sandbox):
    text, kind, _ = run(sandbox, "x = bytearray(1 << 30)\nprint('got it')")
    assert kind == "exit" and "MemoryError" in text and "got it" not in text
    text, kind, took = run(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))")
    assert kind == "exit" and "MemoryError" in text and took < 3.0


def test_an_endless_loop_hits_the_timeout(sandbox):
    text, kind, took = run(sandbox, "print('looping', flush=True)\nwhile True:\n    pass")
    assert kind == "timeout" and 1.9 < took < 4.0
    assert text == "looping\n[stopped: past the 2 s wall-clock limit]"
    text, kind, _ = run(PythonSandbox(timeout=8.0, cpu_seconds=1), "while True:\n    pass")
    assert kind == "killed" and text == "[killed by SIGXCPU: the 1 s CPU-time limit]"


def test_megabytes_of_output_are_cut(sandbox):
    text, kind, took = run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert kind == "output_limit" and took < 1.5
    assert text == "x" * 4096 + "\n[stopped: more than 4096 bytes of output]"


def test_a_program_that_kills_itself_is_an_error(sandbox):
    text, kind, _ = run(sandbox, "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (text, kind) == ("bye\n[killed by SIGKILL]", "killed")


def test_nothing_is_left_running(sandbox):
    marker = str(7_000_000 + os.getpid() % 1_000_000)
    code = ("import os, subprocess\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
            f"        subprocess.Popen(['sleep', '{marker}'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,"
            " start_new_session=True)\n        os._exit(0)\nprint('detached')\n")
    text, kind, _ = run(sandbox, code)
    assert (text, kind) == ("detached\n", None)

    def sleepers():
        return [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker in _read(p)]

    assert _gone(sleepers), sleepers()
    assert _gone(sandbox_processes), sandbox_processes()


def test_the_tool_refuses_to_start_without_a_sandbox_mechanism(tmp_path):
    with pytest.raises(SandboxUnavailable) as missing:
        PythonSandbox(unshare=str(tmp_path / "no-unshare"))
    message = str(missing.value)
    assert "\n" not in message and message.startswith("python tool: no sandbox mechanism:")
    fake = tmp_path / "unshare"  # one that is there but sandboxes nothing
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as broken:
        PythonSandbox(unshare=str(fake))
    message = str(broken.value)
    assert "\n" not in message and "no working sandbox here" in message and "Operation not permitted" in message


def test_a_turn_of_python_calls_runs_through_the_toolbox():
    box = Toolbox([load("python", timeout=2.0, max_output_bytes=2048)])
    assert box.schemas[0]["function"]["name"] == "python"
    assert box.schemas[0]["function"]["parameters"]["required"] == ["code"]
    started = time.monotonic()
    ok, looping, loud = box.run([ToolCall("a", "python", {"code": "print(6 * 7)"}),
                                 ToolCall("b", "python", {"code": "while True: pass"}),
                                 ToolCall("c", "python", {"code": "print('y' * 10**6)"})], max_response_tokens=100)
    assert time.monotonic() - started < 4.0  # in parallel: one wall-clock limit, not three
    assert ok.ok and ok.text == "42\n"
    assert looping.error == "timeout" and loud.error == "output_limit" and loud.cut and len(loud.text) <= 400


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
                    reason="needs root, to run the tool as another user")
def test_a_caller_that_is_not_root_gets_a_user_namespace():
    """Not root, the sandbox is a user namespace (unshare --user) and the program a uid of a
    nested one: the same walls hold."""
    code = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom m2flow.tools.python import PythonSandbox\n"
            "sandbox = PythonSandbox(timeout=2.0, processes=8)\nassert not sandbox.as_root\n"
            "print(sandbox.call(sys.stdin.read()), end='')\n")
    program = ("import os, socket\nprint(os.getuid())\n"
               "try:\n    open('/tmp/m2flow-nobody-escape', 'w')\nexcept OSError as e:\n    print(e.strerror)\n"
               "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept OSError as e:\n"
               "    print(e.strerror)\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
               "            import time; time.sleep(30)\n        n += 1\nexcept OSError:\n    print('forks', n)\n")
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", code, str(ROOT)], input=program, user=65534, group=65534,
                          extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["1000", "Read-only file system", "Network is unreachable", "forks 7"]
    assert not Path("/tmp/m2flow-nobody-escape").exists()


def _read(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _gone(find, within: float = 2.0) -> bool:
    """Whether ``find()`` comes back empty within ``within`` seconds."""
    deadline = time.monotonic() + within
    while find():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
