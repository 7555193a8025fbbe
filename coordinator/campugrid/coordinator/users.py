"""People who sign in to the web console: argon2id passwords, a TOTP second factor (RFC 6238)
whose secret is encrypted with a key kept outside the database, a lockout per account, and
server-side sessions of which only the cookie's SHA-256 is kept.

A person acts as one app (the trust layer's identity): their jobs are that app's jobs, and
they are an admin exactly when that app is.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import os
import secrets
import uuid
from pathlib import Path

import argon2
import pyotp
from cryptography.fernet import Fernet, InvalidToken
from limits import RateLimitItemPerMinute
from sqlalchemy import delete, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from campugrid.coordinator.apps import check_name
from campugrid.coordinator.db import Database
from campugrid.coordinator.models import App, ConsoleSession, User
from campugrid.coordinator.ratelimits import Limiter
from campugrid.coordinator.views import utcnow
from campugrid.protocol import keys
from campugrid.protocol.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    RateLimited,
    StorageError,
    Unauthenticated,
)

ENROL_TTL_S = 24 * 3600
SESSION_S = 12 * 3600
MAX_FAILURES = 5  # in a row, then the account is locked for LOCK_S
LOCK_S = 15 * 60
MIN_PASSWORD, MAX_PASSWORD = 12, 1024
UNKNOWN_FAILURES = RateLimitItemPerMinute(MAX_FAILURES - 1, LOCK_S // 60)
ISSUER = "campugrid"
_HASHER = argon2.PasswordHasher()  # argon2id, RFC 9106's second recommended parameters
# Checked when the name is unknown, so that a wrong name takes as long as a wrong password.
_DUMMY = _HASHER.hash(secrets.token_hex(16))


@dataclasses.dataclass(frozen=True)
class UserView:
    id: str
    name: str
    app_id: str
    app_name: str
    admin: bool
    enrolled: bool
    acknowledged: bool
    locked_until: dt.datetime | None


class SecretBox:
    """The console's own key, in a file of the coordinator's state folder (never in the
    database): encrypts TOTP secrets and keys the CSRF tokens."""

    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)
        self._mac_key = hashlib.sha256(b"campugrid-csrf\0" + key).digest()

    @classmethod
    def at(cls, path: Path) -> SecretBox:
        """The key at `path`, made (readable by its owner only) on first use."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # written whole, then linked into place: never half a key
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(Fernet.generate_key())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: that one is the key
            finally:
                tmp.unlink()
        if path.stat().st_mode & 0o077:
            raise StorageError(f"{path} is readable by others: chmod 600 {path}")
        key = path.read_bytes().strip()
        if not key:
            raise StorageError(f"{path} is empty: restore it from a backup (the TOTP secrets "
                               "need it), or remove it and reset every user")
        return cls(key)

    def seal(self, text: str) -> str:
        return self._fernet.encrypt(text.encode()).decode("ascii")

    def open(self, sealed: str) -> str:
        try:
            return self._fernet.decrypt(sealed.encode("ascii")).decode()
        except (InvalidToken, ValueError) as e:
            raise StorageError("a TOTP secret does not decrypt with this coordinator's console "
                               "key (console.key in its state folder was replaced?)") from e

    def mac(self, text: str) -> str:
        return hmac.new(self._mac_key, text.encode(), hashlib.sha256).hexdigest()


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_password(password: str, name: str) -> str:
    if not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
        raise InvalidInput(f"password: {MIN_PASSWORD} to {MAX_PASSWORD} characters (a few words "
                           "you will remember make a good one)")
    if name.lower() in password.lower():
        raise InvalidInput("password: it must not contain your user name")
    return password


class Users:
    def __init__(self, db: Database, box: SecretBox, limiter: Limiter) -> None:
        self.db = db
        self.box = box
        # Failures for names nobody has, so that they lock as a real account would (counted
        # in the database, as every limit: the same for every coordinator process).
        self._unknown = limiter

    def _view(self, row: User, app: App) -> UserView:
        return UserView(row.id, row.name, row.app_id, app.name, app.admin and app.revoked_at is None,
                        row.enrolled_at is not None, row.acknowledged_at is not None,
                        row.locked_until)

    def add(self, name: str, app_name: str | None = None, *, admin: bool = False,
            ttl_s: int = ENROL_TTL_S) -> tuple[UserView, str, dt.datetime]:
        """A person, with a one-time enrolment token (only its digest is kept). They act as
        the app `app_name`, or as a new app of their own name (its key is made here and
        thrown away: that app signs nothing, it is the person's jobs' owner)."""
        check_name(name)
        if app_name is not None and admin:
            raise InvalidInput("admin: only for a new app; with an existing app, that app's "
                               "own role applies")
        token = "cge_" + secrets.token_urlsafe(24)
        now = utcnow()
        expires = now + dt.timedelta(seconds=ttl_s)
        try:
            with self.db.tx() as s:
                if s.scalars(select(User.id).where(User.name == name)).first() is not None:
                    raise Conflict(f"a user named {name!r} exists already (see `campugrid users`)")
                if app_name is not None:
                    app = s.scalars(select(App).where(App.name == app_name)).one_or_none()
                    if app is None or app.revoked_at is not None:
                        raise NotFound(f"no active app named {app_name!r} (see `campugrid apps`)")
                else:
                    if s.scalars(select(App.id).where(App.name == name)).first() is not None:
                        raise Conflict(f"an app named {name!r} exists already: to let {name} "
                                       f"act as it, add them with --app {name}")
                    pub = keys.Ed25519PrivateKey.generate().public_key()
                    app = App(id=str(uuid.uuid4()), name=name, public_key=keys.public_text(pub),
                              fingerprint=keys.key_fingerprint(pub), admin=admin, created_at=now)
                    s.add(app)
                row = User(id=str(uuid.uuid4()), name=name, app_id=app.id, password_hash="",
                           totp_secret="", totp_last_step=0, enrol_sha256=_digest(token),
                           enrol_expires_at=expires, failed_logins=0, created_at=now)
                s.add(row)
                s.flush()
                return self._view(row, app), token, expires
        except IntegrityError as e:
            raise Conflict(f"a user or app named {name!r} exists already") from e

    def reset(self, name: str, *, ttl_s: int = ENROL_TTL_S) -> tuple[UserView, str, dt.datetime]:
        """A new enrolment link for a person who lost their password or authenticator: the
        old password, secret and sessions stop working now."""
        token = "cge_" + secrets.token_urlsafe(24)
        expires = utcnow() + dt.timedelta(seconds=ttl_s)
        with self.db.tx() as s:
            row = s.scalars(select(User).where(User.name == name)).one_or_none()
            if row is None:
                raise NotFound(f"no user named {name!r} (see `campugrid users`)")
            row.password_hash, row.totp_secret, row.enrolled_at = "", "", None
            row.enrol_sha256, row.enrol_expires_at = _digest(token), expires
            row.failed_logins, row.locked_until = 0, None
            s.execute(delete(ConsoleSession).where(ConsoleSession.user_id == row.id))
            app = s.get(App, row.app_id)
            assert app is not None
            return self._view(row, app), token, expires

    def remove(self, name: str) -> bool:
        """The person can no longer sign in (their app and its jobs stay). False if there was
        no such person."""
        with self.db.tx() as s:
            row = s.scalars(select(User).where(User.name == name)).one_or_none()
            if row is None:
                return False
            s.execute(delete(ConsoleSession).where(ConsoleSession.user_id == row.id))
            s.delete(row)
            return True

    def all(self) -> list[UserView]:
        with self.db.read() as s:
            return [self._view(u, a) for u, a in s.execute(
                select(User, App).join(App, App.id == User.app_id).order_by(User.created_at))
                ]

    # --- enrolment ------------------------------------------------------------------------------

    def _enrolling(self, s: Session, token: str) -> User:
        row = s.scalars(select(User).where(User.enrol_sha256 == _digest(token))).one_or_none()
        if row is None:
            raise Unauthenticated("this enrolment link is unknown or was used already: ask an "
                                  "admin for a new one (`campugrid users add NAME`)")
        if row.enrol_expires_at is None or row.enrol_expires_at < utcnow():
            raise Unauthenticated("this enrolment link has expired: ask an admin for a new one")
        return row

    def enrolment(self, token: str) -> tuple[str, str, str]:
        """(user name, TOTP secret, otpauth URI) for the enrolment page. The secret is made
        on the first visit and kept (encrypted), so reloading the page shows the same one."""
        with self.db.tx() as s:
            row = self._enrolling(s, token)
            if not row.totp_secret:  # the first visit: only one of two at once sets it
                s.execute(update(User).where(User.id == row.id, User.totp_secret == "")
                          .values(totp_secret=self.box.seal(pyotp.random_base32())))
                s.refresh(row)
            secret = self.box.open(row.totp_secret)
            uri = pyotp.TOTP(secret).provisioning_uri(name=row.name, issuer_name=ISSUER)
            return row.name, secret, uri

    def enrol(self, token: str, password: str, code: str, *, now: dt.datetime | None = None) -> UserView:
        """Sets the password once the first code from the authenticator checks out."""
        now = now or utcnow()
        with self.db.tx() as s:
            row = self._enrolling(s, token)
            check_password(password, row.name)
            if not row.totp_secret:
                raise InvalidInput("open the enrolment link first: it shows the QR code to scan")
            step = _totp_step(self.box.open(row.totp_secret), code, now)
            if step is None:
                raise InvalidInput("code: that is not the current code of the authenticator "
                                   "you scanned the QR code with (check the phone's clock)")
            done = s.execute(update(User).where(User.id == row.id,
                                                User.enrol_sha256 == row.enrol_sha256)
                             .values(password_hash=_HASHER.hash(password), totp_last_step=step,
                                     enrol_sha256=None, enrol_expires_at=None, enrolled_at=now,
                                     failed_logins=0, locked_until=None)).rowcount  # type: ignore[attr-defined]
            if done != 1:
                raise Unauthenticated("this enrolment link was used already")
            app = s.get(App, row.app_id)
            assert app is not None
            s.refresh(row)
            return self._view(row, app)

    # --- sign-in --------------------------------------------------------------------------------

    def login(self, name: str, password: str, code: str, *, now: dt.datetime | None = None) -> UserView:
        """The person, if name, password and current code are right. A refusal does not say
        which was wrong, nor whether the name exists: unknown names lock like real ones. The
        password is checked outside any transaction (argon2 takes a tenth of a second)."""
        now = now or utcnow()
        wrong = Unauthenticated("wrong user name, password or code")
        with self.db.read() as s:
            row = s.scalars(select(User).where(User.name == name[:100])).one_or_none()
            found = None if row is None or row.enrolled_at is None else (
                row.id, row.password_hash, row.totp_secret, row.totp_last_step, row.locked_until)
        if found is None:
            _verify(_DUMMY, password)
            if not self._unknown.hit(UNKNOWN_FAILURES, "unknown", name[:100], exact=True):
                wait = self._unknown.retry_after(UNKNOWN_FAILURES, "unknown", name[:100],
                                                 exact=True)
                raise _locked(now + dt.timedelta(seconds=wait), now)
            raise wrong
        user_id, hashed, sealed, last_step, locked_until = found
        # Checked even while locked: a locked unknown name pays the dummy check above, so a
        # locked account refused without one would tell by its speed that the name exists.
        good = _verify(hashed, password)
        if locked_until is not None and locked_until > now:
            raise _locked(locked_until, now)
        step = _totp_step(self.box.open(sealed), code, now) if good else None
        if not good or step is None:
            raise self._failed(user_id, now) or wrong
        if step <= last_step:
            raise Unauthenticated("that code was used already: wait for the next one")
        with self.db.tx() as s:
            row = s.get(User, user_id)
            app = s.get(App, row.app_id) if row is not None else None
            if row is None or app is None or app.revoked_at is not None:
                raise Unauthenticated(f"the app that {name!r} acts as was revoked: ask an admin")
            rehash = _HASHER.check_needs_rehash(hashed)
            used = s.execute(update(User).where(
                User.id == user_id, User.totp_last_step < step, User.password_hash == hashed,
                or_(User.locked_until.is_(None), User.locked_until <= now)).values(
                failed_logins=0, locked_until=None, totp_last_step=step,
                password_hash=_HASHER.hash(password) if rehash else hashed)
            ).rowcount  # type: ignore[attr-defined]
            if used != 1:  # another sign-in with this code (or a reset, a lock) came first
                raise Unauthenticated("that code was used already: wait for the next one")
            s.refresh(row)
            return self._view(row, app)

    def _failed(self, user_id: str, now: dt.datetime) -> RateLimited | None:
        """Count a failed sign-in (in the database, so that parallel guesses all count); the
        lock it set off, if it did. Not waited onto disk, like an unknown name's count: a
        commit's fsync, slow on a busy disk, would tell by its time that the name exists (a
        crash may lose a count or a lock, never a sign-in)."""
        with self.db.tx(durable=False) as s:
            s.execute(update(User).where(User.id == user_id)
                      .values(failed_logins=User.failed_logins + 1))
            locked = now + dt.timedelta(seconds=LOCK_S)
            hit = s.execute(update(User).where(User.id == user_id,
                                               User.failed_logins >= MAX_FAILURES)
                            .values(failed_logins=0, locked_until=locked)).rowcount  # type: ignore[attr-defined]
        return _locked(locked, now) if hit else None

    def open_session(self, user: UserView) -> tuple[str, dt.datetime]:
        token = "cgs_" + secrets.token_urlsafe(32)
        now = utcnow()
        expires = now + dt.timedelta(seconds=SESSION_S)
        with self.db.tx() as s:
            s.add(ConsoleSession(id_sha256=_digest(token), user_id=user.id, created_at=now,
                                 expires_at=expires))
        return token, expires

    def session(self, token: str) -> UserView | None:
        """Who holds this session cookie, while it lasts and their app is not revoked."""
        if not token.startswith("cgs_") or len(token) > 100:
            return None
        with self.db.read() as s:
            found = s.execute(select(User, App).join(ConsoleSession,
                                                     ConsoleSession.user_id == User.id)
                              .join(App, App.id == User.app_id)
                              .where(ConsoleSession.id_sha256 == _digest(token),
                                     ConsoleSession.expires_at > utcnow())).first()
            if found is None or found[1].revoked_at is not None:
                return None
            return self._view(*found)

    def close_session(self, token: str) -> None:
        with self.db.tx() as s:
            s.execute(delete(ConsoleSession).where(ConsoleSession.id_sha256 == _digest(token)))

    def prune_sessions(self) -> int:
        with self.db.tx() as s:
            res = s.execute(delete(ConsoleSession).where(ConsoleSession.expires_at < utcnow()))
            return int(res.rowcount or 0)  # type: ignore[attr-defined]

    def acknowledge(self, user: UserView) -> None:
        with self.db.tx() as s:
            s.execute(update(User).where(User.id == user.id, User.acknowledged_at.is_(None))
                      .values(acknowledged_at=utcnow()))


def _verify(hashed: str, password: str) -> bool:
    try:
        return _HASHER.verify(hashed, password[:MAX_PASSWORD])
    except argon2.exceptions.VerificationError:
        return False
    except argon2.exceptions.InvalidHashError:
        return False


def _totp_step(secret: str, code: str, now: dt.datetime) -> int | None:
    """The time step whose code `code` is (this one, or one either side for clock drift)."""
    code = code.replace(" ", "").strip()
    if len(code) != 6 or not code.isdigit():
        return None
    totp = pyotp.TOTP(secret)
    for drift in (0, -1, 1):
        at = now + dt.timedelta(seconds=totp.interval * drift)
        if hmac.compare_digest(totp.at(at), code):
            return int(totp.timecode(at))
    return None


def _locked(until: dt.datetime, now: dt.datetime) -> RateLimited:
    wait = max(1, int((until - now).total_seconds() + 0.999))
    return RateLimited(f"too many failed sign-ins: this account is locked until "
                       f"{until:%H:%M:%S} UTC (in {(wait + 59) // 60} min)", wait)
