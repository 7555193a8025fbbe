"""Apps (whoever submits and watches jobs): their public keys, invites, and the nonce store.

The coordinator never sees an app's private key. An app joins by redeeming a one-time invite
(only its SHA-256 is stored) with a public key it made itself; revoking an app refuses every
request it signs from then on.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import re
import secrets
import uuid

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from campugrid.coordinator.db import Database
from campugrid.coordinator.models import App, Invite, Nonce
from campugrid.coordinator.views import utcnow
from campugrid.protocol import keys
from campugrid.protocol.errors import Conflict, InvalidInput, NotFound, Unauthenticated

INVITE_TTL_S = 24 * 3600
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


@dataclasses.dataclass(frozen=True)
class AppView:
    id: str
    name: str
    fingerprint: str
    admin: bool
    created_at: dt.datetime
    revoked_at: dt.datetime | None
    public_key: str = ""

    @classmethod
    def from_row(cls, r: App) -> AppView:
        return cls(r.id, r.name, r.fingerprint, r.admin, r.created_at, r.revoked_at, r.public_key)


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise InvalidInput(f"app name {name!r}: 1 to 100 of a-z, 0-9, '.', '_' and '-', "
                           "starting with a letter or digit")
    return name


def code_digest(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


class Apps:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, name: str, public_key: str, *, admin: bool = False) -> AppView:
        row = _app_row(name, public_key, admin)
        try:
            with self.db.tx() as s:
                s.add(row)
        except IntegrityError as e:
            raise Conflict(f"an app named {name!r} or with this key already exists") from e
        return AppView.from_row(row)

    def get(self, app_id: str) -> AppView | None:
        """The app whose key signs as `app_id` (revoked ones too: the caller says why)."""
        with self.db.read() as s:
            row = s.get(App, app_id)
            return AppView.from_row(row) if row is not None else None

    def all(self) -> list[AppView]:
        with self.db.read() as s:
            return [AppView.from_row(r) for r in s.scalars(select(App).order_by(App.created_at))]

    def revoke(self, name: str) -> AppView:
        with self.db.tx() as s:
            row = s.scalars(select(App).where(App.name == name)).one_or_none()
            if row is None:
                raise NotFound(f"no app named {name!r} (see `campugrid apps`)")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            return AppView.from_row(row)

    def any_admin(self) -> bool:
        with self.db.read() as s:
            return s.scalars(select(App.id).where(App.admin.is_(True),
                                                  App.revoked_at.is_(None)).limit(1)).first() is not None

    # --- invites ------------------------------------------------------------------------------

    def invite(self, name: str, created_by: str, *, admin: bool = False,
               ttl_s: int = INVITE_TTL_S) -> tuple[str, dt.datetime]:
        """A one-time code for a new app called `name`; only its digest is kept."""
        check_name(name)
        with self.db.read() as s:
            if s.scalars(select(App.id).where(App.name == name)).first() is not None:
                raise Conflict(f"an app named {name!r} already exists")
        code = "cgi_" + secrets.token_urlsafe(24)
        expires = utcnow() + dt.timedelta(seconds=ttl_s)
        with self.db.tx() as s:
            s.add(Invite(code_sha256=code_digest(code), name=name, admin=admin,
                         created_by=created_by, expires_at=expires))
        return code, expires

    def redeem(self, code: str, public_key: str) -> AppView:
        """The invite's app, made with `public_key`; the invite cannot be used again."""
        now = utcnow()
        try:
            return self._redeem(code, public_key, now)
        except IntegrityError as e:  # the invite stays unused
            raise Conflict("an app with this name or this key already exists") from e

    def _redeem(self, code: str, public_key: str, now: dt.datetime) -> AppView:
        with self.db.tx() as s:
            inv = s.get(Invite, code_digest(code))
            if inv is None:
                raise Unauthenticated("unknown invite code; ask for a new one "
                                      "(`campugrid apps invite NAME`)")
            if inv.used_at is not None:
                raise Unauthenticated("this invite was already used; ask for a new one")
            if inv.expires_at < now:
                raise Unauthenticated(f"this invite expired at {inv.expires_at:%Y-%m-%d %H:%M} "
                                      "UTC; ask for a new one")
            claimed = s.execute(update(Invite).where(Invite.code_sha256 == inv.code_sha256,
                                                     Invite.used_at.is_(None))
                                .values(used_at=now)).rowcount  # type: ignore[attr-defined]
            if claimed != 1:
                raise Unauthenticated("this invite was already used; ask for a new one")
            row = _app_row(inv.name, public_key, inv.admin)
            s.add(row)
            s.flush()
            return AppView.from_row(row)


def _app_row(name: str, public_key: str, admin: bool) -> App:
    pub = keys.parse_public(public_key)
    return App(id=str(uuid.uuid4()), name=check_name(name), public_key=keys.public_text(pub),
               fingerprint=keys.key_fingerprint(pub), admin=admin, created_at=utcnow())


_NONCE_INSERT = insert(Nonce)


class Nonces:
    """Seen nonces, per signer, until their signature's window has passed."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def use(self, signer: str, nonce: str, window_s: float) -> None:
        """Record a nonce; Unauthenticated if this signer used it before (a replay). Not
        waited onto disk: a crash may forget the last nonces, which only reopens a replay of a
        call someone already captured, for at most its window."""
        if not 8 <= len(nonce) <= 64:
            raise Unauthenticated("the signature's nonce must have 8 to 64 characters")
        try:
            with self.db.statements() as conn:  # Core, one statement: on every signed call
                conn.execute(_NONCE_INSERT, {
                    "signer": signer[:80], "nonce": nonce,
                    "expires_at": utcnow() + dt.timedelta(seconds=2 * window_s)})
        except IntegrityError as e:
            raise Unauthenticated("this request was seen before (its nonce is reused): a "
                                  "replay; sign every request anew") from e

    def prune(self) -> int:
        with self.db.tx() as s:
            res = s.execute(delete(Nonce).where(Nonce.expires_at < utcnow()))
            return int(res.rowcount or 0)  # type: ignore[attr-defined]
