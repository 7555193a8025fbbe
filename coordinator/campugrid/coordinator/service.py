"""The coordinator: its services by noun (services/), put together on one store and one
object store. REST (api.py), the console and gRPC (agent_service.py) call the services, never
the store; the process around them (server.py) runs the housekeeping here."""

from __future__ import annotations

import functools
import logging

from sqlalchemy import Engine

from campugrid.coordinator.bases import BaseResolver
from campugrid.coordinator.config import Settings
from campugrid.coordinator.images import Images
from campugrid.coordinator.metrics import CoordinatorMetrics
from campugrid.coordinator.objects import ObjectStore
from campugrid.coordinator.ratelimits import Limiter
from campugrid.coordinator.registry import RegistryTokens
from campugrid.coordinator.services.apps import AppService
from campugrid.coordinator.services.inputs import InputService
from campugrid.coordinator.services.jobs import JobService
from campugrid.coordinator.services.leasing import LeaseService
from campugrid.coordinator.services.machines import MachineService
from campugrid.coordinator.store import Store
from campugrid.coordinator.users import SecretBox, Users
from campugrid.coordinator.wakeup import Wakeup

log = logging.getLogger("campugrid.coordinator")


class Coordinator:
    """jobs, leasing, machines, apps, inputs: the services; users: the console's people;
    images and bases: shared images and remote FROMs; work: news of work, for the dispatcher
    (fleet.py) and the other processes; metrics: this coordinator's /metrics."""

    def __init__(self, settings: Settings, store: Store, objects: ObjectStore) -> None:
        self.settings = settings
        self.store = store  # the services' (and the server's wiring); transports never use it
        self.objects = objects
        self.work = Wakeup()  # news of work, for the dispatcher (fleet.py)
        self.inputs = InputService(settings, store, objects)
        self.machines = MachineService(store, requeue=lambda: self.leasing.requeue_expired())
        self.leasing = LeaseService(settings, store, objects, self.machines, self.inputs,
                                    self.work)
        self.jobs = JobService(settings, store, objects, self.inputs, lambda: self.bases,
                               self.work)
        self.apps = AppService(settings, store)

    @functools.cached_property
    def images(self) -> Images:
        """Shared images: who builds, who pulls, and the registry tokens for it."""
        registry = (RegistryTokens(self.settings.registry_dir, self.settings.registry,
                                   self.settings.registry_token_seconds)
                    if self.settings.registry else None)
        return Images(self.store.db, registry)

    @functools.cached_property
    def bases(self) -> BaseResolver:
        """Remote FROMs to digests, at submit."""
        return BaseResolver(self.settings.registry_mirrors,
                            RegistryTokens(self.settings.registry_dir, self.settings.registry,
                                           self.settings.registry_token_seconds))

    @functools.cached_property
    def users(self) -> Users:
        """The console's people; their TOTP secrets are sealed with console.key, a file in
        the state folder (never in the database)."""
        return Users(self.store.db, SecretBox.at(self.settings.state_dir / "console.key"),
                     self.store.limiter)

    @functools.cached_property
    def metrics(self) -> CoordinatorMetrics:
        """This coordinator's metrics: its REST app and its gRPC service share them."""
        return CoordinatorMetrics(self.store.db)

    @property
    def limiter(self) -> Limiter:
        """Rate limits, counted in the database so they hold across coordinator processes."""
        return self.store.limiter

    @property
    def engine(self) -> Engine:
        """The database, for what coordinates the processes on it (leader.py, wakeup.py)."""
        return self.store.engine

    def housekeeping(self) -> None:
        """Now and then, by the process that runs the reaper: spent nonces and rate-limit
        windows, machines never approved, old GPU memory, ended console sessions."""
        self.store.nonces.prune()
        self.store.counters.prune()
        self.store.machines.expire_pending()
        self.store.gpu_history.prune()
        self.users.prune_sessions()

    def close(self) -> None:
        self.objects.close()
        self.store.close()
