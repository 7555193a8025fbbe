"""The agent's loop: pull a task, build it, run it in the sandbox, report, clean up.

Nothing from a job ever runs outside gVisor: the agent only downloads, unpacks (with checks),
and hands the files to the builder and the sandbox, which run them under runsc.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tarfile
import threading
import time
from pathlib import Path

import grpc
import httpx

from campugrid.agent.client import CoordinatorClient
from campugrid.agent.logship import LogShipper
from campugrid.builders.base import Builder
from campugrid.builders.context import extract_context
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol.errors import BuildFailed, CampugridError, InvalidInput
from campugrid.protocol.spec import JobSpec
from campugrid.sandbox.podman_runsc import PodmanRunsc, RunRequest

log = logging.getLogger("campugrid.agent")
MAX_OUTPUT_BYTES = 1024**3
BUILD_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    coordinator: str
    state_dir: Path
    name: str
    poll_seconds: float = 1.0


class Renewer:
    """Keeps the lease alive; stops the task when the coordinator says so or can't be reached.

    Self-fencing: if no renewal succeeded for a whole lease period, another machine may
    already hold the job, so the task is stopped here rather than computing beside it.
    """

    def __init__(self, client: CoordinatorClient, lease: pb.LeaseReply, cancel: threading.Event) -> None:
        self.client, self.lease, self.cancel = client, lease, cancel
        self.phase = "building"
        self.reason = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"renew-{lease.job_id}")

    def start(self) -> Renewer:
        self._thread.start()
        return self

    def set_phase(self, phase: str) -> None:
        """Tell the coordinator now (the renewal carries the phase), not at the next tick."""
        self.phase = phase
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=15)

    def _loop(self) -> None:
        lease_s = self.lease.lease_seconds or 12.0
        last_ok = time.monotonic()
        while True:
            self._wake.wait(lease_s / 4)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                reply = self.client.renew(self.lease.job_id, self.lease.fencing_token, self.phase,
                                          timeout_s=lease_s / 4)
            except grpc.RpcError as e:
                if time.monotonic() - last_ok >= lease_s:
                    self.reason = f"self-fenced: no lease renewal for {lease_s:.0f} s ({e.code()})"
                    log.warning("%s: %s", self.lease.job_id, self.reason)
                    self.cancel.set()
                    return
                continue
            if not reply.keep_going:
                self.reason = reply.reason
                log.warning("%s: stopping: %s", self.lease.job_id, reply.reason)
                self.cancel.set()
                return
            last_ok = time.monotonic()
            lease_s = reply.lease_seconds or lease_s


class Agent:
    def __init__(self, settings: AgentSettings, builder: Builder, sandbox: PodmanRunsc) -> None:
        if os.geteuid() == 0:
            raise CampugridError("the agent never runs as root: start it as an unprivileged "
                                 "user (infra/setup.sh creates 'campugrid')")
        self.settings = settings
        self.builder = builder
        self.sandbox = sandbox
        self.client = CoordinatorClient(settings.coordinator, settings.state_dir / "credentials.json")
        self.work_root = settings.state_dir / "work"
        self.stopping = threading.Event()
        self._task_cancel: threading.Event | None = None

    def shutdown(self) -> None:
        """Stop pulling, and stop the running task's sandbox (its lease then expires)."""
        self.stopping.set()
        if self._task_cancel is not None:
            self._task_cancel.set()

    def capabilities(self) -> pb.Capabilities:
        mem_kb = 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            mem_kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        return pb.Capabilities(runtime=self.sandbox.describe(), builder=self.builder.name,
                               cpus=os.cpu_count() or 1, memory_mb=mem_kb // 1024,
                               limits=self.sandbox.limits.as_dict())

    def run(self, *, once: bool = False) -> None:
        caps = self.capabilities()
        while not self.stopping.is_set():
            try:
                self.client.ensure_registered(self.settings.name, caps)
                break
            except grpc.RpcError as e:
                log.warning("cannot reach the coordinator at %s (%s); retrying",
                            self.settings.coordinator, e.code())
                self.stopping.wait(2)
        log.info("agent %s registered as %s", self.settings.name, self.client.machine_id)
        for name in self.sandbox.sweep(self.client.machine_id):
            log.warning("removed sandbox %s left from an earlier run of this agent", name)
        last_beat = 0.0
        while not self.stopping.is_set():
            try:
                if time.monotonic() - last_beat > 10:
                    self.client.heartbeat()
                    last_beat = time.monotonic()
                lease = self.client.lease()
            except grpc.RpcError as e:
                log.warning("coordinator unreachable (%s)", e.code())
                self.stopping.wait(2)
                continue
            if not lease.has_task:
                self.stopping.wait(self.settings.poll_seconds)
                continue
            self.run_task(lease)
            if once:
                return

    def run_task(self, lease: pb.LeaseReply) -> None:
        job_id, token = lease.job_id, lease.fencing_token
        log.info("task %s attempt %d leased", job_id, token)
        work = self.work_root / f"{job_id}-{token}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        cancel = self._task_cancel = threading.Event()
        renewer = Renewer(self.client, lease, cancel).start()
        shipper = LogShipper(self.client, job_id, token)
        image = f"localhost/campugrid-job-{job_id}:{token}"
        outcome: pb.CompleteRequest | None = None
        try:
            outcome = self._execute(lease, work, image, cancel, renewer, shipper)
        except CampugridError as e:
            outcome = pb.CompleteRequest(succeeded=False, exit_code=-1, reason=str(e))
        except Exception as e:
            log.exception("task %s crashed the agent's task runner", job_id)
            outcome = pb.CompleteRequest(succeeded=False, exit_code=-1,
                                         reason=f"agent error: {type(e).__name__}: {e}")
        finally:
            shipper.close()
            renewer.stop()
            self.sandbox.remove_image(image)
            shutil.rmtree(work, ignore_errors=True)
        if cancel.is_set():
            log.info("task %s attempt %d stopped: %s", job_id, token, renewer.reason)
            return
        outcome.job_id, outcome.fencing_token = job_id, token
        outcome.limits.update(self.sandbox.limits.as_dict())
        for delay in (0, 1, 2, 4, 8):
            time.sleep(delay)
            try:
                reply = self.client.complete(outcome)
                if not reply.accepted:
                    log.warning("completion of %s refused: %s", job_id, reply.reason)
                return
            except grpc.RpcError as e:
                log.warning("completion of %s failed (%s); retrying", job_id, e.code())

    def _execute(self, lease: pb.LeaseReply, work: Path, image: str, cancel: threading.Event,
                 renewer: Renewer, shipper: LogShipper) -> pb.CompleteRequest:
        spec = JobSpec.from_json(lease.spec_json)
        context_dir, output_dir, data_dir = work / "context", work / "output", work / "data"
        output_dir.mkdir()
        with httpx.Client(timeout=60) as http:
            resp = http.get(lease.context_url)
            resp.raise_for_status()
            extract_context(resp.content, context_dir)
            if lease.datasets:
                self._fetch_datasets(http, lease, data_dir)
        build_log = shipper.for_stream("build")
        build_log(f"[campugrid] building with {self.builder.name}, RUN steps under gVisor, no network")
        try:
            self.builder.build(context_dir, image, log=build_log,
                               timeout_s=min(BUILD_TIMEOUT_S, spec.resources.wall_time_s),
                               cancel=cancel, memory_mb=spec.resources.memory_mb,
                               cpus=spec.resources.cpus)
        except BuildFailed as e:
            return pb.CompleteRequest(succeeded=False, exit_code=-1,
                                      reason=f"{e.reason}; last lines of the build log:\n{e.log_tail}")
        renewer.set_phase("running")
        run_log = shipper.for_stream("run")
        last_line: list[str] = []

        def on_line(text: str) -> None:
            if text.strip():
                last_line[:] = [text]
            run_log(text)

        env = (*spec.env, ("CAMPUGRID_JOB_ID", lease.job_id),
               ("CAMPUGRID_ATTEMPT", str(lease.attempt)), ("CAMPUGRID_OUTPUT", "/output"))
        result = self.sandbox.run(RunRequest(
            name=f"campugrid-{lease.job_id}-{lease.fencing_token}", image=image,
            command=spec.command, env=env, output_dir=output_dir,
            data_dir=data_dir if lease.datasets else None, memory_mb=spec.resources.memory_mb,
            cpus=spec.resources.cpus, tmp_mb=spec.resources.disk_mb,
            wall_time_s=spec.resources.wall_time_s, agent=self.client.machine_id),
            log=on_line, cancel=cancel)
        uploaded = False
        if not cancel.is_set():
            uploaded = self._upload_output(lease.output_url, output_dir, work / "output.tar.gz")
        if result.timed_out:
            reason = f"wall time of {spec.resources.wall_time_s} s exceeded; the job was stopped"
        elif result.oom_killed:
            reason = f"out of memory: the job used more than {spec.resources.memory_mb} MB"
        elif result.exit_code != 0:
            reason = f"the job's command exited with status {result.exit_code}"
        else:
            reason = ""
        return pb.CompleteRequest(
            succeeded=result.exit_code == 0 and not result.timed_out, exit_code=result.exit_code,
            reason=reason, result=last_line[0][-4000:] if last_line else "",
            output_uploaded=uploaded)

    @staticmethod
    def _fetch_datasets(http: httpx.Client, lease: pb.LeaseReply, data_dir: Path) -> None:
        for ds in lease.datasets:
            root = (data_dir / ds.name).resolve()
            for f in ds.files:
                target = (root / f.path).resolve()
                if not target.is_relative_to(root):
                    raise InvalidInput(f"dataset {ds.name}: unsafe path {f.path!r}")
                target.parent.mkdir(parents=True, exist_ok=True)
                with http.stream("GET", f.url) as resp, open(target, "wb") as out:
                    resp.raise_for_status()
                    for chunk in resp.iter_bytes(1024 * 1024):
                        out.write(chunk)

    @staticmethod
    def _upload_output(url: str, output_dir: Path, tarball: Path) -> bool:
        """Tar the output folder (regular files only: links the job made are skipped) and PUT it."""
        files = [p for p in output_dir.rglob("*") if p.is_file() and not p.is_symlink()]
        if not files:
            return False
        if sum(p.stat().st_size for p in files) > MAX_OUTPUT_BYTES:
            raise InvalidInput(f"output: larger than {MAX_OUTPUT_BYTES // 1024**2} MiB; not uploaded")
        with tarfile.open(tarball, mode="w:gz") as tar:
            for p in sorted(files):
                tar.add(p, arcname=str(p.relative_to(output_dir)), recursive=False)
        size = tarball.stat().st_size
        with httpx.Client(timeout=300) as http, open(tarball, "rb") as f:
            http.put(url, content=f, headers={"content-length": str(size)}).raise_for_status()
        return True
