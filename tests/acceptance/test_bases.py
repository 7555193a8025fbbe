"""A researcher's `FROM python:3.11-slim` + `pip install -r requirements.txt`, end to end: the
platform's pull-through mirror of Docker Hub (here a stand-in: an open registry holding a
locally made python image with pip under the Hub's name, as no public registry is reachable
from these machines), the tag resolved to a digest at submit, the agent pulling that digest
through the mirror and fetching the declared wheels from PyPI, the build offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.platform import Platform, ProviderUser
from campugrid.cli.seaweed import free_port
from campugrid.client import ApiError, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.support.oci import OpenRegistry, python_slim

pytestmark = pytest.mark.acceptance
APP = """import json, socket, sys
s = socket.socket(); s.settimeout(2)
print(json.dumps({"python": sys.version.split()[0], "built": open("/net.txt").read().strip(),
                  "run_net": s.connect_ex(("1.1.1.1", 443))}))
"""


@pytest.fixture(scope="module")
def hubbed() -> Iterator[tuple[Platform, OpenRegistry, str]]:
    """The platform as `campugrid up` starts it, its Docker Hub mirror caching a stand-in Hub
    that holds `python:3.11-slim`; one agent."""
    root = Path(tempfile.mkdtemp(prefix="campugrid-bases-"))
    os.chmod(root, 0o711)
    hub = OpenRegistry(root / "hub")
    provider = ProviderUser.resolve()
    digest = hub.push(f"containers-storage:{python_slim(provider.command([]))}",
                      "library/python:3.11-slim", as_user=provider.command([]))
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json", hub_upstream=f"http://{hub.address}")
    try:
        p.start()
        p.start_agent("bases-agent")
        yield p, hub, digest
    finally:
        p.stop()
        hub.stop()
        log = root / "state" / "agents" / "bases-agent.log"
        if log.exists():
            print("--- agent log (tail) ---\n" + "\n".join(log.read_text().splitlines()[-30:]))
        shutil.rmtree(root, ignore_errors=True)


def test_from_python_slim_builds_through_the_mirror_with_no_network(hubbed, tmp_path):
    platform, _, digest = hubbed
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim\n"
        "COPY app.py /app/app.py\n"
        "RUN python3 -c \"import socket; s = socket.socket(); s.settimeout(2); "
        "print(s.connect_ex(('1.1.1.1', 443)))\" > /net.txt\n"
        'CMD ["python3", "/app/app.py"]\n')
    with platform.api() as api:
        job = api.submit(tar_folder(tmp_path), JobSpec())
        assert job["bases"] == {"docker.io/library/python:3.11-slim": digest}  # at submit
        final = api.wait(job["id"], timeout_s=240)
        assert final["state"] == "succeeded", final
        result = json.loads(final["result"])
        assert result["python"].startswith("3.11")
        assert int(result["built"]) != 0 and result["run_net"] != 0  # no network, either time
        build = "".join(c["text"] for c in api.logs(job["id"])["chunks"] if c["stream"] == "build")
        assert platform.mirror is not None
        assert (f"pulling base docker.io/library/python:3.11-slim ({digest}) from "
                f"{platform.mirror.address}") in build
        assert "pulled base docker.io/library/python:3.11-slim in" in build
        out = subprocess.run([sys.executable, "-m", "campugrid.cli", "status", job["id"],
                              "--server", platform.url], capture_output=True, text=True,
                             env=platform.cli_env(), timeout=60)
        assert f"base     docker.io/library/python:3.11-slim@{digest}" in out.stdout, out
        # The next job of that base finds it on the machine.
        again = api.wait(api.submit(tar_folder(tmp_path), JobSpec.from_dict(
            {"env": {"AGAIN": "1"}}))["id"], timeout_s=240)
        assert again["state"] == "succeeded", again
        build = "".join(c["text"] for c in api.logs(again["id"])["chunks"]
                        if c["stream"] == "build")
        assert f"base docker.io/library/python:3.11-slim ({digest}) is already on this " \
               "machine" in build


def test_a_base_that_cannot_be_resolved_is_refused_at_submit(hubbed, tmp_path):
    platform, _, _ = hubbed
    (tmp_path / "Dockerfile").write_text("FROM python:0.0-none\nRUN true\n")
    with platform.api() as api:
        before = len(api.jobs())
        with pytest.raises(ApiError) as err:
            api.submit(tar_folder(tmp_path), JobSpec())
        assert err.value.status == 422
        assert "FROM docker.io/library/python:0.0-none: cannot be resolved" in err.value.detail
        assert len(api.jobs()) == before  # nothing stored


NET = ("RUN python3 -c \"import socket; s = socket.socket(); s.settimeout(2); "
       "print(s.connect_ex(('1.1.1.1', 443)))\" > /net.txt\n")


def test_requirements_install_offline_from_wheels_fetched_before_the_build(hubbed, tmp_path):
    """The researcher's Dockerfile, unchanged: pip in a RUN step installs what
    requirements.txt lists (a package with compiled wheels among its dependencies), from the
    wheels the agent fetched for CPython 3.11 beforehand; RUN steps still have no network."""
    platform, _, _ = hubbed
    (tmp_path / "requirements.txt").write_text("# the job's dependencies\nrequests==2.32.3\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim\n"
        "WORKDIR /app\n"
        "COPY requirements.txt .\n"
        "RUN pip install --no-cache-dir -r requirements.txt\n"
        + NET +
        'CMD ["python3", "-c", "import json, os, requests, charset_normalizer; print(json.dumps('
        '{\\"requests\\": requests.__version__, \\"net\\": open(\\"/net.txt\\").read().strip(), '
        '\\"pip_env\\": [k for k in os.environ if k.startswith(\\"PIP_\\")]}))"]\n')
    with platform.api() as api:
        final = api.wait(api.submit(tar_folder(tmp_path), JobSpec())["id"], timeout_s=300)
        build = "".join(c["text"] for c in api.logs(final["id"])["chunks"]
                        if c["stream"] == "build")
        assert final["state"] == "succeeded", (final, build[-3000:])
        result = json.loads(final["result"])
        assert result["requests"] == "2.32.3" and int(result["net"]) != 0
        assert result["pip_env"] == []  # pip's settings for RUN steps stay out of the image
        assert "fetching Python wheels for CPython 3.11" in build
        assert "wheel requests-2.32.3-py3-none-any.whl" in build and "sha256:" in build
        assert "cp311-manylinux" in build  # charset-normalizer's compiled wheel, for 3.11
        assert "Successfully installed" in build and "charset-normalizer" in build


def test_a_package_the_declaration_missed_fails_the_build_naming_it(hubbed, tmp_path):
    """A script that calls pip hides its package from the declaration: the RUN step finds
    no index, and the job's reason names the package and says how to declare it."""
    platform, _, _ = hubbed
    (tmp_path / "requirements.txt").write_text("six==1.16.0\n")
    (tmp_path / "install.sh").write_text("pip install --no-cache-dir idna==3.7\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim\n"
        "COPY requirements.txt install.sh /\n"
        "RUN pip install -r /requirements.txt && sh /install.sh\n")
    with platform.api() as api:
        final = api.wait(api.submit(tar_folder(tmp_path), JobSpec())["id"], timeout_s=300)
        assert final["state"] == "failed", final
        assert "a RUN step installs idna==3.7, which was not declared" in final["reason"]
        assert "build.pip" in final["reason"]


def test_the_readme_example_trains_on_python_slim_with_its_requirements(hubbed):
    """examples/train-slim, as the README shows it: NumPy from requirements.txt (a compiled
    wheel, fetched for the base's CPython), checkpoints through the mounted hooks."""
    platform, _, _ = hubbed
    example = Path(__file__).resolve().parents[2] / "examples" / "train-slim"
    with platform.api() as api:
        job = api.submit(tar_folder(example), JobSpec.from_dict(
            {"env": {"EPOCHS": "2", "EPOCH_SECONDS": "0"}, "resources": {"memory_mb": 1024}}))
        final = api.wait(job["id"], timeout_s=400)
        build = "".join(c["text"] for c in api.logs(job["id"])["chunks"]
                        if c["stream"] == "build")
        assert final["state"] == "succeeded", (final, build[-3000:])
        assert json.loads(final["result"])["accuracy"] > 0.8
        assert "Successfully installed numpy-2.1.3" in build
        assert sorted(int(e["detail"].split()[1].rstrip(",")) for e in api.job(job["id"])["events"]
                      if e["kind"] == "checkpoint") == [0, 1]
