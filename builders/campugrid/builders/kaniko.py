"""Kaniko builds through the Docker-compatible API of the provider's rootless Podman.

Kaniko runs RUN steps directly in its own root filesystem, so the executor container itself
must be the sandbox: the Podman service it is started on runs runsc as its runtime, and the
builder refuses to start a build whose container did not get runsc (as Podman itself records
it, not as the Docker API reports it, which says "oci" for every runtime). The executor image
is made from a maintained fork's Go module (infra/kaniko.sh; upstream Kaniko is archived).

Its network is the Buildah builder's (buildah.py): offline, the container has none; with the
agent's egress proxy, the Podman service runs in a network namespace of its own (in the
provider's user namespace: `podman unshare unshare --net`) whose only interface is its
loopback, where relay.py carries each connection to the proxy's unix socket. The executor
shares that namespace (runsc `network=host`: its sockets are the namespace's), and its RUN
steps get the relay as their HTTP(S) proxy (Docker's predefined proxy build arguments);
nothing else there leads anywhere.

The sandbox has no registry, so the bases come with the build: each allowed base the
Dockerfile starts from is copied out of the provider's store into Kaniko's base-image cache
(a docker-archive named by the base's digest, mounted read-only), and Kaniko is given the
Dockerfile with those FROM lines pinned to that digest (dockerfiles.pin_bases: lines
replaced, nothing parsed again), which is how its cache is looked up without a registry.
A FROM Kaniko reads differently from the policy finds no such base and fails the build.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from campugrid.builders.base import BuilderCapabilities
from campugrid.builders.buildah import NETWORK_FLAGS, PROXY_PORT, RELAY
from campugrid.buildpolicy.dockerfiles import BaseUse, check_dockerfile, pin_bases
from campugrid.protocol.errors import BuildFailed, InvalidInput
from campugrid.sandbox import store_lock
from campugrid.sandbox.podman_runsc import RUNSC_FLAGS
from campugrid.sandbox.process import LogFn

# The executor image infra/kaniko.sh makes in a provider's store (chainguard-dev/kaniko, built
# from its Go module at this version; the image's own revision after it).
EXECUTOR_IMAGE = "localhost/campugrid/kaniko-executor:v1.25.11-2"
# Where the executor image keeps the certificates Kaniko trusts for its own fetches (its
# SSL_CERT_DIR: the host's CA bundle, infra/kaniko.sh), and where a build's extra ones join them.
EXECUTOR_CERTS = "/kaniko/ssl/certs"


def service_argv(socket: Path, podman: str = "podman", runsc: str = "runsc", *,
                 upper: Path | None = None, upper_mb: int = 0,
                 online: bool = False) -> list[str]:
    """The Podman API service whose every container runs under runsc, offline (`online`: on
    the sockets of the namespace the service runs in, see `_NETNS`). With `upper`, the
    executor's root is gVisor's overlay of `upper_mb` (a file in `upper`, unlinked as it is
    made): everything Kaniko writes there (the bases it unpacks, what RUN steps write, its
    snapshots) is held to that size, and nothing of it reaches the provider's store."""
    flags = list(NETWORK_FLAGS if online else RUNSC_FLAGS)
    if upper is not None:
        at = flags.index("overlay2=none")
        flags[at] = f"overlay2=root:dir={upper},size={upper_mb}m"
    return [podman, "--runtime", runsc, *flags, "system", "service", "--time=0", f"unix://{socket}"]


# Run in a new network namespace of the provider's user namespace: $1 a Python for the relay,
# $2 its file, $3 the egress proxy's socket, $4 the relay's output file; the rest is the
# service's command line. The relay brings the loopback up and listens on it at PORT.
_NETNS = """
set -e
python=$1 relay=$2 egress=$3 out=$4
shift 4
"$python" "$relay" PORT "$egress" >"$out" 2>&1 &
i=0
until grep -q ready "$out" 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 200 ] && kill -0 $! 2>/dev/null || { cat "$out" >&2; exit 1; }
  sleep 0.05
done
exec "$@"
""".replace("PORT", str(PROXY_PORT))
PROXY = f"http://127.0.0.1:{PROXY_PORT}"
# Docker's predefined proxy arguments: RUN steps see them without an ARG line, images keep none
PROXY_ARGS = tuple((name, PROXY) for name in ("http_proxy", "https_proxy", "HTTP_PROXY",
                                              "HTTPS_PROXY"))


def executor_args(tag: str, online: bool = False) -> list[str]:
    # --reproducible: no timestamps, so equal inputs give equal digests (pushed afterwards
    # from the provider's store, as Buildah's builds are). --force: gVisor hides what
    # Kaniko's "am I in a container" check looks for. The cache is for bases only (below):
    # no layer is cached or pushed anywhere.
    proxies = [f"--build-arg={name}={value}" for name, value in PROXY_ARGS] if online else []
    return [*proxies, "--dockerfile=/build/Dockerfile", "--context=dir:///workspace", "--no-push",
            "--reproducible", "--force",
            "--cache=true", "--cache-dir=/bases", "--cache-repo=oci:/kaniko/no-cache",
            "--no-push-cache", "--cache-run-layers=false", "--cache-copy-layers=false",
            "--cache-ttl=87600h",
            f"--destination={tag}", "--tar-path=/image/image.tar", "--snapshot-mode=redo",
            "--log-format=text"]


def container_config(image: str, context_dir: Path, work: Path, tag: str, image_dir: Path,
                     *, online: bool = False,
                     volumes: Sequence[tuple[Path, str]] = ()) -> dict[str, Any]:
    """docker-py `containers.create` arguments for one build: the context and the build's
    own files (its pinned Dockerfile, its bases) read-only, as are `volumes` (extra
    certificates, at the paths RUN steps find them, and among those Kaniko trusts for its own
    fetches, EXECUTOR_CERTS); the image written to `image_dir` (which RUN steps can write to as
    well: it is the only host folder they can). `online`: in the service's own network
    namespace (the relay's loopback), the executor's own fetches (ADD's URLs) through the
    relay too."""
    return {
        "image": image,
        "command": executor_args(tag, online),
        "runtime": "runsc",  # asked for; the service's runtime decides, and is checked after
        "network_mode": "host" if online else "none",
        "environment": dict(PROXY_ARGS) if online else {},
        "volumes": {str(context_dir): {"bind": "/workspace", "mode": "ro"},
                    str(work / "build"): {"bind": "/build", "mode": "ro"},
                    str(work / "bases"): {"bind": "/bases", "mode": "ro"},
                    **{str(host): {"bind": inside, "mode": "ro"} for host, inside in volumes},
                    str(image_dir): {"bind": "/image", "mode": "rw"}},
        # The same files again, where Kaniko reads them (`volumes` can name a host path once)
        "mounts": [{"Type": "bind", "Source": str(host), "Target": f"{EXECUTOR_CERTS}/extra-{n}.pem",
                    "ReadOnly": True} for n, (host, _) in enumerate(volumes)],
        "detach": True,
        "labels": {"campugrid.build": tag},
    }


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """`sig` to the process's session's group (the pid stays its id while any member lives)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


class KanikoBuilder:
    name = "kaniko"
    online = True  # RUN steps may reach the egress proxy

    def __init__(self, executor_image: str, podman: str = "podman", runsc: str = "runsc") -> None:
        self.executor_image = executor_image
        self.podman = shutil.which(podman) or podman
        self.runsc = runsc  # as Podman is given it, and records it for the container
        self.skopeo = shutil.which("skopeo") or "skopeo"
        self.scope = ""  # Kaniko's containers run under the API service, outside job cgroups

    @contextmanager
    def _client(self, work: Path, upper_mb: int, egress: Path | None = None) -> Iterator[Any]:
        """A Podman API service of this build's own (its socket in the build's directory),
        stopped with the build: nothing is left listening between builds, and no socket another
        process left behind (or one that died) is ever taken for a live service. Its
        executor's root holds `upper_mb` (service_argv). With `egress`, it runs in a network
        namespace of its own with the relay to that socket (`_NETNS`)."""
        import docker

        socket = work / "api.sock"
        (work / "upper").mkdir()
        argv = service_argv(socket, self.podman, self.runsc, upper=work / "upper",
                            upper_mb=upper_mb, online=egress is not None)
        if egress is not None:
            argv = [self.podman, "unshare", "unshare", "--net", "--", "/bin/sh", "-c", _NETNS,
                    "campugrid-kaniko-netns", sys.executable, str(RELAY), str(egress),
                    str(work / "relay.out"), *argv]
        # A session of its own: stopped as a whole (the relay too) when the build ends.
        service = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while not socket.exists():
                if service.poll() is not None:
                    err = service.stderr.read().decode("utf-8", "replace") if service.stderr else ""
                    raise BuildFailed("the Podman API service for Kaniko did not start", err[-2000:])
                if time.monotonic() > deadline:
                    raise BuildFailed(f"the Podman API service did not start at {socket}")
                time.sleep(0.05)
            client = docker.DockerClient(base_url=f"unix://{socket}", version="1.41")
            try:
                yield client
            finally:
                client.close()
        finally:
            _signal_group(service, signal.SIGTERM)
            try:
                service.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_group(service, signal.SIGKILL)
                service.wait()
            _signal_group(service, signal.SIGKILL)  # whatever of it outlived its leader

    def has_executor(self) -> bool:
        return subprocess.run([self.podman, "image", "exists", self.executor_image],
                              capture_output=True, check=False).returncode == 0

    def capabilities(self) -> BuilderCapabilities:
        # gVisor's overlay of the executor's root; /image, the one host folder its RUN steps
        # can write to, only on the output slot's bounded disk (`store_on`)
        return BuilderCapabilities(bounded_store=True, bounded_without_slot=False)

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
        the policy only: Kaniko resolves FROM inside its own sandbox, which has no registry.
        What the build writes is held to `disk_mb` beyond its bases' own size (Kaniko unpacks
        them into the root it builds in); the folder it writes the image to (where a RUN step
        can write too) is on `store_on`, the output slot's bounded disk, when there is one.
        `dockerfile`, the agent's copy, must name the bases as `pins` says."""
        if not self.has_executor():
            raise BuildFailed(f"Kaniko executor image {self.executor_image} is not on this "
                              "provider; configure another or use the buildah builder")
        text = (context_dir / "Dockerfile").read_text()
        if bases is None:  # not checked by the caller: check here, with this host's policy
            try:
                bases = check_dockerfile(text).bases
            except InvalidInput as e:
                raise BuildFailed(str(e)) from e
        text = dockerfile.read_text() if dockerfile is not None else \
            pin_bases(text, self.pins(bases))
        with tempfile.TemporaryDirectory(prefix="kaniko-") as tmp, \
                tempfile.TemporaryDirectory(prefix="kaniko-image-", dir=store_on) as out:
            work, image_dir = Path(tmp), Path(out)
            for part in ("build", "bases"):
                (work / part).mkdir()
            self._archives(bases, work / "bases")
            (work / "build" / "Dockerfile").write_text(text)
            bases_mb = sum(f.stat().st_size for f in (work / "bases").iterdir()) // 1024**2
            config = container_config(self.executor_image, context_dir, work, tag, image_dir,
                                      online=egress is not None, volumes=volumes)
            with self._client(work, bases_mb + disk_mb, egress) as client:
                self._run(client, config, log=log, timeout_s=timeout_s, cancel=cancel,
                          disk_mb=disk_mb)
            made = (image_dir / "image.tar").stat().st_size // 1024**2
            if made > bases_mb + disk_mb:  # /image is the executor's one way out of its overlay
                raise BuildFailed(f"the build used more than {disk_mb} MB of disk (its image is "
                                  f"{made} MB, its bases {bases_mb} MB)", "")
            # Not `podman load`: it applies whatever tags the (untrusted) archive names, which
            # could retag the base image for every later job. skopeo stores it as `tag` only.
            with store_lock.writing():
                loaded = subprocess.run(
                    [self.skopeo, "copy", "--quiet", f"docker-archive:{image_dir / 'image.tar'}",
                     f"containers-storage:{tag}"], capture_output=True, text=True, check=False)
            if loaded.returncode != 0:
                raise BuildFailed("cannot load the built image", loaded.stderr[-2000:])
        return tag

    def _run(self, client: Any, config: dict[str, Any], *, log: LogFn, timeout_s: float,
             cancel: threading.Event | None, disk_mb: int) -> None:
        """The executor's container (`config`: container_config's), from its creation to its
        removal."""
        import docker.errors

        try:
            container = client.containers.create(**config)
        except docker.errors.DockerException as e:
            raise BuildFailed(f"cannot create the Kaniko container: {e}") from e
        try:
            runtime = self._runtime_of(container.id)
            if runtime != self.runsc:
                raise BuildFailed(f"refusing to build: the executor would run under "
                                  f"{runtime!r}, not {self.runsc!r}")
            container.start()
            tail: deque[str] = deque(maxlen=40)
            reader = threading.Thread(target=self._follow, args=(container, log, tail), daemon=True)
            reader.start()
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
            code = container.wait(timeout=10).get("StatusCode", -1)
            reader.join(timeout=10)  # the stream ends with the container
            if code != 0:
                said = "\n".join(tail)
                if "no space left on device" in said.lower():
                    raise BuildFailed(f"the build used more than {disk_mb} MB of disk "
                                      "(resources.build_mb bounds what its steps write, beyond "
                                      "the bases Kaniko unpacks)", said)
                raise BuildFailed(f"build failed (kaniko exit {code})", said)
        finally:
            container.remove(force=True)

    @staticmethod
    def _follow(container: Any, log: LogFn, tail: deque[str]) -> None:
        """The executor's output, line by line as it comes (the build log a researcher watches)."""
        pending = b""
        for chunk in container.logs(stream=True, follow=True):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                tail.append(line)
                log(line)
        if pending:
            tail.append(pending.decode("utf-8", "replace"))
            log(tail[-1])

    def _runtime_of(self, container_id: str) -> str:
        """The OCI runtime Podman runs this container with (the Docker API's inspect says
        "oci" whatever it is)."""
        out = subprocess.run([self.podman, "container", "inspect", "--format", "{{.OCIRuntime}}",
                              container_id], capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else f"unknown ({out.stderr.strip()})"

    def pins(self, bases: Sequence[BaseUse]) -> dict[BaseUse, str]:
        """What each FROM must become for Kaniko to find its base without a registry: the
        provider's base pinned to its digest, which names it in Kaniko's base cache."""
        pinned: dict[BaseUse, str] = {}
        for use in bases:
            name = use.allowed.name
            last = name.rsplit("/", 1)[-1]
            repository = name.rsplit(":", 1)[0] if ":" in last else name
            pinned[use] = f"{repository}@{self._digest(use)}"
        return pinned

    def _digest(self, use: BaseUse) -> str:
        if use.remote or use.copy:
            raise BuildFailed(f"{use.said}: the kaniko builder starts only from the provider's "
                              "own bases; use the buildah builder")
        name = use.allowed.name
        found = subprocess.run([self.podman, "image", "inspect", "--format", "{{.Digest}}", name],
                               capture_output=True, text=True, check=False)
        digest = found.stdout.strip()
        if found.returncode != 0 or not digest.startswith("sha256:"):
            raise BuildFailed(f"{use.said}: not in this provider's image store")
        if use.digest and use.digest != digest:
            raise BuildFailed(f"{use.said}@{use.digest}: this provider's {name} is {digest}")
        return digest

    def _archives(self, bases: Sequence[BaseUse], into: Path) -> None:
        """Each allowed base into Kaniko's base cache (`into`), a docker-archive named by its
        digest."""
        for use in bases:
            name, digest = use.allowed.name, self._digest(use)
            archive = into / digest
            if not archive.exists():
                part = into / "part.tar"  # skopeo reads a colon in the path as a reference
                copied = subprocess.run([self.skopeo, "copy", "--quiet", f"containers-storage:{name}",
                                         f"docker-archive:{part}"],
                                        capture_output=True, text=True, check=False)
                if copied.returncode != 0:
                    raise BuildFailed(f"{use.said}: cannot copy it for Kaniko", copied.stderr[-2000:])
                part.rename(archive)
