from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.client import Api


@contextlib.contextmanager
def a_platform(agent: str = "acceptance-agent") -> Iterator[Platform]:
    """The whole platform as `campugrid up` starts it, with one agent as the provider user;
    the agent's last log lines are printed when it stops."""
    root = Path(tempfile.mkdtemp(prefix="campugrid-acc-"))
    os.chmod(root, 0o711)
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    try:
        p.start_agent(agent)
        yield p
    finally:
        p.stop()
        log = root / "state" / "agents" / f"{agent}.log"
        if log.exists():
            print("--- agent log (tail) ---\n" + "\n".join(log.read_text().splitlines()[-40:]))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def platform() -> Iterator[Platform]:
    with a_platform() as p:
        yield p


@pytest.fixture
def api(platform: Platform) -> Iterator[Api]:
    with platform.api() as client:
        yield client
