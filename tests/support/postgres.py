"""A throwaway PostgreSQL cluster for the tests: initdb in a temporary folder, loopback only."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, text

from campugrid.cli.seaweed import free_port


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class TempPostgres:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/postgres"

    @contextlib.contextmanager
    def database(self, prefix: str = "t") -> Iterator[str]:
        """A new, empty database in this cluster (its URL), dropped afterwards."""
        name = f"{prefix}_{secrets.token_hex(6)}"
        admin = create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f"CREATE DATABASE {name}"))
            yield self.url.rsplit("/", 1)[0] + f"/{name}"
            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        finally:
            admin.dispose()

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def start(self) -> TempPostgres:
        initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise RuntimeError("PostgreSQL is not installed (infra/setup.sh installs it)")
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        data = self.root / "data"
        subprocess.run(self._as_owner([initdb, "-D", str(data), "-A", "trust", "-U", self.user,
                                       "--no-sync"]), check=True, capture_output=True)
        subprocess.run(self._as_owner([
            pg_ctl, "-D", str(data), "-l", str(self.root / "log"), "-w", "start", "-o",
            f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} "
            "-c fsync=off -c max_connections=200"]), check=True, capture_output=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if subprocess.run(self._as_owner([_bin("pg_isready") or "pg_isready", "-h", "127.0.0.1",
                                              "-p", str(self.port)]), capture_output=True).returncode == 0:
                return self
            time.sleep(0.2)
        raise RuntimeError(f"PostgreSQL did not start; see {self.root / 'log'}")

    def stop(self) -> None:
        pg_ctl = _bin("pg_ctl")
        if pg_ctl is not None:
            subprocess.run(self._as_owner([pg_ctl, "-D", str(self.root / "data"), "-m", "immediate",
                                           "stop"]), capture_output=True)
