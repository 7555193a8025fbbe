"""The layers a confined child (campugrid.sandbox.confine) puts on itself before it touches
untrusted bytes: rlimits, then Landlock, then a seccomp filter (pyseccomp). Each is permanent
for the process; `apply` runs in the child only.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import resource
import signal
import socket
from pathlib import Path
from typing import Any

# Runtimes reserve address space they never write: the Go runtime inside the `dockerfile`
# parser reserves ~0.9 GiB at load. memory_mb bounds what the child can write (RLIMIT_DATA);
# RLIMIT_AS adds this much so that reservations still fit but shared mappings stay bounded.
ADDRESS_SPACE_SLACK_MB = 1024


def apply(*, memory_mb: int, cpu_s: int, fsize_mb: int, nofile: int, writable: list[Path],
          skip: set[str]) -> None:
    """rlimits, then Landlock, then seccomp: each of them is permanent for this process."""
    # Imported here: it runs ldconfig (a fork and exec), which the filter below forbids, and
    # the agent itself does not need libseccomp to import this module.
    import pyseccomp  # type: ignore[import-untyped]

    for path in writable:
        path.mkdir(parents=True, exist_ok=True)
    mib = 1024**2
    _set_rlimit(resource.RLIMIT_DATA, memory_mb * mib)
    _set_rlimit(resource.RLIMIT_AS, (memory_mb + ADDRESS_SPACE_SLACK_MB) * mib)
    # The soft limit sends SIGXCPU (a clear cause); the hard one a second later, SIGKILL, in
    # case the child blocks SIGXCPU.
    _set_rlimit(resource.RLIMIT_CPU, cpu_s + 1, soft=cpu_s)
    _set_rlimit(resource.RLIMIT_FSIZE, fsize_mb * mib)
    _set_rlimit(resource.RLIMIT_NOFILE, nofile)
    _set_rlimit(resource.RLIMIT_CORE, 0)
    # No RLIMIT_NPROC: it counts every process of the agent's user (podman, conmon, gVisor's
    # ~64 host tasks per sandbox), so no value both stops a fork bomb here and leaves the
    # agent working. The filter refuses new processes instead.
    # Python ignores SIGXFSZ (a write then fails with EFBIG, which a function may swallow);
    # the default action kills the child, so the parent sees which limit it was.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # Landlock needs it; seccomp sets it too
    if "landlock" not in skip:
        _landlock(writable)
    if "seccomp" not in skip:
        seccomp_filter(pyseccomp, os.getpid()).load()


def _set_rlimit(which: int, hard: int, soft: int | None = None) -> None:
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        hard = min(hard, current)  # an unprivileged process cannot raise its hard limit
    resource.setrlimit(which, (min(hard, soft if soft is not None else hard), hard))


# Killed outright: none of the confined operations needs them, and each is a way out of the
# process (ptrace, namespaces, mounts, exec), into another process (process_vm_*, pidfd_getfd),
# or into a large, often-attacked part of the kernel (bpf, keyrings, modules, io_uring, perf,
# userfaultfd). io_uring also matters because its operations bypass seccomp altogether.
KILLED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "pidfd_send_signal",
    "kcmp", "tkill", "process_madvise", "process_mrelease",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "execve", "execveat", "fork", "vfork",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "open_by_handle_at",
    "fanotify_init",
)
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                     0x40000000)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C  # typing into, or taking over, a terminal
_PR_SET_NO_NEW_PRIVS = 38


def seccomp_filter(sc: Any, pid: int) -> Any:
    """Default ALLOW, so Python and the parsers run unchanged; KILL_PROCESS (SIGSYS, which the
    parent reports as the filter) for the escapes above and for the cases below."""
    kill = sc.KILL_PROCESS
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, kill)  # i386 and x32 system calls would bypass the rules
    for name in KILLED_SYSCALLS:
        f.add_rule(kill, name)
    # Threads are allowed (the Go runtime in the Dockerfile parser starts some); a new process
    # (clone without CLONE_THREAD, i.e. fork) or a new namespace is not. The flags are
    # argument 0 on x86-64 and arm64.
    f.add_rule(kill, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    for flag in _CLONE_NAMESPACES:
        f.add_rule(kill, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, which seccomp cannot read: "not implemented" makes
    # glibc fall back to clone, which the rules above check.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # No network at all. socket(AF_UNIX) fails softly (EACCES) rather than killing, because
    # glibc probes nscd's socket when it looks up a user; it must fail because a connected
    # unix socket could reach the podman service of the agent's user. The pipes to the parent
    # were made before this filter.
    f.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    f.add_rule(kill, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    f.add_rule(kill, "socketpair", sc.Arg(0, sc.NE, socket.AF_UNIX))  # an AF_UNIX pair reaches no one
    # Signals and rlimits for this process only: not the agent, nor its sandboxes (same user).
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.add_rule(kill, name, sc.Arg(0, sc.NE, pid))
    f.add_rule(kill, "prlimit64", sc.Arg(0, sc.NE, 0))  # glibc's setrlimit passes pid 0
    for request in (_TIOCSTI, _TIOCLINUX):  # the request is 32-bit: compare only those bits
        f.add_rule(kill, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    return f


# Landlock (Linux 5.13+), through its three system calls: this process may write only under
# the `writable` folders. It also puts the child in a Landlock domain, which the kernel keeps
# from ptrace-ing, or opening /proc/PID/mem of, any process outside it: without Yama (absent on
# these VMs) that is otherwise allowed between processes of the same user, and would let a
# subverted child rewrite the agent. Reads stay unrestricted.
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_RULE_PATH_BENEATH = 1
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE_ANY = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
_NET_TCP = 0b11  # bind, connect (ABI 4)
_SCOPE_ALL = 0b11  # abstract unix sockets, signals (ABI 6)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 if it has none."""
    version = _libc().syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                              ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(version), 0)


def _landlock(writable: list[Path]) -> None:
    abi = landlock_abi()
    if abi == 0:
        return  # reported by confine.layers(); the child still has its rlimits and filter
    fs = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_ANY
    fs |= (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    fs |= _IOCTL_DEV if abi >= 5 else 0
    attr = _RulesetAttr(fs, _NET_TCP if abi >= 4 else 0, _SCOPE_ALL if abi >= 6 else 0)
    libc = _libc()
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr),
                           ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    # Writing to /dev/null is harmless, and libraries open it to silence output.
    rules = [(path, fs) for path in writable] + [(Path(os.devnull), _WRITE_FILE)]
    try:
        for path, allowed in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(allowed, fd)
                if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH,
                                ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def libseccomp_present() -> bool:
    import ctypes.util

    return ctypes.util.find_library("seccomp") is not None
