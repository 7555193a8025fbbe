from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.platform import ProviderUser
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.coordinator.objects import S3Store
from tests.support.postgres import TempPostgres

# Agents the tests start (Platform.start_agent passes this on; so does `campugrid up`) ask for
# work every 0.2 s, not every second: a job starts up to 0.8 s sooner, some hundred times a
# run. The product's default stays 1.0 s (bench/idle.py measures an idle agent at that).
os.environ.setdefault("CAMPUGRID_AGENT_POLL_SECONDS", "0.2")


def _shared_tmp(prefix: str) -> Path:
    """A temporary folder the provider user can traverse (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o711)
    return path


@pytest.fixture(scope="session")
def provider() -> ProviderUser:
    user = ProviderUser.resolve()
    user.prepare()
    return user


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedS3]:
    root = _shared_tmp("campugrid-s3-")
    server = EmbeddedS3(root / "s3", "test", secrets.token_urlsafe(24)).start()
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def s3(s3_server: EmbeddedS3) -> S3Store:
    """A fresh bucket per test on the session's SeaweedFS."""
    store = S3Store(s3_server.endpoint, s3_server.access_key, s3_server.secret_key,
                    f"t-{secrets.token_hex(6)}")
    store.ensure_bucket()
    return store


@pytest.fixture(scope="session")
def postgres() -> Iterator[TempPostgres]:
    root = _shared_tmp("campugrid-pg-")
    pg = TempPostgres(root).start()
    yield pg
    pg.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    path = _shared_tmp("campugrid-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Marks a test whose body failed (`item.failed`), for fixtures that keep evidence then
    (the console's browser screenshots)."""
    report = yield
    if report.when == "call" and report.failed:
        item.failed = True  # type: ignore[attr-defined]
    return report
