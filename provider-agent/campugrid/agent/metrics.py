"""The agent's Prometheus metrics, served on 127.0.0.1 only, to a bearer token of which the
agent keeps only the SHA-256 in its state folder (`campugrid provider metrics-token`).

One registry per agent process (METRICS): its CPU and memory are the process's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from campugrid.agent import gpus
from campugrid.agent.gpus import GpuPolicy
from campugrid.protocol.errors import CampugridError

log = logging.getLogger("campugrid.agent.metrics")
METRICS_PORT = 8752  # `campugrid agent run --metrics-port`; 0: not served
TOKEN_FILE = "metrics-token.sha256"  # noqa: S105 - where its digest is kept
TOKEN_PREFIX = "cga_"  # noqa: S105 - a prefix that names the kind, not a secret
MB = 1024 * 1024
SECONDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0)


class AgentMetrics:
    """What the agent's work takes: checkpoints, builds, sandbox starts, GPU memory."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.checkpoint_bytes = Counter("campugrid_agent_checkpoint_bytes",
                                        "Bytes of checkpoints uploaded and recorded", registry=r)
        self.checkpoint_upload_seconds = Histogram(
            "campugrid_agent_checkpoint_upload_seconds",
            "From asking to upload a checkpoint to the coordinator recording it",
            buckets=SECONDS, registry=r)
        self.build_seconds = Histogram("campugrid_agent_build_seconds",
                                       "A task's image ready (built here, pulled or cached), "
                                       "by outcome (ok, failed)", ["outcome"],
                                       buckets=SECONDS, registry=r)
        # Tasks that did not build: the image was in this machine's cache (source=cache) or
        # pulled by digest from the registry (source=registry).
        self.build_cache_hits = Counter("campugrid_agent_build_cache_hits",
                                        "Builds answered from an image already built, by where "
                                        "it came from (cache, registry)", ["source"],
                                        registry=r)
        self.sandbox_start_seconds = Histogram(
            "campugrid_agent_sandbox_start_seconds",
            "From launching a sandbox to it running: kind=run (the runtime's start event), "
            "kind=session (a shard sandbox's runner ready)", ["kind"], buckets=SECONDS,
            registry=r)
        self.gpus = _Gpus()
        r.register(self.gpus)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes


class _Gpus(Collector):
    """Each offered GPU's memory, asked of NVML at scrape time (so it is current during a
    task too), and what the running task reserved on it."""

    def __init__(self) -> None:
        self.policy: GpuPolicy | None = None  # None: no agent here, nothing to report
        self.reserved: dict[str, int] = {}  # uuid -> MB the running task holds
        self.nvml: Any = None  # the NVML module (None: pynvml, where there is a driver)

    def hold(self, uuids: Iterable[str], memory_mb: int) -> None:
        self.reserved = {uuid: memory_mb for uuid in uuids}

    def collect(self) -> Iterator[Metric]:
        if self.policy is None:
            return
        labels = ["gpu", "name"]
        free = GaugeMetricFamily("campugrid_agent_gpu_free_bytes", "GPU memory free to offer "
                                 "(after other processes and the owner's reserve)", labels=labels)
        total = GaugeMetricFamily("campugrid_agent_gpu_total_bytes", "GPU memory", labels=labels)
        held = GaugeMetricFamily("campugrid_agent_gpu_reserved_bytes",
                                 "GPU memory the running task reserved", labels=labels)
        reserved = self.reserved
        for g in gpus.discover(self.policy, self.nvml).gpus:
            free.add_metric([g.uuid, g.name], g.memory_free_mb * MB)
            total.add_metric([g.uuid, g.name], g.memory_total_mb * MB)
            held.add_metric([g.uuid, g.name], reserved.get(g.uuid, 0) * MB)
        yield from (free, total, held)


METRICS = AgentMetrics()


# --- the token: minted by the owner, checked by the server ------------------------------------

def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def mint_token(state_dir: Path) -> str:
    """A new token for the agent's /metrics; the one before it stops working. Only its
    SHA-256 is written (0600), which the running agent reads at every request."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    tmp = state_dir / (TOKEN_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(digest(token) + "\n")
    os.replace(tmp, state_dir / TOKEN_FILE)
    return token


def allowed(authorization: str, token_file: Path) -> bool:
    """Whether `Authorization: Bearer …` carries the token whose digest is in `token_file`."""
    scheme, _, token = authorization.strip().partition(" ")
    try:
        stored = token_file.read_text().strip()
    except OSError:
        return False  # no token minted yet: nobody may scrape
    return (scheme.lower() == "bearer" and bool(token.strip()) and len(stored) == 64
            and hmac.compare_digest(digest(token.strip()), stored))


class Guarded:
    """WSGI: GET /metrics of `app` for a request with the token; 401 or 404 for the rest."""

    def __init__(self, app: WSGIApplication, token_file: Path) -> None:
        self.app, self.token_file = app, token_file

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"only /metrics here\n"]
        if not allowed(str(environ.get("HTTP_AUTHORIZATION", "")), self.token_file):
            start_response("401 Unauthorized", [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="campugrid agent"')])
            return [b"a scrape token is needed (Authorization: Bearer ...): the machine's "
                    b"owner prints one with `campugrid provider metrics-token`\n"]
        return self.app(environ, start_response)


# --- the server ---------------------------------------------------------------------------

class _Threading(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the agent's exit


class _Threading6(_Threading):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # scrapes every 15 s would drown the agent's log


@dataclasses.dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name could resolve anywhere


def serve(state_dir: Path, port: int, *, host: str = "127.0.0.1",
          registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve /metrics on `host` (a loopback address, never another) and `port` (0: any free
    one) in a daemon thread, to requests with the token minted in `state_dir`."""
    if not is_loopback(host):
        raise CampugridError(f"the agent serves /metrics on a loopback address only, not {host!r}: "
                             "a scraper elsewhere reaches it through a tunnel or a local proxy")
    app = Guarded(make_wsgi_app(registry or METRICS.registry), state_dir / TOKEN_FILE)
    try:
        server = make_server(host, port, app, handler_class=_Quiet,
                             server_class=_Threading6 if ":" in host else _Threading)
    except OSError as e:
        raise CampugridError(f"cannot serve /metrics on {host}:{port}: {e.strerror or e}") from e
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="metrics")
    thread.start()
    return MetricsServer(server, thread)
