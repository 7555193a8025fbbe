"""Hostile jobs, run side: each submits one attack through the REST API as a researcher would,
and asserts (a) the attack failed (what the job saw, its state and reason), (b) the host is
as it was (tests/support/hostile.py, `guard.check`, after every attack) and (c) the agent
serves the next job: a probe job right after each attack on the agent itself (floods, bombs,
signals, lying runners, the last of the output_mb attacks: `guard.check()`), and after the
module's last test, whichever ran (`serves_a_job_at_the_end`). The attacks that only read or
probe skip their own probe (`guard.check(probe=False)`): the next test's job is the next job.

Every assertion says, in a comment, which protection it stands for: remove that protection
and the assertion fails. The job's code is in tests/security/jobs.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import tarfile
import threading
import time
from pathlib import Path

import pytest

from campugrid.agent.logship import MAX_TASK_LOG_BYTES
from campugrid.buildpolicy.tarballs import MAX_MEMBERS
from campugrid.sandbox import slots
from campugrid.sandbox.podman_runsc import GUEST_NPROC
from tests.security import jobs
from tests.security.conftest import (
    BASE,
    PLAIN,
    brief,
    measure_agent_peak,
    result_of,
    run_job,
    run_log,
    run_python,
    seconds_running,
)
from tests.support import hostile

pytestmark = [pytest.mark.acceptance, pytest.mark.usefixtures("serves_a_job_at_the_end")]
REFUSED = ("ENOENT", "EACCES", "EPERM")


# --- (1) host files ---------------------------------------------------------------------------

def host_file_targets(name: str, agent, canaries) -> list[str]:
    work = agent.state_dir / "work"
    return {
        "etc-shadow": ["/etc/shadow", "/proc/1/root/etc/shadow"],
        "provider-home": [str(canaries.home.path), str(canaries.home.path.parent)],
        "agent-credentials": [str(canaries.credentials), str(canaries.state.path),
                              str(agent.state_dir)],
        "other-jobs-work-folders": [str(work), str(work / "{other}" / "output" / "result.txt")],
        "own-work-folder-on-the-host": [str(work / "{job}-{attempt}" / "context" / "Dockerfile")],
        "through-proc-1-root": [f"/proc/1/root{canaries.home.path}",
                                f"/proc/self/root/../../..{canaries.credentials}",
                                f"/proc/1/cwd/../../..{canaries.state.path}"],
    }[name]


HOST_FILE_TARGETS = ("etc-shadow", "provider-home", "agent-credentials", "other-jobs-work-folders",
                     "own-work-folder-on-the-host", "through-proc-1-root")


def test_a_job_cannot_read_host_files(api, guard, agent, canaries, provider):
    """Every kind of host file, one job (one sandbox start, not one per kind): each path
    asserted on its own."""
    # Another job's folder, as the agent lays them out (work/<job>-<attempt>/), owned by
    # the provider: the job's own uid. (The agent sweeps it away after this task.)
    other = hostile.Canary.plant(agent.state_dir / "work" / "0d1e-other-job-1" / "output" /
                                 "result.txt", provider, label="other-job")
    for d in (other.path.parent, other.path.parent.parent):
        os.chown(d, provider.uid, provider.gid)
    kinds = {path.replace("{other}", "0d1e-other-job-1"): kind for kind in HOST_FILE_TARGETS
             for path in host_file_targets(kind, agent, canaries)}
    job = run_python(api, jobs.READ_PATHS, {"env": {"TARGETS": json.dumps(list(kinds))}})
    assert job["state"] == "succeeded", brief(job)
    seen = result_of(job)
    # The host paths are not in the sandbox's filesystem at all (gVisor's gofer serves only
    # the image and the mounts): a sandbox that showed them would read them, as these files
    # belong to the job's own uid on the host (the provider's: the sandbox's root). The
    # sandbox's /etc/shadow is its image's own, which that root may read; the host's names
    # the provider.
    hosts_shadow = f"\n{provider.name}:"
    assert hosts_shadow in Path("/etc/shadow").read_text()

    def the_hosts(path: str) -> bool:
        got = seen[path]
        return got not in REFUSED and (kinds[path] != "etc-shadow" or hosts_shadow in got)

    read = {f"{kinds[path]}: {path}": seen[path] for path in kinds if the_hosts(path)}
    assert not read, f"the job read host files: {read}"
    assert set(kinds.values()) == set(HOST_FILE_TARGETS)
    guard.assert_not_leaked(job)
    hostile.assert_not_leaked([other.token], logs=run_log(api, job["id"]), result=job["result"])
    guard.check(probe=False)


def test_the_mount_table_shows_no_host_paths(api, guard, agent, provider):
    needles = [str(agent.state_dir), str(provider.home), str(agent.state_dir / "work")]
    job = run_python(api, jobs.MOUNT_TABLE, {"env": {"TARGETS": json.dumps(needles)}})
    assert job["state"] == "succeeded", brief(job)
    # gVisor shows its own mounts ("none" as every source), not the host's bind paths:
    # with runc, /proc/self/mountinfo would name the agent's work folder.
    assert result_of(job) == {n: [] for n in needles}
    guard.check(probe=False)


# --- (2) network ------------------------------------------------------------------------------

def labelled_listeners(platform) -> dict[str, tuple[str, int]]:
    """Every TCP port listening on the host now, at each address a job might try, named by
    whose it is; and SeaweedFS's own internal ports, in case they ever face the host."""
    s3_port = platform.s3.endpoint.rsplit(":", 1)[1]
    names = {platform.http_port: "coordinator-rest", platform.running.grpc_port: "coordinator-grpc",
             int(s3_port): "seaweedfs-s3"}
    weed = hostile.listening_ports_of(hostile.descendants(platform.s3.process.pid))
    names.update({port: "seaweedfs" for _, port in weed if port not in names})
    out: dict[str, tuple[str, int]] = {}
    any_address = ("0.0.0.0", "0000:0000:0000:0000:0000:0000:0000:0000")
    for sock in hostile.listening_sockets():
        if not sock.proto.startswith("tcp"):
            continue
        name = names.get(sock.port, "listener")
        addrs = ("127.0.0.1", hostile.host_address()) if sock.address in any_address else (
            sock.address,)
        for addr in addrs:
            out[f"{name} {addr}:{sock.port}"] = (addr, sock.port)
    for what, port in getattr(platform.s3, "ports", {}).items():
        out.setdefault(f"seaweedfs-internal {what} 127.0.0.1:{port}", ("127.0.0.1", port))
    return out


def host_reaches(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


def test_a_job_reaches_no_port_listening_on_the_host(api, guard, platform):
    """Every local port, one job: the coordinator's REST and gRPC, SeaweedFS's S3 (and any
    other port of it on the host), everything else listening on this machine; each asserted."""
    targets = labelled_listeners(platform)
    assert {"coordinator-rest", "coordinator-grpc", "seaweedfs-s3"} <= {
        t.split()[0] for t in targets}, targets
    job = run_python(api, jobs.CONNECT, {"env": {"TARGETS": json.dumps(
        [("tcp", h, p) for h, p in targets.values()])}})
    assert job["state"] == "succeeded", brief(job)
    seen = result_of(job)
    # The sandbox has a loopback of its own and no route out (runsc network=none): with the
    # host's network, each of these would connect (and the platform's would answer the GET).
    reached = {name: seen[f"tcp:{h}:{p}"] for name, (h, p) in targets.items()
               if seen[f"tcp:{h}:{p}"].startswith("ok")}
    assert not reached, f"the job reached: {reached}"
    print(f"{len(targets)} host ports tried from the sandbox, none reached")
    guard.check(probe=False)


def test_a_job_reaches_nothing_beyond_its_sandbox(api, guard, provider):
    """SSH, the host's addresses, the internet, DNS and the host's sockets, one job: each
    attempt asserted on its own, and where we listen ourselves, the host's own evidence."""
    witnesses: list[hostile.CanaryListener] = []
    try:
        # Nothing on 22 here: listen there ourselves, to see whether the job arrives (with a
        # real sshd there, the job's own report is the evidence).
        with contextlib.suppress(OSError):
            witnesses.append(hostile.CanaryListener("127.0.0.1", 22))
        tries = [("tcp", "127.0.0.1", 22)]
        witnesses.append(hostile.CanaryListener("0.0.0.0"))
        port = witnesses[-1].port
        tries += [(k, h, port) for k in ("tcp", "udp")
                  for h in ("127.0.0.1", hostile.host_address(), "10.0.2.2", "172.17.0.1")]
        # The internet, where this host itself reaches it (else there is nothing to prove).
        if host_reaches("1.1.1.1", 443):
            tries += [("tcp", "1.1.1.1", 443), ("tcp", "8.8.8.8", 53), ("udp", "8.8.8.8", 53)]
        resolver = next((line.split()[1] for line in Path("/etc/resolv.conf").read_text()
                         .splitlines() if line.startswith("nameserver")), "127.0.0.53")
        tries += [("dns", "example.org", 0), ("udp", resolver, 53)]
        runtime = provider.runtime_dir
        tries += [("unix", str(runtime / "podman" / "podman.sock"), 0),
                  ("unix", "/run/podman/podman.sock", 0), ("unix", "/var/run/docker.sock", 0),
                  ("unix", str(runtime / "bus"), 0), ("unix", "/run/dbus/system_bus_socket", 0),
                  ("unix", "\0/containers/podman", 0)]
        tries = list(dict.fromkeys(tries))
        job = run_python(api, jobs.CONNECT, {"env": {"TARGETS": json.dumps(tries)}})
        for w in witnesses:
            # The host's own evidence: nothing from the sandbox arrived (runsc's network=none
            # gives the sandbox a loopback of its own; with --network host it would arrive).
            assert w.settle() == [], f"reached the host's listener on port {w.port}: {w.hits}"
    finally:
        for w in witnesses:
            w.close()
    assert job["state"] == "succeeded", brief(job)
    seen = result_of(job)
    assert set(seen) == {f"{k}:{h}:{p}" for k, h, p in tries}
    # No route out and no host socket mounted in: every attempt fails.
    reached = {t: v for t, v in seen.items() if v.startswith("ok")}
    assert not reached, f"the job reached: {reached}"
    guard.check(probe=False)


# --- (3) resources ----------------------------------------------------------------------------

def test_a_fork_bomb_is_held_by_the_guest_process_limit(api, guard):
    # Memory enough for 500 Python processes in gVisor (at 2 GB the memory limit stops the
    # bomb first): here the process limit is what must hold.
    job = run_python(api, jobs.FORK_BOMB, {"resources": {"memory_mb": 8192, "wall_time_s": 120}})
    assert job["state"] == "succeeded", brief(job)
    seen = result_of(job)
    # gVisor enforces --ulimit nproc: fork() fails with EAGAIN before the guest has
    # GUEST_NPROC processes (without it, 5000 forks, or the host's pids cgroup kills the box).
    assert seen["stopped_by"] == "EAGAIN", seen
    assert seen["forked"] < GUEST_NPROC, seen
    print(f"fork bomb: {seen['forked']} processes, then {seen['stopped_by']}")
    guard.check()


def test_a_memory_bomb_is_oom_killed_at_memory_mb(api, guard):
    job = run_python(api, jobs.MEMORY_BOMB, {"resources": {"memory_mb": 256}})
    if job["limits"].get("memory") != "enforced":
        pytest.skip(f"memory limit on this host: {job['limits'].get('memory')}")
    # The job's cgroup (memory.limit_in_bytes = 256 MiB) holds the whole sandbox: the kernel
    # kills it (SIGKILL: 137). Without it the job would print "survived".
    assert job["state"] == "failed" and job["exit_code"] == 137, brief(job)
    assert job["result"].startswith("allocated "), brief(job)
    allocated = int(job["result"].split()[1])
    assert allocated <= 256, brief(job)
    print(f"memory bomb: OOM-killed after {allocated} MiB allocated in the guest (limit 256 MB)")
    # The reason names the limit (the kernel's oom_kill count in the job's memory cgroup).
    assert job["reason"] == "out of memory: the job used more than 256 MB", brief(job)
    guard.check()


def test_a_busy_loop_is_throttled_to_its_cpu_quota(api, guard, provider):
    """The kernel's count of the job's cgroup, read from the host as it runs (hostile.cpu_stats):
    its quota is what the job asked for, and a busy loop is held back in most periods."""
    with hostile.cpu_stats(provider) as seen:
        job = run_python(api, jobs.BUSY_LOOP, {"resources": {"cpus": 0.25}})
    if job["limits"].get("cpu") != "enforced":
        pytest.skip(f"cpu limit on this host: {job['limits'].get('cpu')}")
    assert job["state"] == "succeeded", brief(job)
    capped = [s for name, s in seen.items() if "campugrid-" in name and s["quota"] * 4 == s["period"]]
    assert capped, seen  # a quarter of each period, as resources.cpus asked
    stat = max(capped, key=lambda s: s["nr_periods"])
    assert stat["nr_periods"] >= 20 and stat["nr_throttled"] >= stat["nr_periods"] // 2, stat
    print(f"cpu quota: {stat['nr_throttled']} of {stat['nr_periods']} periods throttled, "
          f"{stat['throttled_time'] / 1e9:.1f} s held back")
    guard.check(probe=False)


FILLS = {"/tmp/fill": 16, "/dev/shm/fill": 64}  # where -> its size in MB (disk_mb=16)


def test_filling_a_writable_folder_stops_at_its_size(api, guard):
    """Both folders, one job: each filled by a process of its own, each asserted on its own."""
    job = run_python(api, jobs.EACH_ATTACK, {"env": {"ATTACKS": json.dumps(
        {where: jobs.fill(where) for where in FILLS})}, "resources": {"disk_mb": 16}})
    assert job["state"] == "succeeded", brief(job)
    got = result_of(job)
    assert set(got) == set(FILLS), got
    for where, limit_mb in FILLS.items():
        seen = got[where]
        # /tmp is a tmpfs of resources.disk_mb; /dev/shm is podman's 64 MB shm: both stop the
        # writer with ENOSPC (an unbounded tmpfs would take 4 GiB of the host's memory).
        assert isinstance(seen, dict) and seen["stopped_by"] == "ENOSPC", (where, seen)
        assert (limit_mb - 4) * 2**20 <= seen["written"] <= limit_mb * 2**20, (where, seen)
        print(f"{where}: {seen['written']} bytes written, then ENOSPC (size {limit_mb} MB)")
    guard.check(probe=False)


@pytest.mark.parametrize(("newlines", "size"), [(True, 2**29), (False, 2**29)],
                         ids=["512-MiB-of-short-lines", "512-MiB-without-a-newline"])
def test_a_stdout_flood_leaves_the_agent_and_the_log_bounded(api, guard, agent, newlines, size):
    """512 MiB through the agent either way: 16 times the log limit, and twice what the
    agent may grow by, so an agent that kept what it read could not pass (2 GB took a minute
    of the suite and showed nothing more)."""
    job, grew_kb = measure_agent_peak(agent, lambda: run_python(
        api, jobs.STDOUT_FLOOD, {"env": {"NEWLINES": "1" if newlines else "0", "BYTES": str(size)}},
        timeout=300))
    assert job["state"] == "succeeded", brief(job)
    chunks = api.logs(job["id"])["chunks"]
    stored = sum(len(c["text"]) for c in chunks)
    # The agent keeps at most MAX_TASK_LOG_BYTES of a task's log and counts the rest; it
    # reads lines in bounded pieces (64 KiB), so an endless line is no endless buffer.
    assert stored <= MAX_TASK_LOG_BYTES + 256 * 1024, stored
    assert grew_kb < 256 * 1024, f"the agent grew by {grew_kb // 1024} MiB"
    # All of it went through the agent (the job's last line comes after it):
    assert job["result"].startswith("wrote ") and int(job["result"].split()[1]) >= size, brief(job)
    assert "more lines not kept: the log limit is 32 MiB" in chunks[-1]["text"]
    print(f"{size / 2**20:.0f} MiB of stdout ({'lines' if newlines else 'no newline'}): "
          f"{stored / 2**20:.1f} MiB stored, agent peak +{grew_kb // 1024} MiB, "
          f"{seconds_running(job):.0f} s")
    guard.check()


def test_a_process_that_ignores_sigterm_is_stopped_at_its_wall_time(api, guard):
    # Long enough for its first line on a loaded host: with 3 s, gVisor and Python did not
    # always get as far as printing it before the limit (an empty log, in one full run of 4).
    wall = 8
    job = run_python(api, jobs.IGNORES_SIGTERM, {"resources": {"wall_time_s": wall}}, timeout=120)
    # The wall-time limit kills the sandbox (SIGKILL to its container), not a polite signal:
    # without it the job would run for ever.
    assert job["state"] == "failed", brief(job)
    assert job["reason"] == f"wall time of {wall} s exceeded; the job was stopped"
    assert seconds_running(job) < wall + 30, seconds_running(job)
    assert "ignoring SIGTERM" in run_log(api, job["id"])
    guard.check()  # no process of it on the host: checked against the before-picture


def test_a_double_forked_daemon_does_not_outlive_its_job(api, guard, platform):
    job = run_python(api, jobs.DOUBLE_FORK)
    assert job["state"] == "succeeded", brief(job)
    seen = result_of(job)
    assert seen["daemon_beating"], seen  # the daemon was alive when its parent exited
    # When the job's command (pid 1 in gVisor) exits, the sandbox goes, and every process in
    # it: no runsc, gofer or conmon of it stays on the host (the guard's process check), and
    # its container is gone. A daemon that escaped would keep a sandbox process alive.
    name = f"campugrid-{job['id']}-1"
    after = guard.check()
    assert name not in after.containers
    assert not [p for p in after.procs.values() if job["id"] in p.cmdline]


def folder_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


@pytest.mark.parametrize(("target", "mode"), [("/output", "many-files"),
                                              ("/checkpoints", "many-files"),
                                              ("/output", "parallel-files"),
                                              ("/output", "one-big-file"),
                                              ("/output", "sparse-files")])
def test_writing_past_output_mb_stops_the_job(api, guard, agent, target, mode):
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the host's view (disk blocks) of the job's folders, meanwhile
        while not stop.is_set():
            peak[0] = max(peak[0], folder_size(agent.state_dir / "work") + sum(
                folder_size(task) for task in slots.SLOTS_ROOT.glob("*/task")))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        job = run_python(api, jobs.OUTPUT_WRITER, {"env": {"TARGET": target, "MODE": mode},
                                                   "resources": {"output_mb": 8}})
    finally:
        stop.set()
        watcher.join()
    # The folders live in the agent's output slot, where the kernel refuses the byte past
    # output_mb (+ the slot's slack for directories), and the watchdog stops the job that
    # hit it: without them the job would write 4 GiB (or 1 TiB of sparse files, which the
    # output tarball would inflate), then sleep into "never stopped". Sparse files take no
    # disk; their apparent size is what the watchdog counts.
    assert job["state"] == "failed", brief(job)
    assert job["limits"]["output"] == "enforced", job["limits"]
    assert "wrote more than 8 MB to /output and /checkpoints" in job["reason"], brief(job)
    log = run_log(api, job["id"])
    assert "never stopped" not in log
    assert peak[0] <= 8 * 2**20 + slots.SLACK, f"the job's folders reached {peak[0] / 2**20:.2f} MiB"
    last = [line for line in log.splitlines() if line.startswith(("wrote ", "made ", "stopped "))]
    print(f"output_mb=8, {mode} in {target}: {last[-1] if last else '-'}; the host folder "
          f"peaked at {peak[0] / 2**20:.1f} MiB on disk")
    guard.check(probe=mode == "sparse-files")  # the last of them: the agent stopped each alike


def test_links_in_output_are_not_followed(api, guard, canaries, agent):
    targets = {"provider-home": canaries.home.path, "agent-credentials": canaries.credentials,
               "agent-state-dir": agent.state_dir}
    job = run_python(api, jobs.OUTPUT_LINK, {"env": {"TARGETS": json.dumps(
        {name: str(path) for name, path in targets.items()})}})
    assert job["state"] == "succeeded" and job["result"] == "planted", brief(job)
    output = api.output(job["id"])
    with tarfile.open(fileobj=io.BytesIO(output)) as tar:
        names = tar.getnames()
    # The agent tars regular files only and never follows a link (hooks.regular_files):
    # following one would upload the host file or folder it names.
    for name in targets:
        assert not [n for n in names if name in n], (name, names)
    assert names == ["real.txt"], names
    guard.assert_not_leaked(job, output=output)
    guard.check(probe=False)  # the canaries and credentials are unchanged


CHECKPOINT_SHAPES = {  # one job each: the static shapes side by side (an epoch each), the race
    "folder-file-and-manifest-links": {"epoch-folder-is-a-link": 2, "manifest-is-a-link": 3,
                                       "file-in-epoch-is-a-link": 4},
    "swap-file-for-link": {"swap-file-for-link": 2}}


@pytest.mark.parametrize("case", list(CHECKPOINT_SHAPES))
def test_links_in_checkpoints_are_not_followed(api, guard, platform, canaries, case):
    shapes = CHECKPOINT_SHAPES[case]
    job = run_python(api, jobs.CHECKPOINT_LINK, {"env": {"TARGET": str(canaries.state.path),
                                                         "SHAPES": json.dumps(shapes)}})
    assert job["state"] == "succeeded" and job["result"] == "planted", brief(job)
    coord = platform.running.coord
    recorded = coord.store.checkpoints.of(job["id"])
    assert recorded, "not even the genuine checkpoint of epoch 1 was kept"
    for ckpt in recorded:
        blob = coord.objects.get_bytes(ckpt.key)
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            names = sorted(tar.getnames())
            weights = tar.extractfile("w").read().decode() if "w" in names else ""
        # The uploader copies through O_NOFOLLOW and directory fds, then checks the copy
        # against the manifest: a link is never read, so no host file is in a checkpoint.
        assert names == ["MANIFEST.json", "w"], (ckpt.epoch, names)
        assert weights == f"genuine weights {ckpt.epoch}", (ckpt.epoch, weights)
        hostile.assert_not_leaked(canaries.secrets(), checkpoint=blob)
    epochs = [c.epoch for c in recorded]
    for how in ("epoch-folder-is-a-link", "manifest-is-a-link"):
        if how in shapes:  # the linked epoch was never uploaded
            assert shapes[how] not in epochs, (how, epochs)
    if "file-in-epoch-is-a-link" in shapes:  # uploaded, with its genuine file only (above)
        assert shapes["file-in-epoch-is-a-link"] in epochs, epochs
    print(f"{case}: epochs {epochs} recorded, {run_log(api, job['id']).splitlines()[-2:-1]}")
    guard.assert_not_leaked(job)
    guard.check(probe=False)  # the canary the links point at is still there, unchanged


# --- (4) hostile build contexts at the REST boundary -----------------------------------------

DOCKERFILE = PLAIN.encode()


def make_tar(members: list[tuple[str, str, object]]) -> bytes:
    """members: (name, kind, payload), kind file|dir|symlink|hardlink|chr|blk|fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(payload, bytes)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                         "hardlink": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE,
                         "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("symlink", "hardlink"):
                info.linkname = str(payload)
            if kind in ("chr", "blk"):
                info.devmajor, info.devminor = payload  # type: ignore[misc]
            tar.addfile(info)
    return buf.getvalue()


DF = ("Dockerfile", "file", DOCKERFILE)
CHAIN = [DF, ("d", "dir", None), ("d/x", "symlink", ".."), ("d/y", "symlink", "x/../etc/shadow")]
CONTEXT_TRICKS = [
    pytest.param([DF, ("/etc/cron.d/evil", "file", b"x")], "absolute path", id="absolute-path"),
    pytest.param([DF, ("../../evil", "file", b"x")], "leaves the context folder", id="dot-dot"),
    pytest.param([DF, ("sub/../../evil", "file", b"x")], "leaves the context folder",
                 id="dot-dot-inside-a-path"),
    pytest.param([DF, ("l", "symlink", "/etc/shadow")], "is absolute", id="absolute-symlink"),
    pytest.param([DF, ("l", "symlink", "../../etc/shadow")], "leaves the context",
                 id="escaping-symlink"),
    pytest.param([("Dockerfile", "symlink", "/etc/passwd")], "is absolute",
                 id="dockerfile-is-a-link"),
    pytest.param([DF, ("h", "hardlink", "/etc/shadow")], "absolute path", id="absolute-hardlink"),
    pytest.param([DF, ("h", "hardlink", "../../etc/shadow")], "leaves the context folder",
                 id="escaping-hardlink"),
    pytest.param([DF, ("sda", "blk", (8, 0))], "device, fifo", id="block-device"),
    pytest.param([DF, ("mem", "chr", (1, 1))], "device, fifo", id="char-device"),
    pytest.param([DF, ("p", "fifo", None)], "device, fifo", id="fifo"),
    pytest.param([DF] + [(f"f{i}", "file", b"") for i in range(MAX_MEMBERS)],
                 f"more than {MAX_MEMBERS} files", id="too-many-members"),
    # d/x -> .. plus d/y -> x/../etc/shadow: each harmless on its own, together outside (the
    # agent refuses it again when it unpacks: tests/unit/test_context.py, for real files).
    pytest.param(CHAIN, "resolves outside the context", id="symlink-chain-escape"),
]


@pytest.mark.parametrize(("members", "says"), CONTEXT_TRICKS)
def test_a_hostile_context_is_refused_at_submit_and_nothing_stored(api, guard, platform, members,
                                                                   says):
    context = make_tar(members)
    before = {j["id"] for j in api.jobs(limit=1000)}
    resp = api.http.post("/v1/jobs", files={"context": ("c.tgz", context)},  # signed
                         data={"spec": json.dumps({"command": ["true"]})}, timeout=60)
    try:
        # buildpolicy.tarballs.inspect_context, at the coordinator: without it the job is stored
        # (201) and only the agent would refuse it.
        assert resp.status_code == 422, resp.text
        assert says in resp.json()["detail"], resp.json()["detail"]
        assert {j["id"] for j in api.jobs(limit=1000)} == before  # no job
        key = f"contexts/{hashlib.sha256(context).hexdigest()}.tar"
        assert not platform.running.coord.objects.exists(key)  # and no stored context
    finally:
        if resp.status_code < 300:
            api.cancel(resp.json()["id"])
    # (c) for these is the next test's job: the agent never saw them.
    guard.check(probe=False)


# --- (5) lying shard runners -------------------------------------------------------------------

LIAR_FILES = {"fake/campugrid/hooks/__init__.py": "", "fake/campugrid/hooks/shard_runner.py":
              jobs.LYING_RUNNER}
LIAR_DOCKERFILE = f"FROM {BASE}\nCOPY fake /fake\nRUN chmod -R a+rX /fake\n"


LIES = {  # the lie -> the reason its shard must fail with
    "not-json": "the shard's result is not JSON",
    "too-big": "the shard's result is over 65536 bytes",
    "nested-too-deep": "the shard's result is not JSON (or nested too deeply)",
    "for-another-shard": "the sandbox stopped during this shard",
}


def test_a_lying_shard_runner_fails_its_own_shards_only(api, guard):
    """One sharded job, one lie per shard, and an honest shard last. The job's own shard
    runner comes first on PYTHONPATH; the costs make the only (hence fastest) machine take
    the shards in this order; "for-another-shard" claims the honest shard's result."""
    shards = [{"payload": {"lie": lie}, "cost": len(LIES) + 1 - i} for i, lie in enumerate(LIES)]
    shards.append({"payload": {"n": 1}, "cost": 1})
    spec = {"command": ["python3", "-c", "pass"], "env": {"PYTHONPATH": "/fake"}, "shards": shards}
    job = run_job(api, LIAR_DOCKERFILE, LIAR_FILES, spec, timeout=300)
    got = {s["index"]: s for s in api.shards(job["id"])}
    honest = len(LIES)
    for index, (lie, reason) in enumerate(LIES.items()):
        # The agent accepts only bounded JSON for the shard it sent (runner_lines.parse): a
        # lie fails that shard with a reason, and the session goes on (a fresh sandbox if the
        # runner died). Without the checks, "not-json" and "too-big" would be stored.
        assert got[index]["state"] == "failed", (lie, got[index])
        assert reason in (got[index]["reason"] or ""), (lie, got[index]["reason"])
    # The honest shard's result is its own, not the one the liar claimed for it.
    assert got[honest]["state"] == "succeeded", got[honest]
    assert got[honest]["result"] == {"honest": honest}, got[honest]
    assert job["state"] == "failed", brief(job)
    assert f"{len(LIES)} of {len(LIES) + 1} shards failed (first: shard 0" in job["reason"]
    guard.check()


def test_a_shard_runner_flooding_stdout_leaves_the_agent_bounded(api, guard, agent):
    spec = {"command": ["python3", "-c", "pass"], "env": {"PYTHONPATH": "/fake"},
            "shards": [{"payload": {"lie": "flood-after-answer"}}]}
    job, grew_kb = measure_agent_peak(agent, lambda: run_job(
        api, LIAR_DOCKERFILE, LIAR_FILES, spec, timeout=300))
    # The runner's stdout is read in bounded lines; junk between shards is dropped, and the
    # sandbox is stopped 5 s after its last shard: the agent does not buffer 2 GB.
    assert job["state"] == "succeeded", brief(job)
    assert [s["result"] for s in api.shards(job["id"])] == [{"honest": 0}]
    assert grew_kb < 256 * 1024, f"the agent grew by {grew_kb // 1024} MiB"
    print(f"shard runner flooding 2 GB after its answer: agent peak +{grew_kb // 1024} MiB")
    guard.check()
