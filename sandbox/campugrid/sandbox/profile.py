"""The seccomp profile for what runs inside gVisor (jobs and RUN steps), applied by runsc
itself (`--oci-seccomp`): every call allowed except those no job needs and an attacker wants
first, which fail with EPERM before gVisor's own kernel sees them.

A deny list, not Podman's allow list: runsc 20221219 translated Podman's default profile
wrongly (`select(2)` failed with EPERM even under the unmodified default), and a deny list
names what is refused whatever the runsc.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Namespaces, tracing, keys, BPF, io_uring, other processes' memory, mounts.
DENIED = (
    "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "mount", "umount2", "pivot_root", "open_by_handle_at", "fanotify_init",
)
RUNTIME_FLAGS = ("--runtime-flag", "oci-seccomp")


def write_profile(to: Path) -> Path:
    """The profile, written to `to` (0600)."""
    profile = {"defaultAction": "SCMP_ACT_ALLOW",
               "syscalls": [{"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile))
    os.chmod(tmp, 0o600)
    tmp.replace(to)
    return to
