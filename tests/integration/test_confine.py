"""Confined children as the agent runs them: as the unprivileged provider user, from a process
with gRPC and other threads running."""

from __future__ import annotations

import pytest

from campugrid.cli.platform import ProviderUser
from tests.support.provider import run_as_provider

pytestmark = pytest.mark.integration

SCRIPT = r"""
import json, os, resource, socket, threading, time
from pathlib import Path
import grpc
from campugrid.sandbox import confine
from campugrid.sandbox.confine import ConfinementError

grpc.insecure_channel("127.0.0.1:9")  # like the agent: gRPC loaded, other threads running
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

def attempt(fn, *args, **kw):
    try:
        return {"value": confine.call(fn, *args, **kw)}
    except ConfinementError as e:
        return {"cause": e.cause, "error": str(e)}

mem = f"/proc/{os.getpid()}/mem"
home = Path.home()
print(json.dumps({
    "layers": confine.layers(),
    "pid": attempt(os.getpid),
    "connect": attempt(socket.create_connection, ("127.0.0.1", 22)),
    "raise_rlimit": attempt(resource.setrlimit, resource.RLIMIT_DATA,
                            (resource.RLIM_INFINITY, resource.RLIM_INFINITY)),
    "parent_memory": attempt(os.open, mem, os.O_RDONLY),
    "parent_memory_without_landlock": attempt(os.open, mem, os.O_RDONLY, _skip={"landlock"}),
    "write_home": attempt(os.open, str(home / ".confine-test"), os.O_WRONLY | os.O_CREAT),
    "home_untouched": not (home / ".confine-test").exists(),
}))
"""


def test_confinement_holds_for_the_provider_user(provider: ProviderUser):
    out = run_as_provider(provider, SCRIPT, timeout=120)
    assert out["pid"]["value"] > 0
    assert out["connect"]["cause"] == "seccomp", out["connect"]
    # Unprivileged, the child cannot undo its limits.
    assert out["raise_rlimit"]["cause"] == "exception"
    assert "ValueError" in out["raise_rlimit"]["error"]
    if not out["layers"]["landlock"].startswith("enforced"):
        pytest.skip("this kernel has no Landlock: " + out["layers"]["landlock"])
    # Without Yama, any process of the same user may open the agent's memory; a seccomp filter
    # cannot see which file open() names. Landlock's domain is what stops it.
    assert isinstance(out["parent_memory_without_landlock"]["value"], int)
    assert "PermissionError" in out["parent_memory"]["error"]
    assert "PermissionError" in out["write_home"]["error"]
    assert out["home_untouched"]
