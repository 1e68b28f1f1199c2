"""The ``python`` tool: runs the model's program in a sandbox and returns what it prints.

The mechanism is Linux namespaces through util-linux's ``unshare`` plus rlimits; ``jail.py``
sets it up inside. Per call, a fresh sandbox:

- network: a new network namespace, whose only interface (loopback) is down: every connect,
  to 127.0.0.1 too, fails;
- files: every mount read-only, the working directory a tmpfs of ``workdir_mb`` that goes
  with the sandbox; the program runs as an unprivileged user with no new privileges, so it
  cannot remount anything writable;
- processes: a new PID namespace (it sees only its own processes; when the program ends, or
  the wall clock runs out, the kernel kills everything left in it) and RLIMIT_NPROC;
- CPU time, address space, file size and open files: rlimits; wall clock: ``timeout``,
  after which the whole sandbox is killed;
- output: stdout and stderr together, read up to ``max_output_bytes``; past that the sandbox
  is stopped. The rollout cuts the text further to its ``max_tool_response_tokens``.

The programs run under this process's interpreter when the sandbox's user may run it, else
under ``python3`` on PATH (a virtual environment under a home directory of root's alone, say,
is closed to that user). When the tool is made, a probe program checks that a sandbox starts
and holds it in: without ``unshare``, where the kernel refuses namespaces, or where a write
outside the working directory goes through, the tool refuses to start (SandboxUnavailable,
one line): it never runs code unsandboxed."""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from m2flow.tools.base import BAD_ARGUMENTS, ToolError

TIMEOUT, KILLED, EXIT, OUTPUT_LIMIT, SANDBOX = "timeout", "killed", "exit", "output_limit", "sandbox"
JAIL = Path(__file__).with_name("jail.py")
UID_BASE = 2_000_000_000  # as root, a sandbox's program runs as UID_BASE + the sandbox's host pid
MAX_CODE_BYTES = 1 << 20
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_PROBE = ("import os\ntry:\n    open(os.path.join(os.path.dirname(os.getcwd()), 'm2flow-probe'), 'w')\n"
          "except OSError:\n    print('contained')\n")
_checked: dict[tuple[str, str, bool], str] = {}  # (unshare, interpreter, as root) -> '' or why not


class SandboxUnavailable(RuntimeError):
    """No sandbox mechanism here: the python tool will not start."""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _noted(text: str, note: str) -> str:
    """The program's output, then a note on how it ended."""
    return f"{text.rstrip()}\n{note}" if text.strip() else note


def _send(proc: subprocess.Popen, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # the sandbox did not start: what it printed says why
    try:
        proc.stdin.close()
    except BrokenPipeError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    """Kills the sandbox: ``unshare`` and its process group (the jail too, whose end kills
    everything in its PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class PythonSandbox:
    """A tool that runs Python programs, each in a sandbox of its own (module docstring)."""

    name = "python"

    def __init__(self, timeout: float = 10.0, cpu_seconds: int | None = None, memory_mb: int = 1024,
                 processes: int = 32, file_mb: int = 16, workdir_mb: int = 64, open_files: int = 256,
                 max_output_bytes: int = 65536, interpreter: str | None = None, unshare: str = "unshare",
                 scratch: str = "/tmp"):
        self.timeout = timeout
        self.scratch = scratch  # where the working directories' mount points are made: any user may enter it
        self.limits = {"cpu_seconds": cpu_seconds or max(1, math.ceil(timeout)), "memory_bytes": memory_mb << 20,
                       "processes": processes, "file_bytes": file_mb << 20, "open_files": open_files}
        self.workdir_bytes = workdir_mb << 20
        self.max_output_bytes = max_output_bytes
        found = shutil.which(unshare)
        if found is None:
            raise SandboxUnavailable(f"python tool: no sandbox mechanism: {unshare!r} (util-linux) is not found, "
                                     "and the tool never runs code unsandboxed")
        self.unshare = found
        self.interpreter = self._choose(interpreter)

    def __repr__(self) -> str:
        return f"PythonSandbox(unshare={self.unshare!r}, interpreter={self.interpreter!r})"

    def call(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it prints (stdout and stderr). It
        has no network, can write only in its working directory, and runs under limits on
        time, memory and processes. Nothing is kept from one call to the next.

        Args:
            code: The whole program, e.g. "print(sum(range(10)))". Print what you want to see.
        """
        output, ended = self.run(code)
        return self._verdict(output, ended)

    # -- one run ---------------------------------------------------------------------------
    @property
    def as_root(self) -> bool:
        return os.geteuid() == 0

    def command(self) -> list[str]:
        user = [] if self.as_root else ["--user", "--map-root-user"]
        return [self.unshare, *user, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                "--mount-proc", sys.executable, "-I", "-S", str(JAIL)]

    def run(self, code: str, interpreter: str | None = None) -> tuple[bytes, dict]:
        """``(output, how it ended)``: the program's first ``max_output_bytes`` of output, and
        ``{"exit": n}``, ``{"signal": n}``, ``{"timeout": True}``, ``{"output_limit": True}``
        or ``{"setup_error": why}``."""
        source = code.encode("utf-8", errors="replace")
        if len(source) > MAX_CODE_BYTES:
            raise ToolError(BAD_ARGUMENTS, f"the program is longer than {MAX_CODE_BYTES} bytes")
        workdir = tempfile.mkdtemp(prefix="m2flow-python-", dir=self.scratch)
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, pass_fds=(status_w,), start_new_session=True,
                                    cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        except OSError as e:
            os.close(status_r)
            os.close(status_w)
            shutil.rmtree(workdir, ignore_errors=True)
            return b"", {"setup_error": f"cannot start {self.unshare}: {e}"}
        os.close(status_w)
        deadline = time.monotonic() + self.timeout
        try:
            config = {"workdir": workdir, "uid": UID_BASE + proc.pid if self.as_root else 1000,
                      "userns": not self.as_root, "interpreter": interpreter or self.interpreter,
                      "script": "main.py", "limits": self.limits, "workdir_bytes": self.workdir_bytes,
                      "path": SYSTEM_PATH, "status_fd": status_w}
            _send(proc, json.dumps(config).encode() + b"\n" + source)
            output, ended = self._read(proc, deadline)
            if ended:
                _kill(proc)
                self._read(proc, time.monotonic() + 2.0)  # until the killed sandbox's output closes
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # it closed its output and ran on
                _kill(proc)
                ended = {"timeout": True}
            status = ended or self._status(status_r) or {"setup_error": f"the sandbox ended ({proc.returncode})"}
            return bytes(output), status
        finally:
            if proc.poll() is None:
                _kill(proc)
            proc.stdout.close()
            os.close(status_r)
            shutil.rmtree(workdir, ignore_errors=True)

    def _read(self, proc: subprocess.Popen, deadline: float) -> tuple[bytearray, dict]:
        """The output until it closes (``{}``), the deadline (``{"timeout": True}``) or the
        byte limit (``{"output_limit": True}``): never more than ``max_output_bytes`` kept."""
        out = bytearray()
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if not selector.select(left):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    return out, {}
                out += chunk
                if len(out) > self.max_output_bytes:
                    del out[self.max_output_bytes:]
                    return out, {"output_limit": True}
        return out, {"timeout": True}

    @staticmethod
    def _status(status_r: int) -> dict:
        os.set_blocking(status_r, False)
        try:
            line = os.read(status_r, 65536)
        except BlockingIOError:
            return {}
        return json.loads(line) if line.strip() else {}

    def _verdict(self, output: bytes, ended: dict) -> str:
        """The observation: what the program printed, or a ToolError saying how it failed."""
        text = output.decode("utf-8", errors="replace")
        if "setup_error" in ended:
            raise ToolError(SANDBOX, _noted(text, f"[the sandbox failed to start: {ended['setup_error']}]"))
        if ended.get("timeout"):
            raise ToolError(TIMEOUT, _noted(text, f"[stopped: past the {self.timeout:g} s wall-clock limit]"))
        if ended.get("output_limit"):
            raise ToolError(OUTPUT_LIMIT, _noted(text, f"[stopped: more than {self.max_output_bytes} bytes of output]"))
        if "signal" in ended:
            why = {signal.SIGXCPU: f": the {self.limits['cpu_seconds']} s CPU-time limit",
                   signal.SIGXFSZ: f": the {self.limits['file_bytes'] >> 20} MB file-size limit"}
            raise ToolError(KILLED, _noted(text, f"[killed by {_signal_name(ended['signal'])}"
                                                 f"{why.get(ended['signal'], '')}]"))
        if ended.get("exit"):
            raise ToolError(EXIT, _noted(text, f"[exit status {ended['exit']}]"))
        return text if text else "(no output)"

    # -- is there a sandbox here? ----------------------------------------------------------
    def _choose(self, interpreter: str | None) -> str:
        """The interpreter the programs run under: ``interpreter``, else the first of this
        process's and ``python3`` on PATH that a sandbox starts and contains (checked once per
        process). SandboxUnavailable, one line, when none does."""
        candidates = [interpreter] if interpreter else list(dict.fromkeys(filter(None, (
            sys.executable, shutil.which("python3"), shutil.which("python3", path=SYSTEM_PATH)))))
        failed = {}
        for candidate in candidates:
            key = (self.unshare, candidate, self.as_root)
            if key not in _checked:
                _checked[key] = self._probe(candidate)
            if not _checked[key]:
                return candidate
            failed[candidate] = _checked[key]
        why = (next(iter(failed.values())) if len(set(failed.values())) == 1
               else "; ".join(f"{candidate}: {why}" for candidate, why in failed.items()))
        raise SandboxUnavailable(f"python tool: no working sandbox here ({self.unshare}): {why}")

    def _probe(self, interpreter: str) -> str:
        """'' when a sandbox runs ``interpreter`` and holds it in, else why not (one line)."""
        output, ended = self.run(_PROBE, interpreter)
        text = output.decode("utf-8", errors="replace").strip()
        if ended == {"exit": 0} and text == "contained":
            return ""
        if ended == {"exit": 0}:
            return "a write outside the working directory was not blocked"
        said = ": ".join(filter(None, [ended.get("setup_error"), text])) or json.dumps(ended)
        return " ".join(said.split())[:300]
