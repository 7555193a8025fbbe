"""The owner's say (campugrid.agent.owner): hours, pause, listed programs found in the real
/proc, and foreign GPU use against recorded NVML answers (the real NVML runs where a GPU is)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest

from campugrid.agent import owner, status
from campugrid.agent.owner import Hours, Owner, OwnerPolicy, foreign_gpu_users, running_programs
from campugrid.protocol.errors import InvalidInput

MIB = 2**20


def at(hh: int, mm: int) -> dt.datetime:
    return dt.datetime(2026, 12, 2, hh, mm)


def test_hours_allow_work_inside_their_windows_and_run_past_midnight():
    night = Hours.parse("22:00-07:00, 12:00-13:30")
    assert [night.allows(at(h, m)) for h, m in [(22, 0), (23, 59), (0, 0), (6, 59)]] == [True] * 4
    assert [night.allows(at(h, m)) for h, m in [(7, 0), (11, 59), (13, 30), (21, 59)]] == [False] * 4
    assert night.allows(at(12, 0)) and night.allows(at(13, 29))
    assert str(night) == "22:00-07:00,12:00-13:30"
    assert Hours.parse("9:05-17:00").allows(at(9, 5)) and not Hours.parse("9:05-17:00").allows(at(9, 4))


@pytest.mark.parametrize("text", ["25:00-01:00", "10:00-10:00", "", "10-12", "10:00", "10:60-11:00",
                                  "10:00-11:00,", "22:00 - 07:00x"])
def test_hours_that_cannot_be_read_are_refused_with_the_form_to_use(text):
    with pytest.raises(InvalidInput, match=r"HH:MM|must not start where it ends"):
        Hours.parse(text)


def test_pause_and_resume_are_harmless_twice_and_a_hand_written_pause_counts(tmp_path):
    assert owner.paused_since(tmp_path) is None
    assert owner.pause(tmp_path) and not owner.pause(tmp_path)
    since = owner.paused_since(tmp_path)
    assert since and dt.datetime.fromisoformat(since).tzinfo is not None
    assert owner.resume(tmp_path) and not owner.resume(tmp_path)
    (tmp_path / owner.PAUSE_FILE).write_text("")  # `touch paused` by hand
    assert owner.paused_since(tmp_path) == "?"


@pytest.fixture
def program(tmp_path):
    """Start a real process under a given file name and argv[0]; stop them all after."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(file_name: str, argv0: str | None = None) -> subprocess.Popen[bytes]:
        exe = tmp_path / file_name
        shutil.copy("/bin/sleep", exe)
        proc = subprocess.Popen([argv0 or str(exe), "60"], executable=exe)
        procs.append(proc)
        deadline = time.monotonic() + 5  # until the kernel shows its new name
        while time.monotonic() < deadline and not Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            time.sleep(0.01)
        return proc

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_listed_program_is_found_by_name_file_name_or_windows_name(program):
    assert running_programs(["cg-game-one"]) == []
    program("cg-game-one")
    assert running_programs(["CG-Game-One", "cg-not-running"]) == ["cg-game-one"]
    # the kernel keeps 15 characters of a name; argv[0] has it whole
    program("cg-a-much-longer-renderer-name")
    assert running_programs(["cg-a-much-longer-renderer-name"]) == ["cg-a-much-longer-renderer-name"]
    assert running_programs(["cg-a-much-longer"]) == []  # a prefix is another program
    # a Proton/Wine game: a Windows path as argv[0], listed with or without .exe
    program("cg-wine-loader", argv0="C:\\Games\\CgShooter\\CgShooter.exe")
    assert running_programs(["cgshooter"]) == ["cgshooter"]
    assert running_programs(["CgShooter.exe"]) == ["cgshooter"]
    assert running_programs([" ", ""]) == []


def test_processes_the_agent_started_are_never_the_owners(program):
    program("cg-game-two")  # a child of this test process, as the agent's builds are its own
    assert running_programs(["cg-game-two"]) == ["cg-game-two"]
    assert running_programs(["cg-game-two"], skip=[os.getpid()]) == []


class RecordedNvml:
    """NVML's answers as nvidia-ml-py returns them (c_nvmlProcessInfo_t, process utilisation
    samples, NVMLError for what a GPU does not support), replayed."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    def __init__(self, gpus):
        self.gpus = gpus
        self.inits = 0

    def nvmlInit(self): self.inits += 1
    def nvmlShutdown(self): self.inits -= 1
    def nvmlDeviceGetCount(self): return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i): return self.gpus[i]
    def nvmlDeviceGetUUID(self, h): return h["uuid"].encode()  # older bindings answer bytes

    def _answer(self, h, key):
        value = h.get(key, [])
        if isinstance(value, type) and issubclass(value, Exception):
            raise value()
        return value

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mem, gpuInstanceId=0xFFFFFFFF,
                                      computeInstanceId=0xFFFFFFFF)
                for pid, mem in self._answer(h, "compute")]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mem, gpuInstanceId=0xFFFFFFFF,
                                      computeInstanceId=0xFFFFFFFF)
                for pid, mem in self._answer(h, "graphics")]

    def nvmlDeviceGetProcessUtilization(self, h, since_us):
        assert since_us > (time.time() - 60) * 1e6  # only recent samples are asked for
        return [types.SimpleNamespace(pid=pid, timeStamp=int(time.time() * 1e6), smUtil=sm,
                                      memUtil=0, encUtil=0, decUtil=0)
                for pid, sm in self._answer(h, "utilisation")]


SANDBOX = {4101, 4102}  # runsc's sandbox and gofer: the job's own
LENT = "GPU-2f1c0e8a-lent"
# Other processes' pids, above the kernel's largest (2**22): no real process has them, so
# their names read "?" (a pid that exists here would show its real name).
PID = 2**22


def recorded(**lent):
    return RecordedNvml([
        {"uuid": "GPU-77aa-not-lent", "compute": [(9001, 20 * 1024 * MIB)], "graphics": [(9002, 512 * MIB)]},
        {"uuid": LENT, "compute": [(4101, 7000 * MIB)], "graphics": [],
         "utilisation": RecordedNvml.NVMLError_NotFound, **lent},
    ])


def test_only_processes_outside_the_sandbox_on_the_lent_gpus_count():
    ours = SANDBOX.__contains__
    assert foreign_gpu_users(recorded(), {LENT}, ours) == []
    found = foreign_gpu_users(recorded(graphics=[(PID + 200, 1536 * MIB)]), {LENT}, ours)
    assert found == [f"pid {PID + 200} (?) on GPU 1, 1536 MiB"]
    # memory NVML cannot attribute (None on some drivers) still names the process
    assert foreign_gpu_users(recorded(compute=[(4101, None), (PID + 300, None)]), {LENT}, ours) == [
        f"pid {PID + 300} (?) on GPU 1"]
    # a process busy on the GPU without memory of its own shows in the utilisation samples
    busy = recorded(utilisation=[(4102, 90), (PID + 400, 35), (PID + 500, 0)])
    assert foreign_gpu_users(busy, {LENT}, ours) == [f"pid {PID + 400} (?) on GPU 1, 35% busy"]
    # a GPU that does not list compute processes still lists graphics ones
    partial = recorded(compute=RecordedNvml.NVMLError_NotSupported, graphics=[(PID + 600, 64 * MIB)],
                       utilisation=RecordedNvml.NVMLError_NotSupported)
    assert foreign_gpu_users(partial, {LENT}, ours) == [f"pid {PID + 600} (?) on GPU 1, 64 MiB"]


def test_the_owner_drains_for_pause_listed_programs_and_foreign_gpu_use(tmp_path, program):
    clock = [at(12, 0)]
    nvml = recorded(graphics=[(5200, 1536 * MIB)])
    o = Owner(tmp_path, OwnerPolicy(hours=Hours.parse("22:00-07:00"), programs=("cg-game-three",)),
              nvml=nvml, clock=lambda: clock[0])
    # outside the hours: no new work, but the job running may finish
    assert o.hold().startswith("outside the hours its owner allows (22:00-07:00")
    assert o.drain_reason() == ""
    clock[0] = at(23, 0)
    assert o.hold() == ""
    # someone else on the job's GPU: drain; the sandbox's own use never drains
    assert "pid 5200" in o.drain_reason({LENT}, SANDBOX.__contains__)
    assert o.drain_reason({"GPU-77aa-not-lent-either"}, SANDBOX.__contains__) == ""
    assert nvml.inits == 0  # every init shut down again
    o.skip = frozenset()  # the "game" is this test's child, which the agent's would not be
    program("cg-game-three")
    assert o.drain_reason() == o.hold() == "its owner's program cg-game-three started"
    owner.pause(tmp_path)
    assert o.drain_reason() == o.hold() == "its owner paused the machine (campugrid provider pause)"


def test_the_real_nvml_answers_the_owner_where_there_is_one(tmp_path):
    """No driver here: the agent has no NVML to watch and says nothing; on a GPU machine the
    real library answers the same calls the recording replays."""
    from campugrid.agent.worker import _nvml

    nvml = _nvml()
    if nvml is None:
        assert Owner(tmp_path, OwnerPolicy()).drain_reason({LENT}) == ""
        return
    uuids = {nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0))}  # pragma: no cover
    nvml.nvmlInit()  # pragma: no cover
    try:  # pragma: no cover - GPU machines only
        assert isinstance(foreign_gpu_users(nvml, uuids, lambda pid: False), list)
    finally:
        nvml.nvmlShutdown()  # pragma: no cover


def test_the_status_file_tells_a_live_agent_from_a_dead_one(tmp_path):
    assert status.read(tmp_path) is None
    st = status.StatusFile(tmp_path, name="gamer-pc")
    st.task_started("job-1", 1)
    now = status.read(tmp_path)
    assert now["running"] and now["task"]["job_id"] == "job-1" and now["name"] == "gamer-pc"
    st.task_ended("handed back: its owner paused the machine")
    now = status.read(tmp_path)
    assert now["task"] is None and now["last_jobs"][0]["how"].startswith("handed back")
    # a pid the agent had, now someone else's (another start time): not running
    (tmp_path / status.STATUS_FILE).write_text(
        (tmp_path / status.STATUS_FILE).read_text().replace(f'"pid_start": {now["pid_start"]}',
                                                            '"pid_start": 1'))
    assert not status.read(tmp_path)["running"]
