"""A session of a sharded job on this machine: build once, keep one sandbox warm, and run
the job's shards in it one after another, each result sent with the request for the next.

    lease (session + first shard) -> download, build -> start the shard runner in gVisor
      -> shard, NextShard(result) -> shard, ... -> no shard left -> Complete (ends the session)

The runner (campugrid.hooks.shard_runner, mounted read-only) speaks JSON lines over the
sandbox's stdin/stdout; everything it says is untrusted and checked here.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from campugrid.agent import runner_lines
from campugrid.agent.messages import Outcome, ShardResult, ShardTask
from campugrid.agent.metrics import METRICS
from campugrid.agent.sandboxing import HOOKS_MOUNT
from campugrid.agent.task import Stage, Task, retry
from campugrid.protocol.spec import MAX_SHARD_RESULT
from campugrid.sandbox import confine
from campugrid.sandbox.process import LogFn
from campugrid.sandbox.runtime import RunRequest, Session

log = logging.getLogger("campugrid.agent")
READY_TIMEOUT_S = 120.0  # sandbox start, with margin for a busy machine
# One runner line is at most 128 KiB (Interactive's bound): small memory, no files.
READER_LIMITS = confine.Limits(memory_mb=256, cpu_s=600, fsize_mb=1, nofile=16, wall_s=30)


class ShardSessionTask(Task):
    """Task's download/build/report, with a warm sandbox serving shards in between."""

    # Other machines' sessions may run the last shards and end the job while a push beside
    # this one's shards went on: the push would then be refused, the build not shared. It
    # comes first.
    push_beside = False

    def drain(self, grace_s: float, why: str = "the provider is shutting down") -> None:
        """Finish the shard in hand within the grace period, take no new one."""
        self.hand_over(why)
        timer = threading.Timer(grace_s, self.stop.set)
        timer.daemon = True
        timer.start()
        if self.stage is not Stage.RUNNING:
            self.stop.set()

    def execute(self) -> Outcome:
        """`prepare`, then RUNNING: a warm sandbox serving shards until none is left."""
        mapped = self.prepare()
        if isinstance(mapped, Outcome):
            return mapped
        self.enter(Stage.RUNNING)
        spec, lease = self.spec, self.lease
        assert spec.command is not None  # the spec refuses sharded jobs without one
        command = ("python3", "-m", "campugrid.hooks.shard_runner", spec.shard_mode, "--",
                   *spec.command)
        # No host folder is writable here: shards leave results, and write only to the
        # sandbox's size-bounded /tmp (so no disk watchdog is needed).
        env = {k: v for k, v in self.job_env().items()
               if k not in ("CAMPUGRID_OUTPUT", "CAMPUGRID_CHECKPOINT_DIR")}
        run_log = self.shipper.for_stream("run")
        request = self.run_request(command, env, mapped, writable=False)
        # The runner's lines are read by one confined child for the whole session.
        self.reader = confine.Worker(READER_LIMITS)
        with self.reader:
            _, ran, sandboxes, failed = self._sessions(request, run_log, lease.shard)
        if failed is not None:
            return failed
        self.shipper.line("run", f"[campugrid] session {lease.fencing_token}: {ran} shards run "
                                 f"in {sandboxes} sandbox{'es' if sandboxes > 1 else ''}")
        return Outcome(succeeded=True, exit_code=0)

    def _sessions(self, request: RunRequest, run_log: LogFn, shard: ShardTask | None
                  ) -> tuple[ShardTask | None, int, int, Outcome | None]:
        """Sandboxes one after another until no shard is left (a failure to start the first
        one fails the job)."""
        ran = sandboxes = 0
        while shard is not None and not self.stop.is_set():
            # A sandbox that dies under a shard (out of memory, a crash) fails that shard,
            # not the machine: the next shard gets a fresh sandbox.
            sandboxes += 1
            began = time.monotonic()
            with self.sandbox.session(request, log=run_log) as box:
                if not self._wait_ready(box):
                    if ran or self.stop.is_set():  # it started before: not the image's fault
                        self.hand_over("the shard sandbox did not start again")
                        break
                    return shard, ran, sandboxes, Outcome(
                        succeeded=False, exit_code=-1,
                        reason="the shard runner did not start in the sandbox: sharded jobs "
                               f"need python3 in the image (it runs {HOOKS_MOUNT}/campugrid/"
                               "hooks/shard_runner.py); last lines:\n"
                               + "\n".join(list(box.tail)[-10:]))
                METRICS.sandbox_start_seconds.labels("session").observe(time.monotonic() - began)
                shard, ran = self._serve(box, shard, ran)
        return shard, ran, sandboxes, None

    def _read(self, line: bytes) -> dict[str, object]:
        try:
            return self.reader.call(runner_lines.parse, line)
        except confine.ConfinementError as e:
            return {"unreadable": str(e)}

    def _serve(self, box: Session, shard: ShardTask | None,
               ran: int) -> tuple[ShardTask | None, int]:
        """Shards through one sandbox until none is left, the task stops, or the sandbox
        dies (then: the next shard, to run in a new one)."""
        lease = self.lease
        while shard is not None and not self.stop.is_set():
            done = self._run_one(box, shard)
            died = done is None
            if done is None:
                if self.stop.is_set():
                    break
                done = ShardResult(
                    index=shard.index, succeeded=False, exit_code=-1,
                    reason="the sandbox stopped during this shard (out of memory? "
                           f"resources.memory_mb is {self.spec.resources.memory_mb}); "
                           "last lines:\n" + "\n".join(list(box.tail)[-5:]))
            ran += 1
            reply = retry(lambda d=done: self.client.next_shard(  # type: ignore[misc]
                lease.hold, d))
            if not reply.accepted:
                log.info("session %d of %s is over: %s", lease.fencing_token, lease.job_id,
                         reply.reason)
                self.lost.set()
                return None, ran
            shard = reply.shard
            if shard is not None and self.handover:
                return None, ran  # the shard in hand goes back with the session (Release)
            if died:
                break
        return shard, ran

    def _wait_ready(self, box: Session) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            line = box.receive(0.5)
            if line is None:
                return False
            msg = self._read(line)
            if msg.get("ready") is True:
                return True
        return False

    def _run_one(self, box: Session, shard: ShardTask) -> ShardResult | None:
        """Send one shard to the runner and wait for its answer (None if none comes)."""
        wall = float(self.spec.resources.wall_time_s)
        if not box.send(json.dumps({"index": shard.index, "payload_json": shard.payload_json,
                                    "timeout_s": wall}).encode()):
            return None
        run_log = self.shipper.for_stream("run")
        deadline = time.monotonic() + wall + 30  # the runner enforces wall; this backs it up
        while not self.stop.is_set():
            if time.monotonic() > deadline:
                return ShardResult(index=shard.index, succeeded=False, exit_code=-1,
                                   reason=f"no answer within the wall time of {wall:.0f} s")
            line = box.receive(0.25)
            if line is None:
                return None
            if not line:
                continue
            msg = self._read(line)
            if "unreadable" in msg:
                return ShardResult(index=shard.index, succeeded=False, exit_code=-1,
                                   reason=f"the shard runner's answer could not be read: "
                                          f"{msg['unreadable']}"[:2000])
            if "log" in msg:
                run_log(str(msg["log"])[:MAX_SHARD_RESULT])
            elif msg.get("done") == shard.index:
                return _result(shard.index, msg)
        return None


def _result(index: int, msg: dict[str, object]) -> ShardResult:
    """A "done" message (already read by runner_lines.parse) as the result to report."""
    result = msg.get("result")
    text = result if isinstance(result, str) else ""
    ok = msg.get("ok") is True and "result_error" not in msg
    reason = str(msg.get("result_error") or msg.get("error") or "")[:2000]
    code = msg.get("exit")
    return ShardResult(index=index, succeeded=ok,
                       exit_code=code if isinstance(code, int) and -2**31 <= code < 2**31 else -1,
                       result_json=text, reason=reason)
