"""FROM an image on a registry, for real: a stand-in for Docker Hub (an open `docker-registry`,
since these machines reach no public one), the platform's pull-through mirror of it (the
same program, trusting only the coordinator's tokens), the coordinator's resolver (a tag to
a digest at submit) and the agent's pull by digest into its bounded cache."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.agent import bases
from campugrid.agent.images import ImageCache
from campugrid.agent.messages import BaseImage
from campugrid.agent.messages import Source as MessageSource
from campugrid.buildpolicy.dockerfiles import BaseUse, check_dockerfile
from campugrid.cli.platform import _answers
from campugrid.cli.registry import EmbeddedRegistry
from campugrid.cli.seaweed import free_port
from campugrid.coordinator.bases import BaseResolver, Source, parse_mirrors
from campugrid.coordinator.registry import RegistryTokens, ensure_signing_key
from campugrid.protocol.errors import (
    CannotRunHere,
    InvalidInput,
    SandboxError,
    StorageError,
)
from campugrid.sandbox.podman_ops import CliOps
from tests.support.oci import OpenRegistry, oci_image

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenRegistry]:
    registry = OpenRegistry(tmp_path_factory.mktemp("hub"))
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="module")
def mirror(hub: OpenRegistry, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[EmbeddedRegistry, RegistryTokens]]:
    root = tmp_path_factory.mktemp("mirror")
    _, cert = ensure_signing_key(root / "keys")
    running = EmbeddedRegistry(root / "reg", cert, proxy=f"http://{hub.address}").start()
    try:
        yield running, RegistryTokens(root / "keys", running.address)
    finally:
        running.stop()


def from_line(text: str) -> BaseUse:
    return check_dockerfile(text, (), ("docker.io",)).bases[0]


def resolver(mirror: tuple[EmbeddedRegistry, RegistryTokens]) -> BaseResolver:
    reg, tokens = mirror
    return BaseResolver([("docker.io", Source(reg.address, insecure=True, mirror=True))], tokens)


def inspect(address: str, name: str, *token: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                           *(["--registry-token", *token] if token else ["--no-creds"]),
                           f"docker://{address}/{name}"],
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_tag_resolves_through_the_mirror_and_machines_pull_that_digest(hub, mirror, tmp_path):
    reg, tokens = mirror
    digest = hub.push(oci_image(tmp_path / "py", {"etc/hello": b"python stand-in\n"},
                                gzipped=True), "library/python:3.11-slim")
    assert resolver(mirror).resolve(from_line("FROM python:3.11-slim\n")) == digest
    # The mirror serves only the coordinator's tokens, each for its one repository.
    anonymous = inspect(reg.address, "library/python:3.11-slim")
    assert anonymous.returncode != 0 and "campugrid.invalid" in anonymous.stderr  # go get one
    other = tokens.mint("machine:m1", "library/other", ("pull",))
    assert inspect(reg.address, "library/python:3.11-slim", other).returncode != 0
    # A machine pulls the digest (never the tag) from the mirror into its cache.
    cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", CliOps())
    token = tokens.mint("machine:m1", "library/python", ("pull",))
    lines: list[str] = []
    image = cache.pull(reg.address, "library/python", digest, token, work=tmp_path,
                       limit_bytes=64 * 1024**2, cancel=None, insecure=True, log=lines.append)
    try:
        assert cache.lookup(digest) == image
    finally:
        cache.ops.remove_image(image)


def test_a_sweep_resolves_a_tag_once_so_all_its_jobs_build_on_one_base(hub, mirror, tmp_path):
    first = hub.push(oci_image(tmp_path / "a", {"v": b"1"}), "library/sweep:1")
    bases = resolver(mirror)
    assert bases.resolve(from_line("FROM sweep:1\n")) == first
    moved = hub.push(oci_image(tmp_path / "b", {"v": b"2"}), "library/sweep:1")
    assert moved != first
    assert bases.resolve(from_line("FROM sweep:1\n")) == first  # the same submit window
    assert resolver(mirror).resolve(from_line("FROM sweep:1\n")) == moved  # a later one


def test_what_cannot_be_resolved_is_refused_with_every_sources_reason(hub, mirror, tmp_path):
    reg, _ = mirror
    with pytest.raises(InvalidInput) as e:
        resolver(mirror).resolve(from_line("FROM python:0.0-none\n"))
    text = str(e.value)
    assert "line 1: FROM docker.io/library/python:0.0-none: cannot be resolved" in text
    assert reg.address in text and "manifest unknown" in text and "docker.io:" in text
    pushed = hub.push(oci_image(tmp_path / "p", {"p": b"p"}), "library/pinned:1")
    wrong = "sha256:" + "0" * 64
    with pytest.raises(InvalidInput, match="cannot be resolved"):
        resolver(mirror).resolve(from_line(f"FROM pinned@{wrong}\n"))
    assert resolver(mirror).resolve(from_line(f"FROM pinned@{pushed}\n")) == pushed


def test_without_a_mirror_the_registry_itself_is_asked(hub, tmp_path):
    digest = hub.push(oci_image(tmp_path / "d", {"d": b"d"}), "library/direct:1")
    use = check_dockerfile(f"FROM {hub.address}/library/direct:1\n", (), (hub.address,)).bases[0]
    # A registry other than the mirrored ones is asked over TLS: this one only speaks HTTP.
    with pytest.raises(InvalidInput, match="cannot be resolved"):
        BaseResolver().resolve(use)
    assert BaseResolver(parse_mirrors(f"{hub.address}=http://{hub.address}")).resolve(use) == digest


def test_mirror_configuration_is_checked():
    assert parse_mirrors("docker.io=http://127.0.0.1:5001, ghcr.io=https://m.example:443/") == (
        ("docker.io", Source("127.0.0.1:5001", insecure=True, mirror=True)),
        ("ghcr.io", Source("m.example:443", insecure=False, mirror=True)))
    for bad, says in (("docker.io=http://m.example", "loopback"), ("docker.io", "REGISTRY="),
                      ("docker.io=ftp://x", "REGISTRY="), ("docker.io=https://x/path", "REGISTRY=")):
        with pytest.raises(ValueError, match=says):
            parse_mirrors(bad)


def test_a_pull_too_big_to_unpack_here_is_refused(hub, mirror, tmp_path):
    reg, tokens = mirror
    digest = hub.push(oci_image(tmp_path / "z", {"z": bytes(32 * 1024**2)}, gzipped=True),
                      "library/zeros:1")
    cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", CliOps())
    with pytest.raises(SandboxError, match="unpacks to more than 8 MB"):
        cache.pull(reg.address, "library/zeros", digest,
                   tokens.mint("machine:m1", "library/zeros", ("pull",)), work=tmp_path,
                   limit_bytes=8 * 1024**2, cancel=None, insecure=True)
    assert cache.lookup(digest) is None and not Path(tmp_path / "pulled").exists()


def test_a_base_is_pulled_only_if_it_fits_the_cache_counted_twice(hub, mirror, tmp_path):
    """A cached base takes twice its size on disk once used (agent/images.py, COPIES): a
    base that fits a 40 MB cache once, but not twice, is not pulled."""
    reg, tokens = mirror
    # a layer of its own (a store that holds a layer already neither fetches nor counts it)
    layer = {"z": bytes(24 * 1024**2), "id": os.urandom(16)}
    digest = hub.push(oci_image(tmp_path / "z", layer, gzipped=True), "library/zeros:2")
    use = from_line("FROM zeros:2\n")
    base = BaseImage("docker.io/library/zeros:2", digest, (MessageSource(
        reg.address, insecure=True, token=tokens.mint("machine:m1", "library/zeros", ("pull",))),))
    tight = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", CliOps(), max_mb=40)
    roomy = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", CliOps(), max_mb=60)
    lines: list[str] = []
    try:
        with pytest.raises(CannotRunHere, match="unpacks to more than 20 MB"):  # another may
            bases._obtain(base, use, tight, tmp_path, "task", lines.append, threading.Event())
        assert tight.lookup(digest) is None
        image = bases._obtain(base, use, roomy, tmp_path, "task", lines.append, threading.Event())
        assert roomy.lookup(digest) == image
    finally:
        for cache in (tight, roomy):
            cache.ops.remove_image(cache.name(digest))


def test_up_starts_its_hub_mirror_only_where_the_upstream_answers(hub):
    """docker-registry in proxy mode dies at start when its upstream does not answer (these
    machines reach no Docker Hub): `up` asks first, briefly, and goes on without a mirror."""
    _answers(f"http://{hub.address}")
    began = time.monotonic()
    with pytest.raises(StorageError):
        _answers(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StorageError):
        _answers("https://registry.invalid")
    assert time.monotonic() - began < 7
