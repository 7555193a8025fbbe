"""Run the coordinator: REST (uvicorn) and gRPC in one process, plus the lease reaper."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent import futures

import grpc
import uvicorn

from campugrid.coordinator.agent_service import AboutJob, AgentService
from campugrid.coordinator.api import create_app
from campugrid.coordinator.config import Settings
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.objects import S3Store
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.store import Store
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol.errors import CampugridError

log = logging.getLogger("campugrid.coordinator")


@dataclasses.dataclass
class Running:
    coord: Coordinator
    grpc_server: grpc.Server
    http: uvicorn.Server
    stop_event: threading.Event
    grpc_port: int

    def stop(self) -> None:
        self.stop_event.set()
        self.http.should_exit = True
        self.grpc_server.stop(grace=2).wait()
        self.coord.close()


def build(settings: Settings) -> Coordinator:
    # The database holds job specs (researchers' environment values): coordinator only.
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.state_dir, 0o700)
    engine = make_engine(settings.database_url)
    migrate(engine)
    objects = S3Store(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key,
                      settings.s3_bucket, secure=settings.s3_secure)
    objects.ensure_bucket()
    return Coordinator(settings, Store(engine), objects)


def _reap(coord: Coordinator, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            for job_id in coord.requeue_expired():
                log.warning("lease expired: job %s", job_id)
        except CampugridError:
            log.exception("lease reaper")
        except Exception:
            log.exception("lease reaper")


def start(settings: Settings) -> Running:
    """Start gRPC and the reaper in the background; the caller runs `http.run()` or a thread."""
    coord = build(settings)
    extended = coord.extend_active_leases()
    if extended:
        log.warning("restarted with %d running jobs: their agents get one lease to reconnect", extended)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), interceptors=[AboutJob()])
    pb_grpc.add_AgentServiceServicer_to_server(AgentService(coord), server)
    port = server.add_insecure_port(f"{settings.grpc_host}:{settings.grpc_port}")
    if port == 0:
        raise CampugridError(f"cannot listen for agents on {settings.grpc_host}:{settings.grpc_port}")
    server.start()
    stop = threading.Event()
    threading.Thread(target=_reap, args=(coord, stop, max(0.5, settings.lease_seconds / 8)),
                     daemon=True, name="lease-reaper").start()
    http = uvicorn.Server(uvicorn.Config(create_app(coord), host=settings.http_host,
                                         port=settings.http_port, log_level="warning"))
    log.info("coordinator: REST http://%s:%d/v1  gRPC %s:%d", settings.http_host,
             settings.http_port, settings.grpc_host, port)
    return Running(coord, server, http, stop, port)


def serve(settings: Settings) -> None:
    running = start(settings)
    try:
        running.http.run()
    finally:
        running.stop()
