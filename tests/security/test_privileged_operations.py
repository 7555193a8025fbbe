"""A job's privileged operations, each refused by gVisor's own kernel, `--cap-drop all` and
`no-new-privileges` (tests/security/jobs.py's PRIVILEGED; the rest of what a hostile job tries
is test_hostile_jobs.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.security import jobs
from tests.security.conftest import brief, result_of, run_python

pytestmark = [pytest.mark.acceptance, pytest.mark.usefixtures("serves_a_job_at_the_end")]


EXPECTED_REFUSAL = {  # as runsc 20240729 answers, as 20221219 did (EPERM: no capability; others: absent)
    "raw-socket": {"EPERM"}, "packet-socket": {"EPERM"}, "ptrace-pid-1": {"EPERM"},
    "ptrace-the-agent": {"ESRCH", "EPERM"}, "mount-tmpfs": {"EPERM"},
    "remount-root-writable": {"EPERM", "EROFS"},
    "write-core-pattern": {"EACCES", "ENOENT", "EPERM", "EROFS"},
    "write-any-proc-sys-file": {"EACCES"}, "sysrq-trigger": {"EACCES", "ENOENT", "EPERM"},
    "init-module": {"EPERM", "ENOSYS"}, "bpf": {"EPERM", "ENOSYS"},
    "open-by-handle-at": {"EPERM", "ENOTSUP", "EOPNOTSUPP", "ENOSYS"},
    "mknod-host-disk": {"ENXIO", "EPERM", "ENODEV"}, "mknod-dev-mem": {"ENXIO", "EPERM", "ENODEV"},
    "setuid-other": {"EPERM"}, "capset-sys-admin": {"EPERM"},
}
# What the sandbox's root may do to gVisor's own kernel, which is not the host's: write its
# /proc/sys (each value written back as it was) and its sysrq-trigger. The host's settings
# are asserted unchanged below.
SANDBOX_OWN = ("write-any-proc-sys-file", "sysrq-trigger")
HOST_SYSCTLS = ("kernel/core_pattern", "kernel/hostname", "vm/overcommit_memory",
                "net/ipv4/ip_forward", "kernel/sysrq")


def host_sysrq_lines() -> list[str] | None:
    """The host kernel's log lines about sysrq (None: a log this user may not read)."""
    out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        return None
    return [line for line in out.stdout.splitlines() if "sysrq" in line.lower()]


def loaded_modules() -> str | None:
    """The host kernel's modules (None: a kernel without module support, as on Firecracker)."""
    modules = Path("/proc/modules")
    return modules.read_text() if modules.exists() else None


def test_privileged_operations_are_refused(api, guard, agent):
    """Every privileged operation, one job: each attack runs in a process of its own (so one
    cannot spoil another) and is asserted on its own."""
    sysctls = {k: Path("/proc/sys", k).read_text() for k in HOST_SYSCTLS
               if Path("/proc/sys", k).exists()}
    modules = loaded_modules()
    sysrq = host_sysrq_lines()
    disk = os.stat(agent.state_dir).st_dev
    env = {"AGENT_PID": str(agent.pid()), "HOST_DISK": f"{os.major(disk)}:{os.minor(disk)}",
           "ATTACKS": json.dumps({a: jobs.privileged(a) for a in jobs.PRIVILEGED})}
    job = run_python(api, jobs.EACH_ATTACK, {"env": env})
    assert job["state"] == "succeeded", brief(job)
    got = result_of(job)
    assert set(got) == set(jobs.PRIVILEGED) == set(EXPECTED_REFUSAL)
    # All capabilities dropped, no-new-privileges, and gVisor's own kernel between the job and
    # the host's: an operation that needs privilege, or reaches for the host, is refused.
    allowed = {a: got[a] for a in got if got[a] not in EXPECTED_REFUSAL[a]
               and not (a in SANDBOX_OWN and got[a].startswith("ok"))}
    assert not allowed, f"not refused as expected: {allowed}"
    # The host's kernel settings and modules are as they were (a write that reached the
    # host's /proc/sys, or a loaded module, shows here).
    assert {k: Path("/proc/sys", k).read_text() for k in sysctls} == sysctls
    assert loaded_modules() == modules
    assert host_sysrq_lines() == sysrq  # a sysrq that reached the host's kernel logs a line
    assert "TracerPid:\t0" in Path(f"/proc/{agent.pid()}/status").read_text()
    guard.check(probe=False)
