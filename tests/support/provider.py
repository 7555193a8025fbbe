"""Run Python as the unprivileged provider user, as the agent does, and read back JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from campugrid.cli.platform import ProviderUser


def run_as_provider(user: ProviderUser, script: str, timeout: float = 300) -> Any:
    """Run `script` as the provider user; its last stdout line must be JSON."""
    proc = subprocess.run(user.command([sys.executable, "-c", textwrap.dedent(script)]),
                          capture_output=True, text=True, timeout=timeout, cwd="/")
    if proc.returncode != 0:
        raise AssertionError(f"provider script failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


SANDBOX_SCRIPT = """
import dataclasses, json, sys, threading, time
from pathlib import Path
from campugrid.sandbox.podman_runsc import PodmanRunsc
from campugrid.sandbox.runtime import RunRequest
args = json.loads(sys.argv[1])
cancel = threading.Event()
cancel_after = args.pop("cancel_after", None)
if cancel_after is not None:
    threading.Timer(cancel_after, cancel.set).start()
for k in ("output_dir", "data_dir"):
    if args.get(k):
        args[k] = Path(args[k])
args["command"] = tuple(args["command"]) if args.get("command") else None
args["env"] = tuple(tuple(e) for e in args.get("env", ()))
sandbox = PodmanRunsc()
lines = []
t0 = time.monotonic()
res = sandbox.run(RunRequest(**args), log=lines.append, cancel=cancel)
out = dataclasses.asdict(res)
out.update(lines=lines, seconds=time.monotonic() - t0, still_exists=sandbox.exists(args["name"]))
print(json.dumps(out))
"""

DEFAULT_IMAGE = "localhost/campugrid/python:bookworm"


def sandbox_run(user: ProviderUser, *, name: str, command: list[str], output_dir: str,
                data_dir: str | None = None, memory_mb: int = 512, cpus: float = 1.0,
                tmp_mb: int = 64, wall_time_s: int = 120, env: tuple = (),
                cancel_after: float | None = None, image: str = DEFAULT_IMAGE) -> Any:
    args = {"name": name, "image": image, "command": command, "env": list(env),
            "output_dir": output_dir, "data_dir": data_dir, "memory_mb": memory_mb,
            "cpus": cpus, "tmp_mb": tmp_mb, "wall_time_s": wall_time_s}
    if cancel_after is not None:
        args["cancel_after"] = cancel_after
    proc = subprocess.run(user.command([sys.executable, "-c", SANDBOX_SCRIPT, json.dumps(args)]),
                          capture_output=True, text=True, timeout=wall_time_s + 120, cwd="/")
    if proc.returncode != 0:
        raise AssertionError(f"sandbox script failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


BUILD_SCRIPT = """
import json, sys
from pathlib import Path
from campugrid.builders.buildah import BuildahBuilder
from campugrid.protocol.errors import BuildFailed
args = json.loads(sys.argv[1])
lines = []
builder = BuildahBuilder(scope="a-integration-tests")
out = {"limits": builder.limits.as_dict()}
try:
    builder.build(Path(args["context"]), args["tag"], log=lines.append, timeout_s=args["timeout_s"],
                  memory_mb=args["memory_mb"], disk_mb=args["disk_mb"],
                  volumes=[(Path(h), i) for h, i in args["volumes"]])
    out.update(ok=True)
except BuildFailed as e:
    out.update(ok=False, reason=e.reason, tail=e.log_tail)
out["lines"] = lines
from campugrid.sandbox import limits
limits.sweep(builder.limits, builder.scope)  # as the agent does after every task
print(json.dumps(out))
"""


def buildah_build(user: ProviderUser, context: str, tag: str, *, timeout_s: float = 300,
                  memory_mb: int = 1024, disk_mb: int = 512,
                  volumes: list[tuple[str, str]] | None = None) -> Any:
    args = {"context": context, "tag": tag, "timeout_s": timeout_s, "memory_mb": memory_mb,
            "disk_mb": disk_mb, "volumes": volumes or []}
    proc = subprocess.run(user.command([sys.executable, "-c", BUILD_SCRIPT, json.dumps(args)]),
                          capture_output=True, text=True, timeout=timeout_s + 120, cwd="/")
    if proc.returncode != 0:
        raise AssertionError(f"build script failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

# Inside a sandbox or a RUN step: which of these system calls get through (seccomp).
SYSCALLS = r"""
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
import os, select
r, w = os.pipe()
try:
    select.select([r], [], [], 0.01)  # this runsc's translation of Podman's profile broke it
    selected = "ok"
except OSError as e:
    selected = errno.errorcode.get(e.errno, "?")
print(json.dumps({"select": selected, "unshare": call(272, 0x10000000), "ptrace": call(101, 0, 0, 0, 0),
                  "keyctl": call(250, 0, 0, 0, 0), "bpf": call(321, 0, 0, 0),
                  "getpid": call(39)}))
"""
