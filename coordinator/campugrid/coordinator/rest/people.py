"""Who may call: the calling app, invites redeemed into apps, apps revoked, and the web
console's people."""

from __future__ import annotations

from fastapi import APIRouter, Request

from campugrid.coordinator.rest.deps import Admin, Caller, Coord, SiteDep
from campugrid.coordinator.rest.models import (
    AppOut,
    InviteIn,
    InviteOut,
    LoginIn,
    NewUserOut,
    UserIn,
    UserOut,
)
from campugrid.protocol.errors import Unauthenticated

router = APIRouter(prefix="/v1")


@router.get("/whoami", response_model=AppOut)
def whoami(who: Caller) -> AppOut:
    return AppOut.of(who)


@router.post("/login", status_code=201, response_model=AppOut)
def login(body: LoginIn, request: Request, site: SiteDep) -> AppOut:
    """Redeem a one-time invite with a public key made on the new app's side."""
    address = (request.client.host if request.client else "?")
    try:
        return AppOut.of(site.coord.apps.redeem(body.invite.strip(), body.public_key))
    except Unauthenticated as e:
        raise site.guard.failed(address, "", str(e), why="invite") from e


@router.get("/apps", response_model=list[AppOut])
def list_apps(_: Admin, coord: Coord) -> list[AppOut]:
    return [AppOut.of(a) for a in coord.apps.all()]


@router.post("/apps/invites", status_code=201, response_model=InviteOut)
def invite(body: InviteIn, who: Admin, request: Request, site: SiteDep) -> InviteOut:
    code, expires = site.coord.apps.invite(body.name, who, admin=body.admin)
    server = site.server(request)
    command = f"campugrid login {server} --invite {code}"
    if server.startswith("https://"):
        command += f" --pin {site.pin}"
    return InviteOut(name=body.name, code=code, expires_at=expires, server=server, pin=site.pin,
                     command=command)


@router.post("/apps/{name}/revoke", response_model=AppOut)
def revoke_app(name: str, who: Admin, coord: Coord) -> AppOut:
    return AppOut.of(coord.apps.revoke(name, who))


@router.get("/users", response_model=list[UserOut])
def list_users(_: Admin, coord: Coord) -> list[UserOut]:
    return [UserOut.of(u) for u in coord.users.all()]


@router.post("/users", status_code=201, response_model=NewUserOut)
def add_user(body: UserIn, _: Admin, request: Request, site: SiteDep) -> NewUserOut:
    """A person for the web console, with a one-time enrolment link (password and TOTP are
    chosen there)."""
    user, token, expires = site.coord.users.add(body.name, body.app, admin=body.admin)
    return NewUserOut(**UserOut.of(user).model_dump(), expires_at=expires,
                      link=f"{site.server(request)}/console/enrol?token={token}")


@router.post("/users/{name}/reset", response_model=NewUserOut)
def reset_user(name: str, _: Admin, request: Request, site: SiteDep) -> NewUserOut:
    """A new enrolment link (lost password or authenticator): the old ones stop now."""
    user, token, expires = site.coord.users.reset(name)
    return NewUserOut(**UserOut.of(user).model_dump(), expires_at=expires,
                      link=f"{site.server(request)}/console/enrol?token={token}")


@router.delete("/users/{name}")
def remove_user(name: str, _: Admin, coord: Coord) -> dict[str, bool]:
    """The person cannot sign in any more; their app and its jobs stay."""
    return {"removed": coord.users.remove(name)}
