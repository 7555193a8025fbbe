"""Drive any sandbox Runtime through one case and read back what happened, the same way for
the fake (in this process) and for podman+runsc (in a script run as the provider user)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from campugrid.cli.platform import ProviderUser
from campugrid.protocol.errors import SandboxError
from campugrid.sandbox.runtime import RunRequest, Runtime

REPO = Path(__file__).resolve().parents[2]
READY = "ready"  # a case's job prints this once it is up: the action comes after it


def gvisor_kernel(release: str) -> bool:
    """The kernel release gVisor reports: 4.4.0 until 2024, `<version>-gvisor` since (the runsc
    built from its Go module: runsc-from-go.sh). The host's never looks like either here."""
    return release == "4.4.0" or release.endswith("-gvisor")


def drive(runtime: Runtime, req: RunRequest, action: str = "", after_s: float = 0.0) -> dict[str, Any]:
    """Run `req`; `action` (cancel, stop, kill, term, processes) comes `after_s` after the job
    says READY. `processes` notes the sandbox's host processes (pid, name), then cancels."""
    cancel = threading.Event()
    lines: list[str] = []
    fired = threading.Event()
    seen: list[tuple[int, str]] = []

    def act() -> None:
        if action == "cancel":
            cancel.set()
        elif action == "processes":
            seen[:] = [(pid, _name(pid)) for pid in sorted(runtime.processes(req.name))]
            cancel.set()
        elif action == "term":
            runtime.signal(req.name, "TERM")
        else:
            getattr(runtime, action)(req.name)

    def on_line(line: str) -> None:
        lines.append(line)
        if action and line == READY and not fired.is_set():
            fired.set()
            timer = threading.Timer(after_s, act)
            timer.daemon = True
            timer.start()

    t0 = time.monotonic()
    try:
        res = runtime.run(req, log=on_line, cancel=cancel)
        out: dict[str, Any] = dataclasses.asdict(res) | {"error": None}
    except SandboxError as e:
        out = {"error": {"reason": e.reason, "exit_code": e.exit_code, "stderr_tail": e.stderr_tail}}
    if action == "kill":
        runtime.stop(req.name)  # as the agent's task does after a kill
    return out | {"lines": lines, "seconds": time.monotonic() - t0,
                  "still_exists": runtime.exists(req.name), "fired": fired.is_set(),
                  "processes": seen, "processes_after": sorted(runtime.processes(req.name)),
                  "driver_pid": os.getpid()}


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def request_from_json(args: dict[str, Any]) -> RunRequest:
    args = dict(args)
    for key in ("output_dir", "data_dir"):
        args[key] = Path(args[key]) if args.get(key) else None
    args["command"] = tuple(args["command"]) if args.get("command") else None
    args["env"] = tuple(tuple(e) for e in args.get("env", ()))
    return RunRequest(**args)


def request_to_json(req: RunRequest) -> dict[str, Any]:
    out = dataclasses.asdict(req)
    for key in ("output_dir", "data_dir"):
        out[key] = str(out[key]) if out[key] is not None else None
    return out


REAL_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[2])
from campugrid.sandbox import limits
from campugrid.sandbox.podman_ops import CliOps
from campugrid.sandbox.podman_runsc import PodmanRunsc
from tests.support.runtimes import drive, request_from_json
args = json.loads(sys.argv[1])
runtime = PodmanRunsc(scope="a-contract-tests", ops=CliOps() if args["ops"] == "cli" else None)
try:
    out = drive(runtime, request_from_json(args["request"]), args["action"], args["after_s"])
    out["ops"] = type(runtime.ops).__name__
finally:
    limits.sweep(runtime.limits, runtime.scope)
    runtime.close()
print(json.dumps(out))
"""


def drive_as_provider(user: ProviderUser, req: RunRequest, action: str = "",
                      after_s: float = 0.0, ops: str = "api") -> dict[str, Any]:
    """Run the case in the real runtime, as the provider user; `ops` is how the runtime asks
    Podman its questions: "api" (podman-py on its own service) or "cli"."""
    args = {"request": request_to_json(req), "action": action, "after_s": after_s, "ops": ops}
    proc = subprocess.run(user.command([sys.executable, "-c", REAL_SCRIPT, json.dumps(args),
                                        str(REPO)]),
                          capture_output=True, text=True, timeout=req.wall_time_s + 120, cwd="/")
    if proc.returncode != 0:
        raise AssertionError(f"runtime script failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("ops") == {"api": "ApiOps", "cli": "CliOps"}[ops], result
    return result
