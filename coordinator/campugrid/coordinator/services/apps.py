"""Who may call: apps (their keys, invites, revocation) and the nonces signed calls spend.
The console's people are `Coordinator.users` (users.py)."""

from __future__ import annotations

import datetime as dt
import logging

from campugrid.coordinator.apps import Apps, AppView, Nonces
from campugrid.coordinator.config import Settings
from campugrid.coordinator.store import Store
from campugrid.protocol.errors import Conflict

log = logging.getLogger("campugrid.coordinator")


class AppService:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings, self.store = settings, store

    @property
    def keys(self) -> Apps:
        """The apps' keys, as signed requests are checked against them (auth.py)."""
        return self.store.apps

    @property
    def nonces(self) -> Nonces:
        """The nonces signed REST requests and gRPC calls spend (each once)."""
        return self.store.nonces

    def all(self) -> list[AppView]:
        return self.store.apps.all()

    def get(self, app_id: str) -> AppView | None:
        return self.store.apps.get(app_id)

    def any_admin(self) -> bool:
        return self.store.apps.any_admin()

    def create_admin(self, name: str, public_key: str) -> AppView:
        """An admin app for a key the local operator holds (the first start's identity)."""
        return self.store.apps.create(name, public_key, admin=True)

    def invite(self, name: str, by: AppView, *, admin: bool = False) -> tuple[str, dt.datetime]:
        """A one-time code for a new app; only its digest is kept."""
        code, expires = self.store.apps.invite(name, by.id, admin=admin)
        log.info("invite for app %r made by %s (until %s)", name, by.name, f"{expires:%Y-%m-%d %H:%M}")
        return code, expires

    def redeem(self, code: str, public_key: str) -> AppView:
        app = self.store.apps.redeem(code, public_key)
        log.info("app %r joined with key %s", app.name, app.fingerprint)
        return app

    def revoke(self, name: str, by: AppView) -> AppView:
        if name == by.name:
            raise Conflict("an admin cannot revoke its own key (another admin can)")
        app = self.store.apps.revoke(name)
        log.warning("app %r (%s) revoked by %s", app.name, app.fingerprint, by.name)
        return app
