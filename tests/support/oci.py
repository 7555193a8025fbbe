"""Small OCI images written straight to an OCI layout folder (skopeo's `oci:DIR:TAG`), for
registry tests that need an image without any container storage."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from campugrid.cli.registry import EmbeddedRegistry
from campugrid.cli.seaweed import free_port


def _blob(layout: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


def oci_image(layout: Path, files: dict[str, bytes] | list[dict[str, bytes]],
              tag: str = "latest", *, gzipped: bool = False, mode: int = 0o644) -> str:
    """An image of one layer holding `files` (or of a layer per dict, base first), at
    `layout` (reproducible: same files, same digests), its layers gzipped or not, the files'
    mode `mode`; returns skopeo's reference to it."""
    layout.mkdir(parents=True, exist_ok=True)
    diff_ids, layers = [], []
    for contents in files if isinstance(files, list) else [files]:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in sorted(contents.items()):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, mode
                tar.addfile(info, io.BytesIO(data))
        tar_bytes = buf.getvalue()
        diff_ids.append(f"sha256:{hashlib.sha256(tar_bytes).hexdigest()}")
        layer = gzip.compress(tar_bytes, mtime=0) if gzipped else tar_bytes
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar"
                       + ("+gzip" if gzipped else ""),
                       "digest": _blob(layout, layer), "size": len(layer)})
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Cmd": ["/bin/true"]},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _blob(layout, config), "size": len(config)},
        "layers": layers}).encode()
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": _blob(layout, manifest), "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return f"oci:{layout}:{tag}"


PYTHON_SLIM = "localhost/campugrid-test/python-slim:3.11-v4"  # bump when its recipe changes
PYTHON_SLIM_HUB = "docker.io/library/python:3.11-slim"  # what it stands in for


def made_once(tag: str, as_user: list[str], fill: Callable[[Path], None]) -> str:
    """Image `tag` in the provider's store (`as_user`: the command prefix that runs as the
    provider), built once from the context `fill` writes into a folder (its Dockerfile
    included)."""
    if subprocess.run([*as_user, "podman", "image", "exists", tag],
                      capture_output=True, timeout=60).returncode == 0:
        return tag
    context = Path(tempfile.mkdtemp(prefix="image-"))
    try:
        fill(context)
        subprocess.run(["chmod", "-R", "a+rX", str(context)], check=True)
        done = subprocess.run([*as_user, "buildah", "bud", "--isolation", "chroot",
                               "--pull-never", "-q", "-t", tag, str(context)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        shutil.rmtree(context, ignore_errors=True)
    return tag


def python_slim(as_user: list[str]) -> str:
    """A stand-in for Docker Hub's `python:3.11-slim`, made from the local Debian base (no
    registry is reachable here): pip installed from Debian's own pip wheel, no
    EXTERNALLY-MANAGED marker, PYTHON_VERSION set as the official image sets it, and no
    NumPy (the local base has Debian's; the real image has none), `python` on the PATH, and
    the CA certificates a plain build's pip needs (this host's bundle). Made once in the
    provider's store."""

    def fill(context: Path) -> None:
        wheels = sorted(Path("/usr/share/python-wheels").glob("pip-*.whl"))
        assert wheels, "Debian's pip wheel is missing: apt-get install python3-pip-whl"
        for file in (*wheels, Path("/etc/ssl/certs/ca-certificates.crt")):
            shutil.copy(file, context / file.name)
        (context / "Dockerfile").write_text(
            "FROM localhost/campugrid/python:bookworm\n"
            "ENV PYTHON_VERSION=3.11.2\n"
            "COPY *.whl /tmp/wheels/\n"
            "COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt\n"
            f"RUN python3 /tmp/wheels/{wheels[-1].name}/pip install --no-index --quiet "
            "--break-system-packages /tmp/wheels/*.whl "
            "&& rm -rf /tmp/wheels /usr/lib/python3.11/EXTERNALLY-MANAGED "
            "&& dpkg --purge python3-numpy && ln -s /usr/bin/python3 /usr/local/bin/python\n")

    return made_once(PYTHON_SLIM, as_user, fill)


BUSYBOX = "localhost/campugrid-test/busybox:1.35-v2"  # bump when its recipe changes


def busybox_image(as_user: list[str]) -> str:
    """A 2 MB base (Debian's static BusyBox as /bin's tools) for tests of how a builder
    works, not of what it builds: a Kaniko build of the 440 MB Python base spent most of its
    35 s unpacking and snapshotting that base. Made once in the provider's store."""
    tools = ("sh", "cat", "echo", "sleep", "dd", "uname", "rm", "mkdir", "ls", "true", "env",
             "grep", "wget", "nc", "nslookup")

    def fill(context: Path) -> None:
        folder = context / "bin"
        folder.mkdir()
        shutil.copy("/bin/busybox", folder / "busybox")
        for tool in tools:
            (folder / tool).symlink_to("busybox")
        (context / "Dockerfile").write_text("FROM scratch\nCOPY bin /bin\nENV PATH=/bin\n")

    return made_once(BUSYBOX, as_user, fill)


MICROMAMBA = "localhost/campugrid-test/micromamba:2.0.5-v1"  # bump when its recipe changes
MICROMAMBA_HUB = "mambaorg/micromamba:2.0.5"  # what it stands in for, as Docker Hub names it


def micromamba_image(as_user: list[str]) -> str:
    """A stand-in for Docker Hub's `mambaorg/micromamba`, whose binary and channels these
    machines cannot reach: the python stand-in plus `micromamba` as tests/support/micromamba.py
    (py-rattler and PyYAML copied from the tests' own environment, the same Debian Python),
    and what the real image sets up: the user `mambauser` (57439) that owns
    MAMBA_ROOT_PREFIX=/opt/conda, the prefix's bin on the PATH, and `USER mambauser`. Made
    once in the provider's store."""
    base = python_slim(as_user)

    def fill(context: Path) -> None:
        site = Path(yaml.__file__).parents[1]
        lib = context / "lib"
        for name in ("rattler", "yaml", "_yaml"):
            shutil.copytree(site / name, lib / name, ignore=shutil.ignore_patterns("__pycache__"))
        for info in (*site.glob("py_rattler-*.dist-info"), *site.glob("pyyaml-*.dist-info")):
            shutil.copytree(info, lib / info.name)
        shutil.copy(Path(__file__).with_name("micromamba.py"), context / "micromamba")
        (context / "Dockerfile").write_text(
            f"FROM {base}\n"
            "ENV MAMBA_USER=mambauser MAMBA_USER_ID=57439 MAMBA_USER_GID=57439 "
            "MAMBA_ROOT_PREFIX=/opt/conda\n"
            "ENV PATH=/opt/conda/bin:$PATH\n"
            "COPY lib/ /usr/local/lib/python3.11/dist-packages/\n"
            "COPY --chmod=755 micromamba /usr/local/bin/micromamba\n"
            "RUN groupadd -g 57439 mambauser && useradd -m -u 57439 -g 57439 mambauser "
            "&& mkdir -p /opt/conda && chown mambauser:mambauser /opt/conda\n"
            "USER mambauser\n")

    return made_once(MICROMAMBA, as_user, fill)


UV = "astral-sh/uv:0.13.9"  # as ghcr.io names it


def uv_image(layout: Path) -> str:
    """uv's own image as ghcr.io/astral-sh/uv publishes it (its two binaries at the top; uv's
    Docker guide copies them out with `COPY --from`), made from the uv the tests install."""
    here = Path(sys.executable).parent
    return oci_image(layout, {name: (here / name).read_bytes() for name in ("uv", "uvx")},
                     UV.split(":")[1], mode=0o755)


class OpenRegistry:
    """A registry anyone may push to and pull from, on loopback: the stand-in for a public
    one (Docker Hub), which these machines cannot reach. The real `docker-registry`."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = root / "config.yml"
        config.write_text(json.dumps({
            "version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(root / "data")}},
            "http": {"addr": self.address}}))
        self.log = (root / "registry.log").open("ab")
        self.process = subprocess.Popen(["docker-registry", "serve", str(config)],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the open registry did not start; see {root}/registry.log")
            time.sleep(0.1)

    def push(self, source: str, name: str, as_user: list[str] | None = None) -> str:
        """Copy `source` (a skopeo reference) here as `name`; returns the manifest digest."""
        digest_file = Path(tempfile.mkdtemp()) / "digest"
        os.chmod(digest_file.parent, 0o777)  # the provider user may write the digest
        done = subprocess.run([*(as_user or []), "skopeo", "copy", "--quiet", "--dest-no-creds",
                               "--dest-tls-verify=false", "--digestfile", str(digest_file),
                               source, f"docker://{self.address}/{name}"],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        return digest_file.read_text().strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()


# --- skopeo as agents drive it, against a registry that checks the coordinator's tokens ----


def skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["skopeo", "copy", "--quiet", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def push(registry: EmbeddedRegistry, image: str, repo: str, token: str, tmp: Path) -> str:
    out = skopeo("--dest-registry-token", token, "--dest-tls-verify=false", "--digestfile",
                 str(tmp / "digest"), image, f"docker://{registry.address}/{repo}:t")
    assert out.returncode == 0, out.stderr
    return (tmp / "digest").read_text().strip()


def skopeo_inspect(registry: EmbeddedRegistry, repo: str, digest: str, token: str) -> str:
    return subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", "--registry-token",
                           token, f"docker://{registry.address}/{repo}@{digest}"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
