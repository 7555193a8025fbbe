"""What every route depends on: the caller (auth.SignedRequests checked its signature) and
the site it reached (the coordinator's services, its rate-limit guard, how agents and apps
reach it)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import Depends, Request

from campugrid.coordinator.apps import AppView
from campugrid.coordinator.auth import Guard
from campugrid.coordinator.service import Coordinator
from campugrid.protocol.errors import Forbidden


@dataclasses.dataclass(frozen=True)
class Site:
    """The coordinator behind the API: its services, the guard that counts refusals, and
    how it is reached (`pin`: its certificate's fingerprint; `grpc_address` and `public_url`
    for the join and login commands)."""

    coord: Coordinator
    guard: Guard
    pin: str = ""
    grpc_address: str = ""
    public_url: str = ""

    def server(self, request: Request) -> str:
        """This coordinator's address as callers use it."""
        return self.public_url or str(request.base_url).rstrip("/")


def site(request: Request) -> Site:
    found = request.app.state.site
    assert isinstance(found, Site)
    return found


def coordinator(request: Request) -> Coordinator:
    return site(request).coord


def caller(request: Request) -> AppView:
    """The app that signed this request (auth.SignedRequests checked it before we run)."""
    who = request.state.caller
    assert isinstance(who, AppView)
    return who


def owner_of(who: AppView) -> str | None:
    """Whose jobs a caller sees: its own, or (admins) everyone's."""
    return None if who.admin else who.id


SiteDep = Annotated[Site, Depends(site)]
Coord = Annotated[Coordinator, Depends(coordinator)]
Caller = Annotated[AppView, Depends(caller)]


def admin_only(who: Caller) -> AppView:
    if not who.admin:
        raise Forbidden(f"app {who.name!r} is not an admin: ask an admin to do this")
    return who


Admin = Annotated[AppView, Depends(admin_only)]
