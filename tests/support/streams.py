"""Driving a coordinator's agent streams from a test: the agent's own link
(campugrid.agent.link) for a machine, each test's own event loop, and the fleet it joins."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from campugrid.agent.client import CoordinatorClient
from campugrid.agent.link import Link
from campugrid.coordinator import server
from campugrid.coordinator.fleet import Fleet
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import keys

T = TypeVar("T")
OFFER = pb.LeaseRequest(hold_kinds=True, cpus=4, memory_mb=8192, disk_mb=50_000)


def link_of(running: server.Running, c: CoordinatorClient,
            key: keys.Ed25519PrivateKey | None = None) -> Link:
    """A stream of c's machine, signed by its key (or by `key`)."""
    return Link(running.grpc_address, running.certificate.pem.decode(), key or c.key,
                c.machine_id)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """On a loop of its own (each test's)."""
    return asyncio.run(coroutine)


def wait_until(check: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def running_fleet(running: server.Running) -> Fleet:
    assert running.service is not None
    return running.service.fleet
