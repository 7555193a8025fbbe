"""Kaniko builds through the Docker-compatible API of the provider's rootless Podman.

Kaniko runs RUN steps directly in its own root filesystem, so the executor container itself
must be the sandbox: the Podman service it is started on runs runsc as its runtime with no
network, and the builder refuses to start a build whose container did not get runsc.
The executor image is configuration: upstream Kaniko is archived, maintained forks exist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from campugrid.builders.base import BuilderCapabilities
from campugrid.buildpolicy.dockerfiles import BaseUse
from campugrid.protocol.errors import BuildFailed
from campugrid.sandbox.podman_runsc import RUNSC_FLAGS
from campugrid.sandbox.process import LogFn


def default_socket() -> Path:
    return Path(f"/run/user/{os.geteuid()}/podman/campugrid-kaniko.sock")


def service_argv(socket: Path, podman: str = "podman", runsc: str = "runsc") -> list[str]:
    """The Podman API service whose every container runs under runsc, offline."""
    return [podman, "--runtime", runsc, *RUNSC_FLAGS, "system", "service", "--time=0", f"unix://{socket}"]


def executor_args(tag: str) -> list[str]:
    # --reproducible: no timestamps, so equal inputs give equal digests (pushed afterwards
    # from the provider's store, as Buildah's builds are).
    return ["--dockerfile=/workspace/Dockerfile", "--context=dir:///workspace", "--no-push",
            "--reproducible",
            f"--destination={tag}", "--tar-path=/image/image.tar", "--snapshot-mode=redo"]


def container_config(image: str, context_dir: Path, image_dir: Path, tag: str) -> dict[str, Any]:
    """docker-py `containers.create` arguments for one build."""
    return {
        "image": image,
        "command": executor_args(tag),
        "runtime": "runsc",  # asked for; the service's runtime decides, and is checked after
        "network_mode": "none",
        "volumes": {str(context_dir): {"bind": "/workspace", "mode": "ro"},
                    str(image_dir): {"bind": "/image", "mode": "rw"}},
        "detach": True,
        "labels": {"campugrid.build": tag},
    }


class KanikoBuilder:
    name = "kaniko"
    online = False  # its sandbox has no way out: builds are offline

    def __init__(self, executor_image: str, socket: Path | None = None,
                 podman: str = "podman") -> None:
        self.executor_image = executor_image
        self.socket = socket or default_socket()
        self.podman = shutil.which(podman) or podman
        self.skopeo = shutil.which("skopeo") or "skopeo"
        self._service: subprocess.Popen[bytes] | None = None
        self.scope = ""  # Kaniko's containers run under the API service, outside job cgroups

    def _client(self) -> Any:
        import docker

        if not self.socket.exists():
            self.socket.parent.mkdir(parents=True, exist_ok=True)
            self._service = subprocess.Popen(service_argv(self.socket, self.podman),
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True)
            deadline = time.monotonic() + 30
            while not self.socket.exists():
                if time.monotonic() > deadline:
                    raise BuildFailed(f"the Podman API service did not start at {self.socket}")
                time.sleep(0.1)
        return docker.DockerClient(base_url=f"unix://{self.socket}", version="1.41")

    def has_executor(self) -> bool:
        return subprocess.run([self.podman, "image", "exists", self.executor_image],
                              capture_output=True, check=False).returncode == 0

    def capabilities(self) -> BuilderCapabilities:
        return BuilderCapabilities(bounded_store=False)  # the executor writes where its container does

    def inputs(self, bases: Sequence[BaseUse]) -> dict[str, str]:
        # Kaniko resolves FROM inside its sandbox; the executor image decides the rest.
        return {"builder": f"kaniko {self.executor_image}",
                **{f"base {use.allowed.name}": use.allowed.digest or use.digest or "unpinned"
                   for use in bases}}

    def build(self, context_dir: Path, tag: str, *, log: LogFn, timeout_s: float,
              cancel: threading.Event | None = None, memory_mb: int = 4096,
              cpus: float = 2.0, disk_mb: int = 512,
              bases: Sequence[BaseUse] | None = None, dockerfile: Path | None = None,
              volumes: Sequence[tuple[Path, str]] = (), egress: Path | None = None,
              store_on: Path | None = None) -> str:
        """memory_mb and cpus are not applied: the API service's containers are outside the
        job cgroups (and rootless cgroup v1 ignores the API's limits). `bases` are checked by
        the policy only: Kaniko resolves FROM inside its own sandbox, which has no registry."""
        import docker.errors

        if volumes:
            raise BuildFailed("the kaniko builder cannot give RUN steps files of the machine's "
                              "(extra certificates); use the buildah builder")
        if dockerfile is not None:
            raise BuildFailed("the kaniko builder cannot start from images on registries (its "
                              "sandbox has none); use the buildah builder")
        if not self.has_executor():
            raise BuildFailed(f"Kaniko executor image {self.executor_image} is not on this "
                              "provider; configure another or use the buildah builder")
        client = self._client()
        with tempfile.TemporaryDirectory(prefix="kaniko-") as tmp:
            image_dir = Path(tmp)
            try:
                container = client.containers.create(
                    **container_config(self.executor_image, context_dir, image_dir, tag))
            except docker.errors.DockerException as e:
                raise BuildFailed(f"cannot create the Kaniko container: {e}") from e
            try:
                runtime = container.attrs.get("OCIRuntime") or container.attrs.get(
                    "HostConfig", {}).get("Runtime")
                if runtime != "runsc":
                    raise BuildFailed(f"refusing to build: the executor would run under "
                                      f"{runtime!r}, not runsc")
                container.start()
                deadline = time.monotonic() + timeout_s
                while True:
                    container.reload()
                    if container.status not in ("created", "running"):
                        break
                    if cancel is not None and cancel.is_set():
                        raise BuildFailed("build cancelled")
                    if time.monotonic() > deadline:
                        raise BuildFailed(f"build took longer than {timeout_s:.0f} s")
                    time.sleep(0.2)
                lines = container.logs().decode("utf-8", "replace").splitlines()
                for line in lines:
                    log(line)
                code = container.wait(timeout=10).get("StatusCode", -1)
                if code != 0:
                    raise BuildFailed(f"build failed (kaniko exit {code})", "\n".join(lines[-40:]))
            finally:
                container.remove(force=True)
            # Not `podman load`: it applies whatever tags the (untrusted) archive names, which
            # could retag the base image for every later job. skopeo stores it as `tag` only.
            loaded = subprocess.run(
                [self.skopeo, "copy", "--quiet", f"docker-archive:{image_dir / 'image.tar'}",
                 f"containers-storage:{tag}"], capture_output=True, text=True, check=False)
            if loaded.returncode != 0:
                raise BuildFailed("cannot load the built image", loaded.stderr[-2000:])
        return tag
