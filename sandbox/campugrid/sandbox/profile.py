"""The seccomp profile for what runs inside gVisor (jobs and RUN steps), applied by runsc
itself (`--oci-seccomp`): Podman's default profile, less the system calls no job needs and an
attacker wants first. gVisor already implements most of them inside its own kernel; the
profile makes them fail before they reach it, so a bug there is one step further away.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_PROFILE = Path("/usr/share/containers/seccomp.json")
# Namespaces, tracing, keys, BPF, io_uring, other processes' memory, mounts.
DENIED = frozenset({
    "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "mount", "umount", "umount2", "pivot_root", "open_by_handle_at", "fanotify_init",
})
RUNTIME_FLAGS = ("--runtime-flag", "oci-seccomp")


def write_profile(to: Path, base: Path = DEFAULT_PROFILE) -> Path | None:
    """The profile, written to `to` (0600); None where this host has no default profile to
    start from (then only gVisor's own checks apply, and the limits say so)."""
    try:
        profile = json.loads(base.read_text())
    except (OSError, ValueError):
        return None
    for rule in profile.get("syscalls", []):
        if rule.get("action") == "SCMP_ACT_ALLOW":
            rule["names"] = [n for n in rule.get("names", []) if n not in DENIED]
    profile["syscalls"] = [r for r in profile.get("syscalls", []) if r.get("names")]
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile))
    os.chmod(tmp, 0o600)
    tmp.replace(to)
    return to
