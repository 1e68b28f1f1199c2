"""The first program inside the python tool's sandbox: ``unshare`` starts it as PID 1 of new
mount, network, PID, IPC and UTS namespaces (and a user namespace when the caller is not
root), as ``python -I -S jail.py``. It

1. makes every mount read-only, recursively (``mount_setattr``, Linux 5.12 or later);
2. mounts a size-capped tmpfs on the working directory, the one place left to write;
3. runs the program there as its only child: no new privileges, an unprivileged user (a uid of
   its own when the caller is root; else a uid of a user namespace of its own, nested, so
   the program holds no capability over the mounts), under rlimits on CPU time, address
   space, processes, file size and open files, stdin from /dev/null;
4. reports how the program ended (one JSON line on ``status_fd``) and ends, which makes the
   kernel kill whatever the program left in the PID namespace.

Its config comes on stdin, one JSON line, followed by the program's source. Standard library
only, importing nothing of m2flow."""

import ctypes
import json
import os
import resource
import sys

AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 0x1
MS_NOSUID, MS_NODEV = 0x2, 0x4
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (asm-generic, since Linux 5.12)

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def set_read_only(path: str, read_only: bool = True, recursive: bool = True) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else MOUNT_ATTR_RDONLY, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                         ctypes.byref(attr), ctypes.sizeof(attr)), f"mount_setattr {path}")


def mount_tmpfs(path: str, options: str) -> None:
    _check(_libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()),
           f"mount tmpfs on {path}")


def become(uid: int, nested_userns: bool) -> None:
    """Drops to ``uid`` for good: with setresuid as the host's root; else (already the
    caller's own uid on the host) in a nested user namespace, mapped onto it."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    if nested_userns:
        _check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} 0 1"), ("gid_map", f"{uid} 0 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    else:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def limit(limits: dict) -> None:
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    for name, key in (("RLIMIT_AS", "memory_bytes"), ("RLIMIT_NPROC", "processes"),
                      ("RLIMIT_FSIZE", "file_bytes"), ("RLIMIT_NOFILE", "open_files")):
        resource.setrlimit(getattr(resource, name), (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def start(config: dict, failed_w: int) -> None:
    """In the child: becomes the program (or writes why it could not on ``failed_w``)."""
    try:
        workdir, uid = config["workdir"], config["uid"]
        become(uid, config["userns"])
        limit(config["limits"])
        os.chdir(workdir)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        env = {"PATH": config["path"], "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        interpreter = config["interpreter"]
        os.execve(interpreter, [interpreter, "-I", "-u", config["script"]], env)
    except BaseException as e:  # noqa: BLE001 -- any failure is reported, never raised past the fork
        os.write(failed_w, f"{type(e).__name__}: {e}".encode())
    finally:
        os._exit(127)


def main() -> int:
    header, _, source = sys.stdin.buffer.read().partition(b"\n")
    config = json.loads(header)
    status = os.fdopen(config["status_fd"], "w")
    os.set_inheritable(status.fileno(), False)

    def report(**fields) -> int:
        status.write(json.dumps(fields) + "\n")
        status.flush()
        return 0

    try:
        workdir, uid, userns = config["workdir"], config["uid"], config["userns"]
        set_read_only("/")
        if userns:  # the nested user namespace's maps are written to /proc/self
            set_read_only("/proc", read_only=False, recursive=False)
        owner = "" if userns else f",uid={uid},gid={uid}"
        mount_tmpfs(workdir, f"size={config['workdir_bytes']},mode=0700{owner}")
        script = os.path.join(workdir, config["script"])
        with open(script, "wb") as f:
            f.write(source)
        if not userns:
            os.chown(script, uid, uid)
        failed_r, failed_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            start(config, failed_w)
        os.close(failed_w)
        failed = os.read(failed_r, 4096)
    except OSError as e:
        return report(setup_error=str(e))
    if failed:
        os.waitpid(pid, 0)
        return report(setup_error=failed.decode(errors="replace"))
    while True:  # PID 1 reaps every orphan until the program itself ends
        reaped, wait_status = os.waitpid(-1, 0)
        if reaped == pid:
            if os.WIFSIGNALED(wait_status):
                return report(signal=os.WTERMSIG(wait_status))
            return report(exit=os.waitstatus_to_exitcode(wait_status))


if __name__ == "__main__":
    sys.exit(main())
