"""What the agent asks of its own Podman besides starting sandboxes: inspect, signal, remove
and list containers (by label), and list, inspect (size, layers, environment), read a file
of, tag and remove images.

Two implementations with one contract (tests/integration/test_podman_ops.py runs the same
cases through both):
- `ApiOps`: podman-py on the agent's own `podman system service`, started on a private
  socket (0600, in the user's runtime folder) and killed with the agent by a guard. The
  default: one HTTP request on a warm service instead of a process per question.
- `CliOps`: the podman command line, where the service cannot start.

Starting a sandbox stays on the command line (podman_runsc.py): runsc needs per-container
runtime flags (network=none, ignore-cgroups) that the REST API cannot carry, and the sandbox
must start inside the job's cgroup, which only a process we launch can do. Pulls and pushes
stay with skopeo (agent/images.py): the registry's bearer token only travels that way.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

from campugrid.guards import guard, release_guard
from campugrid.sandbox import store_lock

log = logging.getLogger(__name__)
NEVER = "0001-01-01"  # Podman's StartedAt for a container that never started


class PodmanOps(Protocol):
    def state(self, name: str) -> dict[str, Any] | None:
        """The container's State (Running, ExitCode, StartedAt, ConmonPid), None if absent."""
        ...

    def kill(self, name: str, signal: str) -> None: ...

    def remove(self, name: str) -> None:
        """Remove it at once (killing what runs), if it is there."""
        ...

    def labelled(self, key: str, value: str) -> list[str]:
        """The names of all containers (running or not) with label key=value."""
        ...

    def images(self) -> list[str]:
        """Every image name (repository:tag) in the store."""
        ...

    def image_size(self, ref: str) -> int | None:
        """Bytes, None if there is no such image."""
        ...

    def image_layers(self, ref: str) -> list[str] | None:
        """The image's layers as its configuration lists them (diff ids, base first), None if
        there is no such image. Only as trustworthy as whoever wrote that configuration."""
        ...

    def image_env(self, ref: str) -> list[str] | None:
        """The image's environment (NAME=value), None if there is no such image."""
        ...

    def image_id(self, ref: str) -> str | None:
        """The image's ID (its configuration's digest: in one store, it names one image),
        None if there is no such image."""
        ...

    def layer_index(self) -> list[Path]:
        """containers-storage's own index of the layers in this user's store (the files that
        may hold it), as `podman info` places the store."""
        ...

    def image_file(self, ref: str, path: str, max_bytes: int) -> bytes | None:
        """One regular file of the image (a symlink followed inside the image's own root, as
        Podman copies out of a container), read from a container made for it and never
        started. None if the image or the file is not there, or it is not a regular file;
        ValueError past `max_bytes`."""
        ...

    def tag(self, ref: str, new: str) -> None:
        """Give the image another name (under store_lock.writing)."""
        ...

    def remove_image(self, ref: str) -> bool:
        """Remove this name (the image goes with its last name), if it is there; False if
        it was left because another agent of this user is writing to the store (see
        store_lock): a later sweep removes it."""
        ...


def started_at(state: dict[str, Any] | None) -> float | bool | None:
    """When the container started (Unix time), False if it never did, None if unknown.
    Podman writes RFC 3339 with nanoseconds and the host's offset."""
    if state is None:
        return None
    text = str(state.get("StartedAt") or "")
    if not text or text.startswith(NEVER):
        return False
    m = _RFC3339.match(text)
    if m is None:
        return None
    when = dt.datetime.fromisoformat(m["base"] + ("+00:00" if m["tz"] == "Z" else m["tz"]))
    return when.timestamp() + (float(f"0.{m['frac']}") if m["frac"] else 0.0)


_RFC3339 = re.compile(r"^(?P<base>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(?P<frac>\d+))?"
                      r"(?P<tz>Z|[+-]\d\d:\d\d)$")


class CliOps:
    def __init__(self, podman: str = "podman") -> None:
        self.podman = shutil.which(podman) or podman

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.podman, *args], capture_output=True, text=True,
                              timeout=timeout, check=False)

    def state(self, name: str) -> dict[str, Any] | None:
        out = self._run("container", "inspect", "--format", "{{json .State}}", name)
        if out.returncode != 0:
            return None
        try:
            got = json.loads(out.stdout)
        except ValueError:
            return None
        return got if isinstance(got, dict) else None

    def kill(self, name: str, signal: str) -> None:
        self._run("kill", "--signal", signal, name)

    def remove(self, name: str) -> None:
        self._run("rm", "--force", "--ignore", "--time", "0", name)

    def labelled(self, key: str, value: str) -> list[str]:
        return self._run("ps", "-a", "--filter", f"label={key}={value}",
                         "--format", "{{.Names}}").stdout.split()

    def images(self) -> list[str]:
        out = self._run("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        return [ref for ref in out if not ref.endswith(":<none>")]

    def image_size(self, ref: str) -> int | None:
        out = self._run("image", "inspect", "--format", "{{.Size}}", ref)
        return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() \
            else None

    def image_layers(self, ref: str) -> list[str] | None:
        return self._inspected_list(ref, ".RootFS.Layers")

    def image_env(self, ref: str) -> list[str] | None:
        return self._inspected_list(ref, ".Config.Env")

    def image_id(self, ref: str) -> str | None:
        out = self._run("image", "inspect", "--format", "{{.Id}}", ref)
        return out.stdout.strip() or None if out.returncode == 0 else None

    def _inspected_list(self, ref: str, field: str) -> list[str] | None:
        """A list field of `podman image inspect` (null: empty), None if there is no image."""
        out = self._run("image", "inspect", "--format", f"{{{{json {field}}}}}", ref)
        if out.returncode != 0:
            return None
        try:
            got = json.loads(out.stdout)
        except ValueError:
            return None
        return [str(e) for e in got or []] if got is None or isinstance(got, list) else None

    def layer_index(self) -> list[Path]:
        out = self._run("info", "--format", "{{.Store.GraphRoot}}\t{{.Store.GraphDriverName}}")
        root, _, driver = out.stdout.strip().partition("\t")
        return _layer_index(root, driver)

    def image_file(self, ref: str, path: str, max_bytes: int) -> bytes | None:
        name = _reader_name()
        if self._run("create", "--name", name, "--network", "none", "--entrypoint", "",
                     ref, "true").returncode != 0:
            return None
        try:
            with subprocess.Popen([self.podman, "cp", f"{name}:{path}", "-"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
                assert proc.stdout is not None
                try:
                    return _file_in_tar(proc.stdout, max_bytes)
                finally:
                    proc.kill()
        finally:
            self.remove(name)

    def tag(self, ref: str, new: str) -> None:
        with store_lock.writing():
            self._run("tag", ref, new)

    def remove_image(self, ref: str) -> bool:
        with store_lock.removing() as held:
            if held:
                self._run("rmi", "--force", ref, timeout=120)
            return held


class ApiOps:
    """podman-py on this agent's own API service."""

    def __init__(self, socket: Path, podman: str = "podman") -> None:
        from podman import PodmanClient

        self.podman = shutil.which(podman) or podman
        self.socket = socket
        socket.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        socket.unlink(missing_ok=True)
        self.log = socket.with_suffix(".log")  # what the service said, for the refusal below
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as err:
            self.service = subprocess.Popen(
                [self.podman, "system", "service", "--time=0", f"unix://{socket}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True)
        # It dies with us, even by SIGKILL: asked to stop first (it finishes what it is doing
        # and lets go of its locks), killed after two seconds.
        pid = self.service.pid
        self._guard = guard(pid, ["/bin/sh", "-c", f"kill -TERM {pid} 2>/dev/null; i=0; "
                                  f"while kill -0 {pid} 2>/dev/null && [ $i -lt 10 ]; do "
                                  "sleep 0.2; i=$((i + 1)); done"])
        try:
            deadline = time.monotonic() + 30
            while not socket.exists():
                if self.service.poll() is not None or time.monotonic() > deadline:
                    said = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                    raise OSError(f"podman system service did not start on {socket}"
                                  + (f": {' / '.join(said)}" if said else ""))
                time.sleep(0.02)
            os.chmod(socket, 0o600)
            self.client = PodmanClient(base_url=f"unix://{socket}", timeout=60)
            self.client.version()  # type: ignore[no-untyped-call]  # answers: up
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.service.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.service.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.service.wait(timeout=10)
        release_guard(self._guard)
        self.socket.unlink(missing_ok=True)
        self.log.unlink(missing_ok=True)

    def _container(self, name: str) -> Any:
        from podman.errors import APIError, NotFound

        try:
            return self.client.containers.get(name)
        except NotFound:
            return None
        except APIError as e:
            # Podman answers 500 for a container it is removing at that moment (its name
            # still resolves, its record is gone: "does not exist in database: no such
            # container"), as a --rm sandbox is once it dies: gone, as for 404.
            if "no such container" in str(e):
                return None
            raise

    def state(self, name: str) -> dict[str, Any] | None:
        found = self._container(name)
        return dict(found.attrs.get("State") or {}) if found is not None else None

    def kill(self, name: str, signal: str) -> None:
        from podman.errors import APIError

        found = self._container(name)
        if found is not None:
            with contextlib.suppress(APIError):  # it ended meanwhile
                found.kill(signal=signal)

    def remove(self, name: str) -> None:
        from podman.errors import APIError, NotFound

        # SIGKILL first: the API's forced removal would send SIGTERM and wait (podman-py has
        # no `timeout` for it); this is `rm --force --time 0`.
        self.kill(name, "KILL")
        with contextlib.suppress(NotFound, APIError):
            self.client.containers.remove(name, force=True, v=True)

    def labelled(self, key: str, value: str) -> list[str]:
        return [c.name for c in self.client.containers.list(
            all=True, filters={"label": f"{key}={value}"})]

    def images(self) -> list[str]:
        from podman.errors import APIError

        for attempt in range(3):
            try:
                return [tag for image in self.client.images.list() for tag in image.tags]
            except APIError:
                # Podman lists, then inspects each image: one removed in between (by another
                # process of this user) fails the whole listing. Ask again.
                if attempt == 2:
                    raise
                time.sleep(0.2)
        return []

    def image_size(self, ref: str) -> int | None:
        from podman.errors import ImageNotFound

        try:
            return int(self.client.images.get(ref).attrs.get("Size") or 0)
        except ImageNotFound:
            return None

    def image_layers(self, ref: str) -> list[str] | None:
        from podman.errors import ImageNotFound

        try:
            got = (self.client.images.get(ref).attrs.get("RootFS") or {}).get("Layers")
        except ImageNotFound:
            return None
        return [str(d) for d in got] if isinstance(got, list) else None

    def image_env(self, ref: str) -> list[str] | None:
        from podman.errors import ImageNotFound

        try:
            got = (self.client.images.get(ref).attrs.get("Config") or {}).get("Env")
        except ImageNotFound:
            return None
        return [str(e) for e in got or []] if got is None or isinstance(got, list) else None

    def image_id(self, ref: str) -> str | None:
        from podman.errors import ImageNotFound

        try:
            return str(self.client.images.get(ref).attrs.get("Id") or "") or None
        except ImageNotFound:
            return None

    def layer_index(self) -> list[Path]:
        store = self.client.info().get("store") or {}  # type: ignore[no-untyped-call]
        return _layer_index(str(store.get("graphRoot") or ""),
                            str(store.get("graphDriverName") or ""))

    def image_file(self, ref: str, path: str, max_bytes: int) -> bytes | None:
        from podman.errors import APIError, ImageNotFound, NotFound

        name = _reader_name()
        if not self.client.images.exists(ref):
            return None
        try:
            made = self.client.containers.create(ref, command=["true"], name=name,
                                                 network_mode="none", entrypoint=[])
        except (ImageNotFound, NotFound):  # removed meanwhile
            return None
        try:
            try:
                chunks, _ = made.get_archive(path)
            except (NotFound, APIError):
                return None
            return _file_in_tar(io.BufferedReader(_ChunkReader(iter(chunks))), max_bytes)
        finally:
            self.remove(name)

    def tag(self, ref: str, new: str) -> None:
        repo, _, tag = new.rpartition(":")
        with store_lock.writing():
            self.client.images.get(ref).tag(repo, tag)

    def remove_image(self, ref: str) -> bool:
        from podman.errors import APIError, ImageNotFound

        with store_lock.removing() as held:
            if held:
                with contextlib.suppress(ImageNotFound, APIError):
                    self.client.images.remove(ref, force=True)
            return held


def _reader_name() -> str:
    return f"campugrid-read-{os.getpid()}-{time.monotonic_ns()}"


def _file_in_tar(stream: IO[bytes], max_bytes: int) -> bytes | None:
    """The first member of a tar stream (what `podman cp` writes): its bytes if it is a
    regular file of at most `max_bytes`, read no further than that."""
    with contextlib.ExitStack() as stack:
        try:
            tar = stack.enter_context(tarfile.open(fileobj=stream, mode="r|"))
        except tarfile.ReadError:  # nothing written: no such file
            return None
        member = tar.next()
        if member is None or not member.isfile():
            return None
        if member.size > max_bytes:
            raise ValueError(f"{member.name}: {member.size} bytes, more than {max_bytes}")
        got = tar.extractfile(member)
        return got.read(max_bytes) if got is not None else None
    return None  # not reached: the ExitStack does not swallow exceptions


class _ChunkReader(io.RawIOBase):
    """A file over an iterator of byte chunks (podman-py's archive stream)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.left = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.left:
            self.left = next(self.chunks, b"")
            if not self.left:
                return 0
        n = min(len(buffer), len(self.left))
        buffer[:n] = self.left[:n]
        self.left = self.left[n:]
        return n


def _layer_index(root: str, driver: str) -> list[Path]:
    if not root.startswith("/") or not driver.isalnum():
        raise OSError(f"Podman names no store ({root!r}, {driver!r})")
    folder = Path(root) / f"{driver}-layers"
    return [folder / "layers.json", folder / "volatile-layers.json"]


def connect(runtime_dir: Path, podman: str = "podman") -> PodmanOps:
    """The API service where it starts (a second try where the first did not: a service that
    met another Podman command's lock can give up), else the command line (and why, in the
    log)."""
    socket = runtime_dir / "campugrid" / f"podman-{os.getpid()}.sock"
    for attempt in (1, 2):
        try:
            return ApiOps(socket, podman)
        except ImportError as e:
            reason: Exception = e
            break
        except OSError as e:
            reason = e
            log.info("Podman's API service, try %d: %s", attempt, e)
    log.warning("Podman's API service is not usable (%s); using the podman command line", reason)
    return CliOps(podman)
