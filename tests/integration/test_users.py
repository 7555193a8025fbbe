"""Console people on SQLite and PostgreSQL: enrolment, sign-in with TOTP, lockout, sessions,
and nothing secret in the database."""

from __future__ import annotations

import datetime as dt
import statistics
import time
from pathlib import Path

import pyotp
import pytest
from sqlalchemy import text

from campugrid.coordinator.store import Store
from campugrid.coordinator.users import LOCK_S, MAX_FAILURES, SecretBox, Users
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    RateLimited,
    StorageError,
    Unauthenticated,
)

PASSWORD = "correct horse battery staple"


@pytest.fixture
def users(store: Store, tmp_path: Path) -> Users:
    return Users(store.db, SecretBox.at(tmp_path / "console.key"), store.limiter)


def enrolled(users: Users, name: str = "ada") -> tuple[str, pyotp.TOTP]:
    _, token, _ = users.add(name)
    _, secret, uri = users.enrolment(token)
    assert uri.startswith("otpauth://totp/campugrid:") and secret in uri
    totp = pyotp.TOTP(secret)
    earlier = utcnow() - dt.timedelta(seconds=60)  # leaves the current code for sign-in
    users.enrol(token, PASSWORD, totp.at(earlier), now=earlier)
    return token, totp


def test_enrolment_needs_the_first_code_and_then_the_link_is_spent(users: Users):
    _, token, expires = users.add("ada")
    assert expires > utcnow()
    name, secret, _ = users.enrolment(token)
    assert name == "ada" and users.enrolment(token)[1] == secret  # a reload shows the same
    with pytest.raises(InvalidInput, match="code"):
        users.enrol(token, PASSWORD, "000000" if pyotp.TOTP(secret).now() != "000000" else "111111")
    with pytest.raises(InvalidInput, match="password"):
        users.enrol(token, "short", pyotp.TOTP(secret).now())
    with pytest.raises(InvalidInput, match="user name"):
        users.enrol(token, "ada-is-my-password", pyotp.TOTP(secret).now())
    [before] = users.all()
    assert not before.enrolled
    user = users.enrol(token, PASSWORD, pyotp.TOTP(secret).now())
    assert user.enrolled and not user.admin
    with pytest.raises(Unauthenticated, match="unknown or was used"):
        users.enrolment(token)


def test_an_expired_link_is_refused(users: Users):
    _, token, _ = users.add("ada", ttl_s=-1)
    with pytest.raises(Unauthenticated, match="expired"):
        users.enrolment(token)


def test_sign_in_needs_password_and_a_fresh_code(users: Users):
    _, totp = enrolled(users)
    with pytest.raises(Unauthenticated, match="wrong user name, password or code"):
        users.login("ada", "wrong password entirely", totp.now())
    with pytest.raises(Unauthenticated, match="wrong user name, password or code"):
        users.login("nobody", PASSWORD, totp.now())
    wrong = str((int(totp.now()) + 1) % 1_000_000).zfill(6)
    with pytest.raises(Unauthenticated, match="wrong"):
        users.login("ada", PASSWORD, wrong)
    # One moment for every sign-in below: with the clock's own time, a 30 s step could end
    # between two of them (each hashes a password), and "the next step" would be two away.
    at = utcnow()
    code = totp.at(at)
    user = users.login("ada", PASSWORD, code, now=at)
    assert user.name == "ada"
    with pytest.raises(Unauthenticated, match="used already"):  # the same code twice
        users.login("ada", PASSWORD, code, now=at)
    with pytest.raises(Unauthenticated, match="used already"):  # still, in the next step
        users.login("ada", PASSWORD, code, now=at + dt.timedelta(seconds=30))


def test_failures_lock_the_account_and_say_until_when(users: Users):
    _, totp = enrolled(users)
    for _ in range(MAX_FAILURES - 1):
        with pytest.raises(Unauthenticated):
            users.login("ada", "wrong password entirely", totp.now())
    with pytest.raises(RateLimited, match="locked until") as locked:
        users.login("ada", "wrong password entirely", totp.now())
    assert LOCK_S - 5 <= locked.value.retry_after_s <= LOCK_S
    with pytest.raises(RateLimited, match="locked until"):  # even the right password now
        users.login("ada", PASSWORD, totp.now())
    later = utcnow() + dt.timedelta(seconds=LOCK_S + 1)
    assert users.login("ada", PASSWORD, totp.at(later), now=later).name == "ada"


def test_sessions_last_until_signed_out(users: Users):
    _, totp = enrolled(users)
    user = users.login("ada", PASSWORD, totp.now())
    token, _ = users.open_session(user)
    assert users.session(token) == user
    assert users.session(token + "x") is None and users.session("nonsense") is None
    users.close_session(token)
    assert users.session(token) is None


def test_a_person_acts_as_an_app_and_names_are_checked(users: Users, store: Store):
    user, _, _ = users.add("grace", admin=True)
    assert user.admin and user.app_name == "grace"
    assert store.apps.get(user.app_id) is not None
    with pytest.raises(Conflict):
        users.add("grace")
    with pytest.raises(NotFound):
        users.add("linus", "no-such-app")
    linked, _, _ = users.add("linus", "grace")
    assert linked.app_id == user.app_id and linked.admin
    with pytest.raises(InvalidInput):
        users.add("Not A Name")
    store.apps.revoke("grace")
    [_, again] = users.all()
    assert not again.admin


def test_no_secret_is_stored_in_plain_form(users: Users, store: Store, tmp_path: Path):
    token, totp = enrolled(users)
    user = users.login("ada", PASSWORD, totp.now())
    session, _ = users.open_session(user)
    with store.engine.connect() as conn:
        rows = [str(r) for t in ("users", "console_sessions")
                for r in conn.execute(text(f"SELECT * FROM {t}"))]
    dump = "\n".join(rows)
    for secret in (totp.secret, PASSWORD, token, session):
        assert secret not in dump
    assert "$argon2id$" in dump
    other = Users(store.db, SecretBox.at(tmp_path / "other.key"), store.limiter)  # the key is outside the DB
    with pytest.raises(StorageError, match="console key"):
        other.login("ada", PASSWORD, totp.now())


def test_the_key_file_must_be_private(tmp_path: Path):
    SecretBox.at(tmp_path / "k")
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    (tmp_path / "k").chmod(0o644)
    with pytest.raises(StorageError, match="chmod 600"):
        SecretBox.at(tmp_path / "k")


def test_a_reset_ends_the_old_sign_in_and_a_removed_person_cannot_sign_in(users: Users):
    _, totp = enrolled(users)
    user = users.login("ada", PASSWORD, totp.now())
    session, _ = users.open_session(user)
    again, token, _ = users.reset("ada")
    assert not again.enrolled and users.session(session) is None
    later = utcnow() + dt.timedelta(seconds=90)
    with pytest.raises(Unauthenticated, match="wrong"):
        users.login("ada", PASSWORD, totp.at(later), now=later)
    _, secret, _ = users.enrolment(token)
    assert secret != totp.secret  # a new authenticator entry
    fresh = pyotp.TOTP(secret)
    users.enrol(token, PASSWORD, fresh.now())
    user = users.login("ada", PASSWORD, fresh.at(later), now=later)
    session, _ = users.open_session(user)
    assert users.remove("ada") and not users.remove("ada")
    assert users.session(session) is None and users.all() == []
    with pytest.raises(NotFound):
        users.reset("ada")


def test_parallel_wrong_guesses_all_count(users: Users):
    from concurrent.futures import ThreadPoolExecutor

    _, totp = enrolled(users)

    def guess(_: int) -> str:
        try:
            users.login("ada", "wrong password entirely", totp.now())
        except RateLimited:
            return "locked"
        except Unauthenticated:
            return "wrong"
        return "in"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(guess, range(2 * MAX_FAILURES)))
    assert "in" not in outcomes and "locked" in outcomes, outcomes
    with pytest.raises(RateLimited, match="locked until"):
        users.login("ada", PASSWORD, totp.now())


def test_a_name_nobody_has_locks_like_a_real_one(users: Users):
    for _ in range(MAX_FAILURES - 1):
        with pytest.raises(Unauthenticated, match="wrong user name, password or code"):
            users.login("nobody", "wrong password entirely", "123456")
    with pytest.raises(RateLimited, match="locked until"):
        users.login("nobody", "wrong password entirely", "123456")


def test_a_refusal_takes_as_long_whatever_the_name_and_the_lock(users: Users):
    """Each refusal pays one password check, so its time tells nothing: not whether the name
    exists, nor (with five wrong tries first) whether a locked account is a real one."""
    _, totp = enrolled(users)
    wrong = "wrong password entirely"

    def timed(name: str, refusal: type[Exception]) -> float:
        start = time.perf_counter()
        with pytest.raises(refusal):
            users.login(name, wrong, totp.now())
        return time.perf_counter() - start

    def alike(a: list[float], b: list[float]) -> bool:
        # Medians of interleaved tries (a busy machine slows both), within a factor of two:
        # the check is a tenth of a second or more, a database round trip a few ms.
        ma, mb = statistics.median(a), statistics.median(b)
        return 0.5 <= ma / mb <= 2

    # The tries before the lock, then the one that sets it off, then tries while locked.
    real, unknown = [], []
    for _ in range(MAX_FAILURES - 1):
        real.append(timed("ada", Unauthenticated))
        unknown.append(timed("nobody", Unauthenticated))
    assert alike(real, unknown), (real, unknown)
    timed("ada", RateLimited)
    timed("nobody", RateLimited)
    real, unknown = [], []
    for _ in range(MAX_FAILURES - 1):
        real.append(timed("ada", RateLimited))
        unknown.append(timed("nobody", RateLimited))
    assert alike(real, unknown), (real, unknown)
