"""The confined child: real seccomp, rlimits and Landlock on real child processes.

The functions the children run are the top-level helpers below (a child imports them by
name). Every forbidden call is also run with the filter left off, to show that it is the
filter, not the call itself, that kills the child.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import json
import os
import signal
import socket
import tarfile
import threading
import time
from pathlib import Path

import pytest

from campugrid.buildpolicy.tarballs import extract_files
from campugrid.protocol.errors import BuildFailed, CampugridError, InvalidInput, SandboxError
from campugrid.sandbox import confine, hardening
from campugrid.sandbox.confine import ConfinementError, Limits

# --- what the children run -------------------------------------------------------------------


def add(a: int, b: int) -> int:
    return a + b


def refuse(message: str) -> None:
    raise InvalidInput(message)


def fail_build() -> None:
    raise BuildFailed("RUN step 2 failed", "log tail")


def blow_up() -> None:
    raise ValueError("an unexpected bug")


@dataclasses.dataclass(frozen=True)
class Part:
    line: int
    digest: str | None


@dataclasses.dataclass(frozen=True)
class Info:
    members: int
    name: str
    parts: tuple[Part, ...] = ()


def make_info(n: int) -> Info:
    return Info(members=n, name=f"n{n}", parts=tuple(Part(i, None if i else "sha") for i in range(n)))


def make_pair() -> tuple[int, str]:
    return (1, "one")


def claims_int() -> int:
    return json.loads('"not an int, whatever the annotation says"')


def chatty() -> str:
    print("this goes to stderr, not into the answer")
    return "answer"


def my_pid() -> int:
    return os.getpid()


def syscall(name: str, *args: int) -> list[int]:
    """The raw system call, by name (resolved for this machine's architecture): [result, errno]."""
    import pyseccomp

    libc = ctypes.CDLL(None, use_errno=True)
    nr = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
    result = libc.syscall(nr, *(ctypes.c_long(a) for a in args))
    return [result, ctypes.get_errno()]


def fork_and_wait() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def inet_socket() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return f"got an AF_INET socket, fd {s.fileno()}"


def unix_socket() -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM):
        return "got an AF_UNIX socket"


def run_in_thread() -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append("from a thread"))
    t.start()
    t.join()
    return out[0]


def parse_dockerfile(text: str) -> list[str]:
    import dockerfile  # BuildKit's Go parser: the Go runtime starts threads, reserves memory

    return [c.cmd for c in dockerfile.parse_string(text)]


def allocate(mb: int) -> int:
    return len(bytearray(mb * 1024**2))


def write_file(path: str, mb: int) -> int:
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(b"\0" * 1024**2)
    return mb


def spin() -> None:
    while True:
        pass


def open_many(folder: str, n: int) -> int:
    files = [open(os.path.join(folder, str(i)), "wb") for i in range(n)]  # noqa: SIM115
    return len(files)


def read_parent_memory() -> int:
    fd = os.open(f"/proc/{os.getppid()}/mem", os.O_RDONLY)
    os.close(fd)
    return fd


def signal_self() -> str:
    os.kill(os.getpid(), 0)
    return "signalled itself"


def environment() -> dict[str, str]:
    return dict(os.environ)


def busy_for(seconds: float) -> float:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return seconds


def raise_signal(sig: int) -> None:
    signal.raise_signal(sig)


def long_answer(n: int) -> str:
    return "x" * n


# --- the round trip --------------------------------------------------------------------------


def test_return_value_comes_back():
    assert confine.call(add, 2, 3) == 5


def test_the_return_value_is_rebuilt_by_its_annotation():
    info = confine.call(make_info, 3)
    assert info == Info(members=3, name="n3", parts=(Part(0, "sha"), Part(1, None), Part(2, None)))
    assert isinstance(info.parts[1], Part)
    assert confine.call(make_pair) == (1, "one")


def test_an_answer_that_does_not_fit_the_annotation_is_refused():
    with pytest.raises(ConfinementError, match="does not fit its return type") as e:
        confine.call(claims_int)
    assert e.value.cause == "protocol"


def test_invalid_input_keeps_its_type_and_message():
    with pytest.raises(InvalidInput, match=r"^context: no Dockerfile$"):
        confine.call(refuse, "context: no Dockerfile")


def test_other_campugrid_errors_keep_their_type():
    with pytest.raises(BuildFailed, match="RUN step 2 failed"):
        confine.call(fail_build)


def test_an_unexpected_exception_becomes_a_sandbox_error_naming_it():
    with pytest.raises(ConfinementError, match=r"blow_up failed .* builtins\.ValueError: an unexpected bug") as e:
        confine.call(blow_up)
    assert e.value.cause == "exception"
    assert isinstance(e.value, SandboxError) and isinstance(e.value, CampugridError)


def test_print_in_the_function_does_not_corrupt_the_answer():
    assert confine.call(chatty) == "answer"


def test_the_function_runs_in_another_process():
    assert confine.call(my_pid) != os.getpid()


def test_functions_that_a_child_cannot_import_are_refused_here():
    with pytest.raises(ValueError, match="top-level function"):
        confine.call(lambda: 1)


def test_a_real_checkpoint_unpacks_and_a_damaged_one_is_invalid_input(tmp_path: Path):
    archive = tmp_path / "ckpt.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("a.txt", "sub/b.txt"):
            data = name.encode()
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    dest = tmp_path / "out"
    assert confine.call(extract_files, archive, dest, writable=[dest]) == 2
    assert (dest / "sub/b.txt").read_text() == "sub/b.txt"
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(InvalidInput, match="not a tar archive"):
        confine.call(extract_files, bad, tmp_path / "out2", writable=[tmp_path / "out2"])


# --- the seccomp filter ----------------------------------------------------------------------

# Each forbidden call with arguments that do nothing harmful when the call is let through
# (NULL pointers, bad descriptors, the parent as a target of read-only or null operations).
PARENT = os.getpid()
FORBIDDEN = {
    "ptrace": ("ptrace", 16, 0x7FFFFFFF, 0, 0),  # PTRACE_ATTACH to no such process
    "process_vm_readv": ("process_vm_readv", PARENT, 0, 0, 0, 0, 0),
    "mount": ("mount", 0, 0, 0, 0, 0),
    "umount2": ("umount2", 0, 0),
    "pivot_root": ("pivot_root", 0, 0),
    "chroot": ("chroot", 0),
    "bpf": ("bpf", 0, 0, 0),
    "keyctl": ("keyctl", 0, 0, 0, 0, 0),
    "add_key": ("add_key", 0, 0, 0, 0, 0),
    "unshare": ("unshare", 0x10000000),  # CLONE_NEWUSER: harmless, it is only the child
    "setns": ("setns", -1, 0),
    # CLONE_NEWUSER with CLONE_THREAD: a combination the kernel refuses (EINVAL) if let through
    "clone(CLONE_NEWUSER)": ("clone", 0x10000000 | 0x00010000 | 0x00000800 | 0x00000100, 0, 0, 0, 0),
    "init_module": ("init_module", 0, 0, 0),
    "finit_module": ("finit_module", -1, 0, 0),
    "delete_module": ("delete_module", 0, 0),
    "kexec_load": ("kexec_load", 0, 0, 0, 0),
    "perf_event_open": ("perf_event_open", 0, 0, -1, -1, 0),
    "userfaultfd": ("userfaultfd", 0),
    "io_uring_setup": ("io_uring_setup", 1, 0),
    "execve": ("execve", 0, 0, 0),
    "socket(AF_INET)": ("socket", socket.AF_INET, socket.SOCK_STREAM, 0),
    "socket(AF_NETLINK)": ("socket", socket.AF_NETLINK, socket.SOCK_RAW, 0),
    "socket(AF_UNIX in the upper bits too)": ("socket", socket.AF_UNIX | (1 << 32), 1, 0),
    "socketpair(AF_INET)": ("socketpair", socket.AF_INET, socket.SOCK_STREAM, 0, 0),
    "kill(parent, 0)": ("kill", PARENT, 0),
    "prlimit64(parent)": ("prlimit64", PARENT, 7, 0, 0),  # read-only: new limit NULL
    "ioctl(TIOCSTI)": ("ioctl", 0, 0x5412, 0),
    "ioctl(TIOCSTI, upper bits set)": ("ioctl", 0, 0x5412 | (1 << 32), 0),
}


def _assert_killed_by_filter(e: ConfinementError) -> None:
    assert e.cause == "seccomp"
    assert "seccomp filter (SIGSYS)" in str(e)


@pytest.mark.parametrize("case", FORBIDDEN)
def test_the_filter_kills_a_forbidden_call(case: str):
    with pytest.raises(ConfinementError) as e:
        confine.call(syscall, *FORBIDDEN[case])
    _assert_killed_by_filter(e.value)


def test_without_the_filter_the_same_calls_return():
    """The control: each call above answers (success or an errno) when the filter is off."""
    with confine.Worker(_skip={"seccomp"}) as worker:
        assert worker.call(fork_and_wait) == 7
        assert worker.call(inet_socket).startswith("got an AF_INET socket")
        for case, (name, *args) in FORBIDDEN.items():
            result, _ = worker.call(syscall, name, *args)
            assert isinstance(result, int), case


def test_clone3_says_not_implemented_so_that_glibc_falls_back_to_clone():
    assert confine.call(syscall, "clone3", 0, 0) == [-1, errno.ENOSYS]
    assert confine.call(syscall, "clone3", 0, 0, _skip={"seccomp"})[1] != errno.ENOSYS


def test_the_filter_kills_fork():
    with pytest.raises(ConfinementError) as e:
        confine.call(fork_and_wait)
    _assert_killed_by_filter(e.value)


def test_the_filter_kills_a_python_level_inet_socket():
    with pytest.raises(ConfinementError) as e:
        confine.call(inet_socket)
    _assert_killed_by_filter(e.value)


def test_unix_sockets_fail_softly_rather_than_kill():
    # glibc's user lookups probe nscd's unix socket; they must fall back, not die.
    with pytest.raises(ConfinementError, match=r"PermissionError") as e:
        confine.call(unix_socket)
    assert e.value.cause == "exception"


def test_signals_to_itself_are_allowed():
    assert confine.call(signal_self) == "signalled itself"


def test_threads_still_work_under_the_filter():
    assert confine.call(run_in_thread) == "from a thread"


def test_the_go_dockerfile_parser_works_under_the_default_limits():
    assert confine.call(parse_dockerfile, "FROM x\nRUN echo hi\n") == ["FROM", "RUN"]


def test_every_listed_syscall_is_known_to_libseccomp():
    import pyseccomp

    for name in hardening.KILLED_SYSCALLS:
        assert pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) >= 0, name


# --- rlimits ---------------------------------------------------------------------------------


def test_too_much_memory_is_a_memory_error():
    with pytest.raises(ConfinementError, match=r"out of memory \(RLIMIT_DATA 256 MiB\)") as e:
        confine.call(allocate, 512, limits=Limits(memory_mb=256))
    assert e.value.cause == "memory"
    assert confine.call(allocate, 64, limits=Limits(memory_mb=256)) == 64 * 1024**2


def test_arguments_too_large_for_the_memory_limit_are_a_memory_error():
    with pytest.raises(ConfinementError, match=r"arguments in its memory limit") as e:
        confine.call(len, b"x" * 100 * 1024**2, limits=Limits(memory_mb=64))
    assert e.value.cause == "memory"


def test_a_file_over_fsize_kills_with_sigxfsz(tmp_path: Path):
    big = tmp_path / "big"
    with pytest.raises(ConfinementError, match=r"RLIMIT_FSIZE, 2 MiB: SIGXFSZ") as e:
        confine.call(write_file, str(big), 3, limits=Limits(fsize_mb=2), writable=[tmp_path])
    assert e.value.cause == "fsize"
    assert big.stat().st_size == 2 * 1024**2
    assert confine.call(write_file, str(big), 1, limits=Limits(fsize_mb=2), writable=[tmp_path]) == 1


def test_cpu_time_is_limited():
    t0 = time.monotonic()
    with pytest.raises(ConfinementError, match=r"RLIMIT_CPU, 1 s: SIGXCPU") as e:
        confine.call(spin, limits=Limits(cpu_s=1))
    assert e.value.cause == "cpu"
    assert time.monotonic() - t0 < 10


def test_open_files_are_limited(tmp_path: Path):
    with pytest.raises(ConfinementError, match=r"RLIMIT_NOFILE 32") as e:
        confine.call(open_many, str(tmp_path), 64, limits=Limits(nofile=32), writable=[tmp_path])
    assert e.value.cause == "nofile"


def test_wall_time_is_limited():
    t0 = time.monotonic()
    with pytest.raises(ConfinementError, match=r"within 0.5 s") as e:
        confine.call(time.sleep, 30, limits=Limits(wall_s=0.5))
    assert e.value.cause == "wall_time"
    assert time.monotonic() - t0 < 5


def test_an_answer_over_the_size_limit_is_refused_unread():
    with pytest.raises(ConfinementError, match=r"over the 1000 allowed") as e:
        confine.call(long_answer, 5000, limits=Limits(max_result_bytes=1000))
    assert e.value.cause == "protocol"


# --- Landlock --------------------------------------------------------------------------------

@pytest.fixture
def landlock() -> None:
    if not confine.layers()["landlock"].startswith("enforced"):
        pytest.skip("this kernel has no Landlock")


def test_writes_outside_the_writable_folders_are_refused(landlock: None, tmp_path: Path):
    ok, other = tmp_path / "ok", tmp_path / "other"
    other.mkdir()
    assert confine.call(write_file, str(ok / "f"), 1, writable=[ok]) == 1
    with pytest.raises(ConfinementError, match="PermissionError"):
        confine.call(write_file, str(other / "f"), 1, writable=[ok])
    assert not (other / "f").exists()
    # The control: without Landlock the same write goes through.
    assert confine.call(write_file, str(other / "f"), 1, writable=[ok], _skip={"landlock"}) == 1


def test_the_child_cannot_open_its_parents_memory(landlock: None):
    # seccomp cannot see which file open() names; Landlock's domain keeps the child from
    # the agent's /proc/PID/mem (which, without Yama, a process of the same user may open).
    with pytest.raises(ConfinementError, match="PermissionError"):
        confine.call(read_parent_memory)
    assert confine.call(read_parent_memory, _skip={"landlock"}) >= 0


# --- a Worker: one child, many calls ---------------------------------------------------------


def test_a_worker_serves_many_calls_from_one_child():
    with confine.Worker() as worker:
        pids = {worker.call(my_pid) for _ in range(20)}
        assert len(pids) == 1
        t0 = time.perf_counter()
        for i in range(200):
            assert worker.call(add, i, 1) == i + 1
        per_call = (time.perf_counter() - t0) / 200
    assert per_call < 0.025  # measured ~0.2 ms; the bound only catches a child per call


def test_a_worker_survives_a_killed_call_with_a_fresh_child():
    with confine.Worker() as worker:
        first = worker.call(my_pid)
        with pytest.raises(ConfinementError) as e:
            worker.call(inet_socket)
        _assert_killed_by_filter(e.value)
        with pytest.raises(InvalidInput):
            worker.call(refuse, "bad shard")
        second = worker.call(my_pid)
        assert second != first
        assert worker.call(my_pid) == second  # an exception does not cost the child


def test_a_worker_replaces_a_child_that_used_half_its_cpu():
    with confine.Worker(Limits(cpu_s=2)) as worker:
        first = worker.call(my_pid)
        assert worker.call(busy_for, 1.2) == 1.2  # within its 2 s, but over half
        assert worker.call(my_pid) != first


def test_the_child_gets_none_of_the_agents_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CAMPUGRID_SECRET_FOR_TEST", "s3cret")
    assert "CAMPUGRID_SECRET_FOR_TEST" not in confine.call(environment)


def test_other_signals_are_named():
    with pytest.raises(ConfinementError, match="killed by SIGSEGV") as e:
        confine.call(raise_signal, signal.SIGSEGV)
    assert e.value.cause == "crash"
