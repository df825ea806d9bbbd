"""The tool sandbox (entropy_openrlhf/tools/sandbox.py) against hostile code: each attack is contained and gives a
clear result, nothing reaches the host (a canary file outside stays as it was), and ordinary code works. Plus the
fail-closed gate and `--tools.sandbox none`.

No test ever targets an address off this machine: the network test listens on the host's own 127.0.0.1."""

import json
import os
import socket
import textwrap
import time
from pathlib import Path

import pytest

from entropy_openrlhf.tools import sandbox as sb
from entropy_openrlhf.tools.sandbox import SandboxUnavailableError, check_sandbox, run_python, sandbox_available

ROOT = Path(__file__).resolve().parents[2]
REASON = sandbox_available()
needs_bwrap = pytest.mark.skipif(REASON is not None, reason=f"the bwrap sandbox cannot start here: {REASON}")
LIMITS = {"timeout_s": 2.0, "memory_mb": 256}


def run(code: str, **kw):
    return run_python(textwrap.dedent(code), **{**LIMITS, **kw})


def host_processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.fixture()
def canary(tmp_path):
    path = tmp_path / "canary.txt"
    path.write_text("untouched")
    before = path.stat()
    yield path
    after = path.stat()
    assert path.read_text() == "untouched" and after.st_mtime_ns == before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary.txt"]  # nothing new beside it either


# ------------------------------------------------------------------------------------------ ordinary code


@needs_bwrap
def test_ordinary_code_stdout_stdin_exit_code_and_exceptions():
    r = run("import sys\nprint('hi', sum(range(10)))\nprint(sys.stdin.read().upper(), end='')", stdin="abc\n")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated) == ("hi 45\nABC\n", "", 0, False, False)
    assert r.ok
    r = run("import sys\nprint('partial')\nsys.exit(3)")
    assert (r.stdout, r.exit_code, r.ok) == ("partial\n", 3, False)
    r = run("def f():\n    return 1 / 0\nf()")
    assert r.exit_code == 1 and not r.timed_out
    assert "ZeroDivisionError: division by zero" in r.stderr and 'File "/sandbox/main.py", line 2' in r.stderr
    r = run("import math, json, fractions\nprint(json.dumps([math.comb(10, 3), str(fractions.Fraction(3, 6))]))")
    assert json.loads(r.stdout) == [120, "1/2"]
    r = run("import os\nopen('notes.txt', 'w').write('x' * 100)\nprint(os.getcwd(), os.path.getsize('notes.txt'))")
    assert r.stdout.split() == ["/work", "100"]  # the work dir is writable


# ------------------------------------------------------------------------------------------ hostile code


@needs_bwrap
def test_no_network_not_even_the_hosts_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        r = run(f"""
            import socket
            s = socket.socket()
            s.settimeout(1)
            try:
                s.connect(("127.0.0.1", {port}))
                print("connected")
            except OSError as e:
                print("refused", type(e).__name__)
            print([line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]])
        """)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came in
    assert r.stdout.splitlines() == ["refused ConnectionRefusedError", "['lo']"], r


@needs_bwrap
def test_writing_outside_the_work_dir_fails(canary):
    targets = [str(canary), str(canary.parent / "new.txt"), "/x", "/usr/x", "/etc/x", "/sandbox/main.py",
               str(ROOT / "planted.txt"), "/proc/sys/kernel/hostname", "/dev/x"]  # fmt: skip
    r = run(f"""
        import json
        out = {{}}
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                out[path] = "written"
            except OSError as e:
                out[path] = type(e).__name__
        print(json.dumps(out))
    """)
    assert r.exit_code == 0, r
    assert "written" not in json.loads(r.stdout).values(), r.stdout
    assert not (ROOT / "planted.txt").exists()


@needs_bwrap
def test_no_view_of_shadow_the_checkout_home_or_other_processes():
    secret_files = ["/etc/shadow", "/etc/passwd", str(ROOT / "README.md"), str(Path(__file__)), "/root", "/home"]
    r = run(f"""
        import os
        for path in {secret_files!r}:
            print(path, os.path.exists(path))
        print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        print("uid", os.getuid())
    """)
    lines = r.stdout.splitlines()
    assert lines[: len(secret_files)] == [f"{p} False" for p in secret_files], r
    assert lines[-2] == "pids [1, 2]"  # the sandbox's init and the code: no other process of the host
    assert lines[-1] == "uid 65534"


@needs_bwrap
def test_no_env_var_of_the_parent(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "canary-key-4417")
    monkeypatch.setenv("HF_TOKEN", "canary-token-4417")
    r = run("""
        import os, glob
        print(sorted(os.environ))
        for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
            try:
                print(open(path, "rb").read())
            except OSError:
                pass
    """)
    assert r.exit_code == 0 and "canary" not in r.stdout, r
    assert r.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PWD']"


@needs_bwrap
def test_a_fork_bomb_stops_at_the_process_limit():
    start = time.monotonic()
    r = run(
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        timeout_s=1.0,
        max_processes=16,
    )
    assert r.timed_out and r.exit_code == 137, r
    assert time.monotonic() - start < 1.0 + sb.KILL_WAIT_S
    assert host_processes_with(sb.CODE_PATH) == []  # every fork died with the sandbox
    assert run("print('still fine')").stdout == "still fine\n"


@needs_bwrap
def test_a_memory_bomb_gets_memory_error():
    r = run("x = []\nwhile True:\n    x.append(bytearray(8 << 20))", memory_mb=128)
    assert r.exit_code == 1 and not r.timed_out and r.stderr.strip().endswith("MemoryError"), r


@needs_bwrap
def test_an_infinite_loop_times_out():
    r = run("print('started', flush=True)\nwhile True:\n    pass", timeout_s=0.5)
    assert (r.timed_out, r.exit_code, r.stdout) == (True, 137, "started\n"), r
    assert 0.5 <= r.seconds < 0.5 + sb.KILL_WAIT_S


@needs_bwrap
def test_100_mb_of_output_is_cut_fast():
    start = time.monotonic()
    r = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))", max_output_bytes=1000)
    assert r.truncated and r.stdout == "x" * 1000 and r.exit_code == 137, r.exit_code
    assert time.monotonic() - start < 1.5


@needs_bwrap
def test_a_process_that_outlives_its_call_is_dead_afterwards():
    marker = "417.25"  # a sleep only this test starts: its length marks it in the host's process table
    r = run(f"""
        import os, subprocess
        if os.fork() == 0:  # a double-forked daemon in its own session
            os.setsid()
            if os.fork() == 0:
                subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
                os.execvp("sleep", ["sleep", "{marker}"])
            os._exit(0)
        os.wait()
        print("parent leaves")
    """)
    assert r.exit_code == 0 and r.stdout == "parent leaves\n", r
    assert host_processes_with(marker) == []
    r = run(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nwhile True:\n    pass", timeout_s=0.5)
    assert r.timed_out and host_processes_with(marker) == []  # the same when the call is killed


@needs_bwrap
def test_file_size_and_work_dir_are_limited():
    r = run("open('big', 'wb').write(b'x' * (20 << 20))", max_file_mb=4)
    assert r.exit_code != 0 and "File too large" in r.stderr, r
    r = run("for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))", max_file_mb=4, work_dir_mb=8)
    assert r.exit_code != 0 and "No space left on device" in r.stderr, r


@needs_bwrap
@pytest.mark.skipif(sb.seccomp_filter() is None, reason="no seccomp filter for this architecture")
def test_the_kernels_riskier_interfaces_are_refused_and_ordinary_ones_work():
    keyctl = sb._DENIED_SYSCALLS["keyctl"][0 if os.uname().machine == "x86_64" else 1]
    r = run(f"""
        import ctypes, errno, socket, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        print("keyctl", libc.syscall({keyctl}, 0, -3, 0), errno.errorcode[ctypes.get_errno()])  # session keyring
        try:
            socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
            print("netlink opened")
        except PermissionError:
            print("netlink EPERM")
        socket.socket().close()
        socket.socketpair()
        t = threading.Thread(target=print, args=("thread",))
        t.start()
        t.join()
        print(subprocess.run(["echo", "subprocess"], capture_output=True, text=True).stdout.strip())
        print(open("/proc/self/status").read().split("Seccomp:")[1].split()[0])
    """)
    assert r.stdout.splitlines() == ["keyctl -1 EPERM", "netlink EPERM", "thread", "subprocess", "2"], r


def test_the_seccomp_program_is_well_formed():
    for machine in ("x86_64", "aarch64"):
        program = sb.seccomp_filter(machine)
        assert program and len(program) % 8 == 0 and len(program) // 8 < 256
    assert sb.seccomp_filter("riscv64") is None


# ------------------------------------------------------------------------------------------ gate and none mode


def test_the_gate_fails_closed_with_the_reason(monkeypatch):
    monkeypatch.setattr(sb, "sandbox_available", lambda: "unprivileged user namespaces are off")
    with pytest.raises(SandboxUnavailableError, match="unprivileged user namespaces are off.*--tools.sandbox none"):
        check_sandbox("bwrap")
    warning = check_sandbox("none")
    assert "NO isolation" in warning and "--tools.sandbox none" in warning
    with pytest.raises(ValueError, match="bwrap | none"):
        check_sandbox("docker")


def test_a_bwrap_that_does_not_work_is_reported(monkeypatch):
    sandbox_available.cache_clear()
    monkeypatch.setattr(sb, "_bwrap_command", lambda: ("/bin/false", None))
    try:
        reason = sb.sandbox_available()
        assert reason is not None and reason.startswith("the sandbox probe failed"), reason
        with pytest.raises(SandboxUnavailableError, match="the sandbox probe failed"):
            check_sandbox("bwrap")
    finally:
        sandbox_available.cache_clear()


def test_none_mode_runs_a_plain_subprocess_with_limits_and_timeout(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_API_KEY", "canary-key-4417")
    r = run("import os, sys\nprint(sys.stdin.read(), 'WANDB_API_KEY' in os.environ)", sandbox="none", stdin="in")
    assert (r.stdout, r.exit_code) == ("in False\n", 0), r
    r = run("while True:\n    pass", sandbox="none", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 137
    r = run("x = []\nwhile True:\n    x.append(bytearray(8 << 20))", sandbox="none", memory_mb=128)
    assert r.exit_code == 1 and r.stderr.strip().endswith("MemoryError")
    r = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))", sandbox="none",
            max_output_bytes=10)  # fmt: skip
    assert r.truncated and r.stdout == "x" * 10
    # not isolated: it sees the host's files (which is why it needs --tools.sandbox none said out loud)
    (tmp_path / "visible.txt").write_text("seen")
    assert run(f"print(open({str(tmp_path / 'visible.txt')!r}).read())", sandbox="none").stdout == "seen\n"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="sandbox 'docker'"):
        run_python("", timeout_s=1, memory_mb=64, sandbox="docker")
    with pytest.raises(ValueError, match="must be > 0"):
        run_python("", timeout_s=0, memory_mb=64)


def test_the_tools_flags_validate_and_name_the_flag():
    from entropy_openrlhf.config import ConfigError, from_args, validate

    cfg = from_args(["--tools.sandbox", "none", "--tools.num_workers", "3", "--tools.post_tool_tokens", "8"])
    assert (cfg.tools.sandbox, cfg.tools.num_workers, cfg.tools.post_tool_tokens) == ("none", 3, 8)
    assert not cfg.uses_tools  # the default rollout function runs no tools, and reserves no tool workers
    with pytest.raises(ConfigError) as e:
        validate(from_args(["--tools.sandbox", "docker", "--tools.timeout_s", "0", "--tools.max_processes", "1"]))
    message = str(e.value)
    for flag in ("--tools.sandbox: 'docker': bwrap | none", "--tools.timeout_s", "--tools.max_processes"):
        assert flag in message


def test_a_tool_run_reserves_its_workers(monkeypatch):
    from entropy_openrlhf.cluster_fit import group_needs
    from entropy_openrlhf.config import Config
    from entropy_openrlhf.config.sections import tools
    from entropy_openrlhf.resources import group_resources

    cfg = Config()
    cfg.tools.num_workers, cfg.tools.num_cpus_per_worker = 3, 0.5
    assert "tools" not in group_resources(cfg)
    monkeypatch.setattr(tools, "TOOL_ROLLOUTS", (cfg.rollout.function,))
    monkeypatch.setattr("entropy_openrlhf.config.schema.TOOL_ROLLOUTS", (cfg.rollout.function,))
    assert group_resources(cfg)["tools"] == {"actors": 3, "GPU": 0.0, "CPU": 1.5}
    assert [g.bundle["CPU"] for g in group_needs(cfg) if g.name == "tools"] == [0.5]


def test_a_tool_run_refuses_to_start_without_the_sandbox(monkeypatch, capsys):
    from entropy_openrlhf.config import Config, ConfigError
    from entropy_openrlhf.pipeline import run as run_module

    cfg = Config()
    assert run_module.check_tools_sandbox(cfg) is None  # no tools: nothing checked
    monkeypatch.setattr("entropy_openrlhf.config.schema.TOOL_ROLLOUTS", (cfg.rollout.function,))
    monkeypatch.setattr(sb, "sandbox_available", lambda: "bwrap: setting up uid map: Permission denied")
    with pytest.raises(ConfigError, match="uid map: Permission denied.*--tools.sandbox none"):
        run_module.check_tools_sandbox(cfg)
    cfg.tools.sandbox = "none"
    assert "NO isolation" in run_module.check_tools_sandbox(cfg)
    assert "WARNING: --tools.sandbox none" in capsys.readouterr().err
