"""A Runtime that runs nothing: what the "job" does comes from its env, as Nomad's mock
driver takes it from the task config, so tests describe faults as data.

    FAKE_START_ERROR=text  the sandbox cannot start: SandboxError (exit 125, text)
    FAKE_STDOUT=lines      printed at start (one line per "\\n")
    FAKE_WRITE_MB=n        n MB written to /output/fake-output.bin at start; past
                           RunRequest.file_mb the job dies of SIGXFSZ (exit 153)
    FAKE_RUN_FOR=s         runs s seconds (past the wall time: it is stopped)
    FAKE_EXIT_CODE=n       then exits n (default 0)
    FAKE_OOM=1             then is killed for memory (oom_killed, exit -9)
    FAKE_ON_TERM=n         exits n on SIGTERM (default 143: TERM kills it)
    FAKE_VANISH_AFTER=s    the sandbox is removed from outside after s seconds

The exit codes are the ones podman+runsc gives for the same events here; the contract test
(tests/integration/test_runtime_contract.py) holds both to the same cases.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import queue
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from campugrid.protocol.errors import SandboxError
from campugrid.protocol.spec import ENFORCED
from campugrid.sandbox.limits import HostLimits
from campugrid.sandbox.process import LogFn
from campugrid.sandbox.runtime import RunRequest, RunResult, Runtime

PREFIX = "FAKE_"  # not CAMPUGRID_: a job spec may not set those
OUTPUT_FILE = "fake-output.bin"
KILLED = 128 + signal.SIGKILL  # what podman reports for a sandbox killed or removed under it
STOPPED = -signal.SIGKILL  # run_streaming's code for the podman it killed (wall time, cancel)
TICK_S = 0.01


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the fake job does, read from its env."""

    start_error: str = ""
    stdout: tuple[str, ...] = ()
    write_mb: int = 0
    run_for: float = 0.0
    exit_code: int = 0
    oom: bool = False
    on_term: int = 128 + signal.SIGTERM
    vanish_after: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Plan:
        def get(key: str) -> str | None:
            return env.get(PREFIX + key)

        vanish = get("VANISH_AFTER")
        return cls(start_error=get("START_ERROR") or "",
                   stdout=tuple((get("STDOUT") or "").splitlines()),
                   write_mb=int(get("WRITE_MB") or 0), run_for=float(get("RUN_FOR") or 0),
                   exit_code=int(get("EXIT_CODE") or 0), oom=get("OOM") == "1",
                   on_term=int(get("ON_TERM") or 128 + signal.SIGTERM),
                   vanish_after=float(vanish) if vanish else None)


def env(**directives: object) -> dict[str, str]:
    """The env that makes the fake do that: env(exit_code=3, stdout="hi")."""
    return {PREFIX + k.upper(): str(v) for k, v in directives.items()}


class _Box:
    """One running fake sandbox: what the runtime's verbs tell it."""

    def __init__(self, req: RunRequest) -> None:
        self.req = req
        self.stopped = threading.Event()
        self.killed = threading.Event()
        self.signals: queue.Queue[str] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)


class FakeRuntime:
    """The Runtime protocol, in memory. `images`, if given, is the image store it shares
    with a fake builder: an image not in it cannot start (as podman's "image not known")."""

    name = "fake"

    def __init__(self, images: set[str] | None = None, limits: HostLimits | None = None,
                 scope: str = "") -> None:
        self.images = images
        self.limits = limits or HostLimits(memory=ENFORCED, cpu=ENFORCED, pids=ENFORCED)
        self.seccomp: Path | None = None
        self.scope = scope
        self.runs: list[RunRequest] = []  # every request, in order
        self.signals: list[tuple[str, str]] = []
        self.killed: list[str] = []
        self.removed_images: list[str] = []
        self._boxes: dict[str, _Box] = {}
        self._lock = threading.Lock()
        self.ops = FakeOps(self)

    def describe(self) -> str:
        return "fake runtime"

    def gpu_isolation_note(self) -> str:
        return "the fake runtime passes no GPUs"

    def _start(self, req: RunRequest) -> tuple[Plan, _Box]:
        plan = Plan.from_env(dict(req.env))
        self.runs.append(req)
        if self.images is not None and req.image not in self.images:
            raise SandboxError("the sandbox could not start (exit 125)", exit_code=125,
                               stderr_tail=f"Error: {req.image}: image not known")
        if plan.start_error:
            raise SandboxError("the sandbox could not start (exit 125)", exit_code=125,
                               stderr_tail=plan.start_error)
        box = _Box(req)
        with self._lock:
            if req.name in self._boxes:
                raise SandboxError(f"the sandbox could not start: the name {req.name} is "
                                   "already in use", exit_code=125)
            self._boxes[req.name] = box
        return plan, box

    def _end(self, box: _Box) -> None:
        with self._lock:
            if self._boxes.get(box.req.name) is box:
                del self._boxes[box.req.name]

    def run(self, req: RunRequest, *, log: LogFn,
            cancel: threading.Event | None = None) -> RunResult:
        plan, box = self._start(req)
        try:
            code, timed_out, cancelled, oom = self._live(plan, box, log, cancel)
        finally:
            self._end(box)
        return RunResult(code, timed_out, cancelled, oom, "\n".join(box.tail),
                         self.limits.as_dict())

    def _live(self, plan: Plan, box: _Box, log: LogFn,
              cancel: threading.Event | None) -> tuple[int, bool, bool, bool]:
        """(exit code, timed out, cancelled, oom killed), as podman+runsc reports them."""
        def say(line: str) -> None:
            box.tail.append(line)
            log(line)

        for line in plan.stdout:
            say(line)
        req, start = box.req, time.monotonic()
        if plan.write_mb and req.output_dir is not None:
            allowed = plan.write_mb if req.file_mb is None else min(plan.write_mb, req.file_mb)
            with open(req.output_dir / OUTPUT_FILE, "wb") as f:
                for _ in range(allowed):
                    f.write(b"\0" * 1024 * 1024)
            if allowed < plan.write_mb:
                return 128 + signal.SIGXFSZ, False, False, False
        deadline = start + req.wall_time_s
        vanish = start + plan.vanish_after if plan.vanish_after is not None else None
        while True:
            now = time.monotonic()
            if cancel is not None and cancel.is_set():
                return STOPPED, False, True, False
            if now >= deadline:
                return STOPPED, True, False, False
            if box.killed.is_set() or box.stopped.is_set():
                return KILLED, False, False, False
            if vanish is not None and now >= vanish:
                box.stopped.set()
                continue
            with contextlib.suppress(queue.Empty):
                sig = box.signals.get_nowait()
                if sig in ("TERM", "SIGTERM", "15"):
                    return plan.on_term, False, False, False
                if sig in ("KILL", "SIGKILL", "9"):
                    return KILLED, False, False, False
            if now - start >= plan.run_for:
                if plan.oom and self.limits.memory == ENFORCED:
                    return STOPPED, False, False, True
                return plan.exit_code, False, False, False
            box.stopped.wait(TICK_S)

    @contextlib.contextmanager
    def session(self, req: RunRequest, *, log: LogFn) -> Iterator[FakeSession]:
        """A shard runner that says it is ready and answers each shard with its payload."""
        _, box = self._start(req)
        try:
            yield FakeSession(box, log)
        finally:
            self._end(box)

    def _box(self, name: str) -> _Box | None:
        with self._lock:
            return self._boxes.get(name)

    def signal(self, name: str, sig: str = "TERM") -> None:
        self.signals.append((name, sig))
        box = self._box(name)
        if box is not None:
            box.signals.put(sig)

    def stop(self, name: str) -> None:
        box = self._box(name)
        if box is not None:
            box.stopped.set()

    def kill(self, name: str) -> None:
        self.killed.append(name)
        box = self._box(name)
        if box is not None:
            box.killed.set()
            box.stopped.set()

    def exists(self, name: str) -> bool:
        return self._box(name) is not None

    def processes(self, name: str) -> frozenset[int]:
        """The fake sandbox runs in this process: none of the host's processes are its."""
        return frozenset()

    def sweep(self, label_value: str) -> list[str]:
        with self._lock:
            names = [n for n, b in self._boxes.items() if b.req.agent == label_value]
        for name in names:
            self.stop(name)
        return names

    def sweep_images(self, prefix: str, keep: str = "") -> list[str]:
        gone = sorted(i for i in self.images or () if i.startswith(prefix) and i != keep)
        for image in gone:
            self.remove_image(image)
        return gone

    def remove_image(self, image: str) -> bool:
        self.removed_images.append(image)
        if self.images is not None:
            self.images.discard(image)
        return True


class FakeOps:
    """The PodmanOps protocol over FakeRuntime's store: its images (each `IMAGE_BYTES`, with
    the ENV `env` gives it, an ID and one layer; a tag names the same image) and its
    sandboxes by name.
    tests/integration/test_podman_ops.py holds it to the same image cases as Podman."""

    IMAGE_BYTES = 1024**2

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.env: dict[str, list[str]] = {}  # image -> its ENV, where a test sets one
        self._ids: dict[str, str] = {}  # a name given by `tag` -> the image's ID

    def _has(self, ref: str) -> bool:
        return self.runtime.images is not None and ref in self.runtime.images

    def state(self, name: str) -> dict[str, Any] | None:
        if self.runtime._box(name) is None:  # a fake sandbox is gone once it ends
            return None
        return {"Running": True, "ExitCode": 0, "StartedAt": "", "ConmonPid": 0}

    def kill(self, name: str, signal: str) -> None:
        self.runtime.signal(name, signal)

    def remove(self, name: str) -> None:
        self.runtime.kill(name)

    def labelled(self, key: str, value: str) -> list[str]:
        with self.runtime._lock:
            return sorted(n for n, b in self.runtime._boxes.items()
                          if key == "campugrid.agent" and b.req.agent == value)

    def images(self) -> list[str]:
        return sorted(self.runtime.images or ())

    def image_size(self, ref: str) -> int | None:
        return self.IMAGE_BYTES if self._has(ref) else None

    def image_layers(self, ref: str) -> list[str] | None:
        found = self.image_id(ref)
        return [f"sha256:{found}"] if found is not None else None

    def image_env(self, ref: str) -> list[str] | None:
        return list(self.env.get(ref, [])) if self._has(ref) else None

    def image_id(self, ref: str) -> str | None:
        if not self._has(ref):
            return None
        return self._ids.get(ref) or hashlib.sha256(ref.encode()).hexdigest()

    def layer_index(self) -> list[Path]:
        return []

    def image_file(self, ref: str, path: str, max_bytes: int) -> bytes | None:
        return None

    def tag(self, ref: str, new: str) -> None:
        if not self._has(ref):
            raise SandboxError(f"podman tag {ref}: image not known")
        assert self.runtime.images is not None
        self._ids[new] = self.image_id(ref) or ""
        self.runtime.images.add(new)
        self.env.setdefault(new, self.env.get(ref, []))

    def remove_image(self, ref: str) -> bool:
        if self._has(ref):
            self.runtime.remove_image(ref)
        return True


class FakeSession:
    """The Session protocol for FakeRuntime.session: a well-behaved shard runner."""

    def __init__(self, box: _Box, log: LogFn) -> None:
        self.box, self.log = box, log
        self._out: queue.Queue[bytes] = queue.Queue()
        self._out.put(json.dumps({"ready": True}).encode())

    @property
    def tail(self) -> collections.deque[str]:
        return self.box.tail

    def send(self, line: bytes) -> bool:
        if self.box.stopped.is_set():
            return False
        shard = json.loads(line)
        self._out.put(json.dumps({"done": shard["index"], "ok": True, "exit": 0,
                                  "result": shard.get("payload_json", "")}).encode())
        return True

    def receive(self, timeout_s: float) -> bytes | None:
        if self.box.stopped.is_set():
            return None
        try:
            return self._out.get(timeout=timeout_s)
        except queue.Empty:
            return b""


if TYPE_CHECKING:  # mypy holds the fake to the protocol
    _conforms: Runtime = FakeRuntime()
