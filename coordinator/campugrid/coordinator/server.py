"""Run the coordinator: REST (uvicorn) and gRPC in one process, plus the lease reaper.

gRPC is always TLS, with the coordinator's own certificate (tls.py) that agents pin; REST is
TLS too unless it listens on a loopback address only. On first start the local user gets an
admin identity (a key made here, of which the database keeps the public half only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import gc
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Coroutine
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
import uvicorn

from campugrid.coordinator.agent_calls import AboutJob, SignedCalls
from campugrid.coordinator.agent_service import AgentService
from campugrid.coordinator.api import create_app
from campugrid.coordinator.auth import Guard, RateLimits
from campugrid.coordinator.config import Settings
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.leader import Leadership, leadership
from campugrid.coordinator.mirrors import MirrorTokens, egress_check
from campugrid.coordinator.objects import S3Store
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.services.supplies import Supplies
from campugrid.coordinator.store import Store
from campugrid.coordinator.tls import Certificate, ensure_certificate
from campugrid.coordinator.wakeup import PostgresRelay, relay
from campugrid.egress.policy import Policy
from campugrid.egress.proxy import EgressProxy, Record, Serving
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol import keys
from campugrid.protocol.errors import CampugridError
from campugrid.protocol.identities import Identity
from campugrid.protocol.identities import default_path as default_identity

log = logging.getLogger("campugrid.coordinator")
T = TypeVar("T")


class AgentServer:
    """The agents' gRPC server, on grpc.aio in an event loop of its own (a thread). A call
    whose handler is a coroutine runs on the loop, where thousands can wait at almost no
    cost (Connect, an idle machine's stream); the others are plain functions and run on a pool of
    `workers` threads, as on grpcio's threaded server."""

    def __init__(self, workers: int, interceptors: list[grpc.aio.ServerInterceptor],
                 blocking: futures.Executor) -> None:
        """`blocking`: where coroutine handlers block (shut down with the server)."""
        self.blocking = blocking
        self._tasks: list[asyncio.Task[None]] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="grpc-loop")
        self._thread.start()
        self.pool = pool = futures.ThreadPoolExecutor(max_workers=workers,
                                                      thread_name_prefix="grpc-call")

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(migration_thread_pool=pool, interceptors=interceptors)

        self.server = self._run(make())

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return int(self.server.add_secure_port(address, credentials))

    def start(self) -> None:
        self._run(self.server.start())

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """A task on the server's loop, until the server stops (the fleet's dispatcher)."""
        async def started() -> None:
            self._tasks.append(asyncio.get_running_loop().create_task(coroutine))
        self._run(started())

    async def _end_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def stop(self, grace: float | None) -> _Stopped:
        """Refuses new calls, ends those under way after `grace` seconds, and stops the loop."""
        if self.loop.is_running():
            self._run(self.server.stop(grace))
            self._run(self._end_tasks())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()
            self.pool.shutdown(wait=False)
            self.blocking.shutdown(wait=False)
        return _Stopped()


class _Stopped:
    """What grpc.Server.stop returns, for the callers that wait on it: here, stopped."""

    def wait(self, timeout: float | None = None) -> bool:
        return True


@dataclasses.dataclass
class Running:
    coord: Coordinator
    grpc_server: AgentServer
    http: uvicorn.Server
    stop_event: threading.Event
    grpc_port: int
    certificate: Certificate
    url: str  # the REST address, as apps reach it
    grpc_address: str  # as agents reach it
    admin_identity: Path | None = None  # written at this start, if it was
    lead: Leadership | None = None  # whether this process runs the reaper
    relay: PostgresRelay | None = None  # held leases hear of other processes' work
    egress: Serving | None = None  # the platform's egress proxy for builds
    service: AgentService | None = None  # the agents' service (its fleet: the streams)
    signed: SignedCalls | None = None  # its calls' checks (and the streams' line)

    def stop(self) -> None:
        self.stop_event.set()
        if self.egress is not None:
            self.egress.close()
        self.http.should_exit = True
        self.grpc_server.stop(grace=2).wait()
        if self.relay is not None:
            self.relay.stop()
        if self.lead is not None:
            self.lead.resign()
        self.coord.close()


def build(settings: Settings) -> Coordinator:
    # The database holds job specs (researchers' environment values): coordinator only.
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.state_dir, 0o700)
    engine = make_engine(settings.database_url)
    migrate(engine)
    objects = S3Store(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key,
                      settings.s3_bucket, secure=settings.s3_secure, region=settings.s3_region,
                      addressing=settings.s3_addressing)
    objects.ensure_bucket()
    return Coordinator(settings, Store(engine), objects)


def _reap(coord: Coordinator, lead: Leadership, stop: threading.Event, every_s: float) -> None:
    """The lease reaper and the sweeps, in the one process that leads (leader.py); the
    others ask again every round and take over when the leader is gone."""
    rounds, leading = 0, False
    while not stop.wait(every_s):
        if not lead.holds():
            leading = False
            continue
        if not leading:
            leading = True
            # Agents could not renew while no leader (or no coordinator) was up: one lease
            # to reach us again before anything expires.
            extended = coord.leasing.extend_active_leases()
            log.info("this process runs the lease reaper now (%d running jobs get one lease "
                     "to reconnect)", extended)
        rounds += 1
        try:
            for job_id in coord.leasing.requeue_expired():
                log.warning("lease expired: job %s", job_id)
            if rounds % 8 == 0:  # the uploads of ended jobs, and expired tickets
                coord.inputs.sweep_uploads()
            if rounds % 64 == 0:  # now and then: spent nonces, machines never approved
                coord.housekeeping()
                coord.images.collect(dt.timedelta(seconds=coord.settings.image_keep_seconds))
        except CampugridError:
            log.exception("lease reaper")
        except Exception:
            log.exception("lease reaper")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def start(settings: Settings) -> Running:
    """Start gRPC and the reaper in the background; the caller runs `http.run()` or a thread."""
    local_rest = is_loopback(settings.http_host)
    if settings.allow_unsigned and not local_rest:
        raise CampugridError(f"CAMPUGRID_ALLOW_UNSIGNED is for a coordinator on a loopback "
                             f"address only, not {settings.http_host}")
    coord = build(settings)
    cert = ensure_certificate(settings.tls_dir)
    lead = leadership(coord.engine)
    relayed = relay(coord.engine, coord.work)
    # 32 threads for the plain calls; the streams' checks and the dispatcher's claims on 16
    # of their own
    blocking = futures.ThreadPoolExecutor(16, thread_name_prefix="grpc-streams")
    signed = SignedCalls(coord, coord.apps.nonces, blocking)
    server = AgentServer(32, [signed, AboutJob()], blocking)
    rest_tls = not local_rest if settings.rest_tls is None else settings.rest_tls
    scheme = "https" if rest_tls else "http"
    url = settings.public_url or f"{scheme}://{_host(settings.http_host)}:{settings.http_port}"
    egress = start_egress(coord, settings, cert, rest_tls) if settings.egress_port else None
    egress_url = (f"{scheme}://{urllib.parse.urlsplit(url).hostname}:{egress.address[1]}"
                  if egress is not None and egress.address else "")
    service = AgentService(coord, Supplies(settings, coord.bases, rest_url=url,
                                           rest_pem=cert.pem.decode(), egress_url=egress_url),
                           settings.registrations_per_minute, blocking)
    pb_grpc.add_AgentServiceServicer_to_server(service, server.server)
    signed.joining = lambda: service.fleet.joining
    service.fleet.joined = signed.room
    coord.metrics.watch_fleet(lambda: len(service.fleet.links),
                              lambda: sum(1 for _ in service.fleet.idle()))
    credentials = grpc.ssl_server_credentials([(cert.key_pem, cert.pem)])
    port = server.add_secure_port(f"{settings.grpc_host}:{settings.grpc_port}", credentials)
    if port == 0:
        raise CampugridError(f"cannot listen for agents on {settings.grpc_host}:{settings.grpc_port}")
    warmed = coord.machines.warm()  # before the machines connected a moment ago come back
    # The machines' speed ranking every claim asks for, beside the start, not in its way.
    threading.Thread(target=coord.leasing.rank_speeds, name="speeds", daemon=True).start()
    log.info("read the records of %d machines heard from lately", warmed)
    server.start()
    server.spawn(service.fleet.run())
    grpc_address = settings.public_grpc or f"{_host(settings.grpc_host)}:{port}"
    admin = ensure_admin(coord, settings, url, cert.fingerprint)
    stop = threading.Event()
    threading.Thread(target=_reap, args=(coord, lead, stop, max(0.5, settings.lease_seconds / 8)),
                     daemon=True, name="lease-reaper").start()
    app = create_app(coord, allow_unsigned=settings.allow_unsigned, pin=cert.fingerprint,
                     grpc_address=grpc_address, public_url=url, limits=RateLimits(
                         per_key_per_s=settings.rest_per_key_per_s,
                         per_address_per_s=settings.rest_per_address_per_s))
    tls = {"ssl_certfile": str(cert.cert_file), "ssl_keyfile": str(cert.key_file)} if rest_tls else {}
    http = uvicorn.Server(uvicorn.Config(app, host=settings.http_host, port=settings.http_port,
                                         log_level="warning", **tls))  # type: ignore[arg-type]
    log.info("coordinator: REST %s/v1  console %s/console  gRPC %s (TLS, certificate %s)", url,
             url, grpc_address, cert.fingerprint)
    return Running(coord, server, http, stop, port, cert, url, grpc_address, admin, lead,
                   relayed, egress, service, signed)


def start_egress(coord: Coordinator, settings: Settings, cert: Certificate,
                 tls: bool) -> Serving:
    """The platform's egress proxy (campugrid.egress), for approved machines' builds, on the
    REST host: TLS with the coordinator's own certificate whenever REST is."""
    context = None
    if tls:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert.cert_file, cert.key_file)
    check = egress_check(MirrorTokens(settings.registry_dir), coord.machines.get,
                         Guard(coord.limiter))

    def record(rec: Record) -> None:
        log.info("egress: %s", rec.line().removeprefix("[egress] "))
    try:
        return Serving(EgressProxy(Policy.from_env(), authorize=check, log=record),
                       tcp=(settings.http_host, settings.egress_port), tls=context)
    except OSError as e:
        raise CampugridError(f"cannot listen for builds' egress on {settings.http_host}:"
                             f"{settings.egress_port}: {e}") from e


def _host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - naming it, not binding it
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _ours(coord: Coordinator, path: Path) -> bool | None:
    """Whether the identity at `path` is an active admin here; None when there is none."""
    try:
        identity = Identity.load(path)
    except CampugridError:
        return None
    app = coord.apps.get(identity.app_id)
    return app is not None and app.admin and app.revoked_at is None


def ensure_admin(coord: Coordinator, settings: Settings, url: str, pin: str) -> Path | None:
    """Make sure the local user holds an admin identity: made at the first start (its key
    here, its public half in the database), and again where the settings name a path that
    holds none (the local operator owns the database anyway). An identity of the user's for
    another coordinator is never overwritten: the new one goes to the state folder. Returns
    where a new identity was written, or None."""
    path = settings.admin_identity or default_identity()
    found = _ours(coord, path)
    if found:
        return None
    if found is False:  # the user's identity for another coordinator: keep it
        path = settings.state_dir / "admin-identity.json"
        if _ours(coord, path):
            return None
    elif settings.admin_identity is None and coord.apps.any_admin():
        return None  # not the first start, and nobody asked for an identity there
    key_file = path.with_name(path.stem + ".key")
    key = keys.Ed25519PrivateKey.generate()
    keys.write_private(key_file, key)
    name = f"admin-{socket.gethostname()}-{secrets.token_hex(3)}".lower()[:60]
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in name)
    app = coord.apps.create_admin(name, keys.public_text(key))
    Identity(url, app.id, app.name, key_file, pin if url.startswith("https://") else "",
             admin=True).save(path)
    log.warning("admin identity %r made for the local user: key in %s, identity %s; invite "
                "others with `campugrid apps invite NAME`", app.name, key_file, path)
    return path


# A process holding thousands of agents' streams keeps about a hundred Python objects for
# each, and a full collection of the cyclic garbage collector walks them all: 0.8 s with
# 10,000 agents connected, every 15 s or so with the default thresholds (bench/fleet.py), a
# dispatch caught behind it waiting that long. So a serving process freezes what its imports
# made (never walked again) and collects its young objects after 50,000 allocations instead
# of 700: most die by their reference counts first instead of being promoted, and a full
# collection comes rarely (none in bench/fleet.py's idle window and dispatches at 10,000
# agents: dispatch p95 811 -> 44 ms).
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc() -> None:
    """The garbage collector of a serving process (not of a test's: it holds many things)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def serve(settings: Settings) -> None:
    tune_gc()  # what the imports made; before the ports open, so as not to hold them up
    running = start(settings)
    try:
        running.http.run()
    finally:
        running.stop()
