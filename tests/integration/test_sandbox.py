"""The sandbox, for real: rootless Podman + runsc as the unprivileged provider user."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from campugrid.cli.platform import ProviderUser
from tests.support import hostile
from tests.support.provider import SYSCALLS, run_as_provider, sandbox_run
from tests.support.runtimes import gvisor_kernel

pytestmark = pytest.mark.integration

PROBE = r"""
import json, os, platform, socket, subprocess
def attempt(fn):
    try:
        fn(); return "ok"
    except OSError as e:
        return e.strerror or str(e)
def write(path):
    def f():
        with open(path, "w") as fh: fh.write("x")
    return f
def connect():
    socket.create_connection(("127.0.0.1", 22), timeout=2).close()
with open("/proc/net/dev") as f:
    ifaces = sorted(l.split(":")[0].strip() for l in f.readlines()[2:])
print(json.dumps({
  "kernel": platform.release(),
  "dmesg": subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()[:1],
  "uid": os.getuid(),
  "capabilities": [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff:")],
  "interfaces": ifaces,
  "connect_loopback": attempt(connect),
  "write_root": attempt(write("/etc/evil")),
  "write_tmp": attempt(write("/tmp/ok")),
  "write_output": attempt(write("/output/made-inside.txt")),
  "write_data": attempt(write("/data/evil")),
  "read_data": open("/data/input.txt").read(),
  "env": os.environ.get("GREETING"),
  "root_mount_options": [l.split()[3] for l in open("/proc/mounts") if l.split()[1] == "/"],
}))
"""


def prepared(shared_tmp: Path, provider: ProviderUser) -> tuple[Path, Path]:
    out, data = shared_tmp / "output", shared_tmp / "data"
    out.mkdir()
    data.mkdir()
    (data / "input.txt").write_text("dataset bytes")
    for d in (out, data):
        os.chown(d, provider.uid, provider.gid) if os.geteuid() == 0 else None
    return out, data


def test_the_job_runs_in_gvisor_offline_with_only_its_folders(provider, shared_tmp):
    out, data = prepared(shared_tmp, provider)
    res = sandbox_run(provider, name="t-isolation", command=["python3", "-c", PROBE],
                      output_dir=str(out), data_dir=str(data), env=(("GREETING", "hi"),))
    assert res["exit_code"] == 0, res["tail"]
    assert 0 < res["started_s"] < res["seconds"]  # podman's start event: the agent's metric
    seen = json.loads(res["lines"][-1])
    assert gvisor_kernel(seen["kernel"]) and "Starting gVisor" in seen["dmesg"][0]
    assert seen["interfaces"] == ["lo"]
    assert seen["connect_loopback"] != "ok"  # the sandbox's own loopback, nothing listening
    assert seen["write_root"] != "ok"
    assert seen["root_mount_options"] and all("ro" in o.split(",") for o in seen["root_mount_options"])
    assert seen["write_tmp"] == "ok" and seen["write_output"] == "ok"
    assert seen["write_data"] != "ok" and seen["read_data"] == "dataset bytes"
    # The root of rootless Podman's user namespace, without a capability: the provider's own
    # uid on the host (what it wrote is the provider's, below).
    assert (seen["uid"], seen["capabilities"]) == (0, ["0000000000000000"]), seen
    assert seen["env"] == "hi"
    made = out / "made-inside.txt"
    assert made.read_text() == "x" and made.stat().st_uid == provider.uid
    assert not res["still_exists"]


def test_tmp_is_size_bounded(provider, shared_tmp):
    out, _ = prepared(shared_tmp, provider)
    res = sandbox_run(provider, name="t-tmp", tmp_mb=16, output_dir=str(out), command=[
        "sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; echo rc=$?"])
    text = "\n".join(res["lines"])
    assert "No space left on device" in text and "rc=1" in text


def test_wall_time_stops_the_job_and_leaves_no_container(provider, shared_tmp):
    out, _ = prepared(shared_tmp, provider)
    res = sandbox_run(provider, name="t-walltime", wall_time_s=2, output_dir=str(out),
                      command=["sleep", "300"])
    assert res["timed_out"] and res["exit_code"] != 0
    # Its podman ended by itself once its container was killed (137, the container's
    # SIGKILL), rather than being killed half-way through its own clean-up (-9): that race
    # can leave Podman 4's whole store unusable (PodmanRunsc.halt).
    assert res["exit_code"] == 137, res
    assert res["seconds"] < 60
    assert not res["still_exists"]


def test_cancel_stops_the_job_and_leaves_no_container(provider, shared_tmp):
    out, _ = prepared(shared_tmp, provider)
    res = sandbox_run(provider, name="t-cancel", cancel_after=3, output_dir=str(out),
                      command=["sleep", "300"])
    assert res["cancelled"] and not res["timed_out"]
    assert res["exit_code"] == 137, res  # podman ended by itself (above)
    assert res["seconds"] < 60
    assert not res["still_exists"]


def test_memory_limit_holds_or_is_reported_as_not_enforced(provider, shared_tmp):
    out, _ = prepared(shared_tmp, provider)
    res = sandbox_run(provider, name="t-oom", memory_mb=128, output_dir=str(out), command=[
        "python3", "-c", "b = bytearray(400 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); print('survived')"])
    if res["limits"]["memory"] == "enforced":
        assert res["exit_code"] != 0 and "survived" not in res["lines"]
        assert res["oom_killed"]
    else:
        assert res["limits"]["memory"].startswith("not enforced: ")


def test_cpu_limit_throttles_a_busy_loop_when_enforced(provider, shared_tmp):
    # The kernel's own account of the job's cgroup, not the work done: loop counts (and gVisor's
    # view of its task's CPU time) also move with whatever else loads the host, and a loaded
    # host once made a loop capped at a quarter of a CPU look half as fast as an uncapped one.
    out, _ = prepared(shared_tmp, provider)
    loop = "import time; t=time.time(); n=0\nwhile time.time()-t < 3: n+=1\nprint(n)"
    with hostile.cpu_stats(provider) as seen:
        quarter = sandbox_run(provider, name="t-cpu", cpus=0.25, output_dir=str(out),
                              command=["python3", "-c", loop])
        if quarter["limits"]["cpu"] != "enforced":
            pytest.skip(f"cpu limit on this host: {quarter['limits']['cpu']}")
        full = sandbox_run(provider, name="t-cpu-full", cpus=2.0, output_dir=str(out),
                           command=["python3", "-c", loop])
    # Capped at 25 ms of every 100 ms, a busy loop is stopped in most periods, ~75 ms each;
    # with two CPUs' worth it never is.
    q, f = seen["t-cpu"], seen["t-cpu-full"]
    assert q["nr_periods"] >= 20 and q["nr_throttled"] >= 0.5 * q["nr_periods"], q
    assert q["throttled_time"] >= 1e9, q  # ns: over a second of its 3 s loop held back
    assert f["nr_periods"] >= 20 and f["nr_throttled"] <= 0.1 * f["nr_periods"], f
    assert int(quarter["lines"][-1]) > 0 and int(full["lines"][-1]) > 0


def test_sandbox_processes_on_the_host_are_not_root(provider, shared_tmp):
    out, _ = prepared(shared_tmp, provider)
    seen: list[tuple[int, str]] = []

    def watch() -> None:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not seen:
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                if "runsc" in cmd and "t-hostuid" not in cmd and "boot" in cmd:
                    uid = int(next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1])
                    seen.append((uid, cmd[:120]))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    sandbox_run(provider, name="t-hostuid", output_dir=str(out), command=["sleep", "5"])
    watcher.join()
    assert seen, "no runsc sandbox process was seen on the host"
    assert all(uid != 0 for uid, _ in seen), seen


def test_the_provider_sees_host_limits_honestly(provider):
    report = run_as_provider(provider, """
        import json
        from campugrid.sandbox.limits import detect
        print(json.dumps(detect().as_dict()))
    """)
    assert set(report) == {"memory", "cpu", "pids", "disk", "wall_time"}
    for how in report.values():
        assert how == "enforced" or how.startswith("not enforced: ")


def test_a_killed_agent_does_not_leave_its_sandbox_running(provider, shared_tmp):
    """kill -9 of the process that runs the sandbox: the guard removes the container."""
    import json as _json
    import signal
    import subprocess
    import sys

    from tests.support.provider import SANDBOX_SCRIPT

    out, _ = prepared(shared_tmp, provider)
    args = {"name": "t-orphan", "image": "localhost/campugrid/python:bookworm",
            "command": ["sleep", "600"], "env": [], "output_dir": str(out), "data_dir": None,
            "memory_mb": 256, "cpus": 1.0, "tmp_mb": 16, "wall_time_s": 600}
    runner = subprocess.Popen(provider.command([sys.executable, "-c", SANDBOX_SCRIPT, _json.dumps(args)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def exists() -> bool:
        return subprocess.run(provider.command(["podman", "container", "exists", "t-orphan"]),
                              capture_output=True).returncode == 0

    deadline = time.monotonic() + 60
    while not exists():
        assert time.monotonic() < deadline, "the sandbox never started"
        time.sleep(0.2)
    # the Python process under runuser/env, i.e. what would be the agent
    children = subprocess.run(["pgrep", "-P", str(runner.pid)], capture_output=True, text=True).stdout.split()
    victim = int(children[0]) if os.geteuid() == 0 else runner.pid
    os.kill(victim, signal.SIGKILL)
    runner.wait(timeout=30)
    deadline = time.monotonic() + 30
    while exists():
        assert time.monotonic() < deadline, "the sandbox kept running after its agent died"
        time.sleep(0.3)


def test_runsc_applies_a_seccomp_profile_stricter_than_podmans_default(provider, shared_tmp):
    from campugrid.sandbox import profile

    run = sandbox_run(provider, name="t-seccomp", command=["python3", "-c", SYSCALLS],
                      output_dir=str(prepared(shared_tmp, provider)[0]))
    seen = json.loads(run["lines"][-1])
    assert seen["getpid"] == "ok" and seen["select"] == "ok"  # ordinary calls still work
    # unshare(CLONE_NEWUSER) and ptrace(TRACEME) work in gVisor under Podman's default profile
    # (PLATFORM.md: `unshare -U -r` works inside); ours refuses them before gVisor sees them.
    assert seen["unshare"] != "ok" and seen["ptrace"] != "ok", seen
    assert {"unshare", "ptrace", "keyctl", "bpf"} <= set(profile.DENIED)
