"""A researcher's `FROM python:3.11-slim` + `pip install -r requirements.txt`, end to end: the
platform's pull-through mirror of Docker Hub (here a stand-in: an open registry holding a
locally made python image with pip under the Hub's name, as no public registry is reachable
from these machines), the tag resolved to a digest at submit, the agent pulling that digest
through the mirror, and RUN steps fetching what they install through the egress proxy: from
PyPI and Debian for real, from GitHub and the PyTorch index through stand-ins
(tests/support/standins.py)."""

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
from tests.support.oci import MICROMAMBA_HUB, UV, OpenRegistry, micromamba_image, python_slim, uv_image
from tests.support.standins import StandIns

pytestmark = pytest.mark.acceptance
APP = """import json, socket, sys
s = socket.socket(); s.settimeout(2)
print(json.dumps({"python": sys.version.split()[0], "built": open("/net.txt").read().strip(),
                  "run_net": s.connect_ex(("1.1.1.1", 443))}))
"""


@pytest.fixture(scope="module")
def hubbed() -> Iterator[tuple[Platform, OpenRegistry, str]]:
    """The platform as `campugrid up` starts it, its Docker Hub mirror caching a stand-in Hub
    that holds `python:3.11-slim` and `mambaorg/micromamba`, the same registry standing in for ghcr.io's mirror (with
    uv's image) as an operator would name one; one agent."""
    root = Path(tempfile.mkdtemp(prefix="campugrid-bases-"))
    os.chmod(root, 0o711)
    hub = OpenRegistry(root / "hub")
    provider = ProviderUser.resolve()
    digest = hub.push(f"containers-storage:{python_slim(provider.command([]))}",
                      "library/python:3.11-slim", as_user=provider.command([]))
    hub.push(uv_image(root / "uv-image"), UV, as_user=provider.command([]))
    hub.push(f"containers-storage:{micromamba_image(provider.command([]))}", MICROMAMBA_HUB,
             as_user=provider.command([]))
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json", hub_upstream=f"http://{hub.address}")
    standins = StandIns(root / "standins")
    # The operator's settings for the stand-ins: where their names go, what builds trust.
    settings = {"CAMPUGRID_REGISTRY_MIRRORS": f"ghcr.io=http://{hub.address}",
                "CAMPUGRID_EGRESS_PINS": standins.pins(),
                "CAMPUGRID_BUILD_CA_FILE": str(standins.bundle)}
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        p.start()
        p.start_agent("bases-agent")
        yield p, hub, digest
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        p.stop()
        hub.stop()
        standins.stop()
        for agent in ("bases-agent", "bases-agent-2"):
            log = root / "state" / "agents" / f"{agent}.log"
            if log.exists():
                print(f"--- {agent} log (tail) ---\n"
                      + "\n".join(log.read_text().splitlines()[-30:]))
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


CORPUS = Path(__file__).resolve().parents[1] / "corpus"
REPO = CORPUS.parents[1]
# Appended to a few corpus Dockerfiles (one per kind of base, and the curl installer's): the
# build log shows whether a RUN step reaches out. Every build gets the same network, and
# tests/security/test_build_network.py tries every way out of one; a probe per entry would
# only repeat it, at a RUN step (a sandbox and a layer) each.
NET_PROBE = ("RUN python3 -c \"import socket; s = socket.socket(); s.settimeout(2); "
             "print('NET', s.connect_ex(('1.1.1.1', 443)))\"\n")
PROBED = ("train-slim", "micromamba-env", "installer-and-release")
LONGEST = ("keras-stack", "build-deps")


def corpus() -> dict[str, tuple[Path, dict]]:
    """Each entry's context and what it must end with (tests/corpus/README.md)."""
    out = {p.name: (p, json.loads((p / "expect.json").read_text()))
           for p in CORPUS.iterdir() if p.is_dir()}
    for named in CORPUS.glob("*.json"):
        expect = json.loads(named.read_text())
        out[named.stem] = (REPO / expect.pop("context"), expect)
    return dict(sorted(out.items()))


@pytest.fixture(scope="module")
def corpus_jobs(hubbed, tmp_path_factory, request) -> dict[str, str]:
    """Every entry this run selected, submitted at once and run by two agents: a build
    spends much of its time waiting (on downloads, on the sandbox), so two at a time take
    far less than twice as long as one. Each test below waits for its own."""
    platform, _, _ = hubbed
    platform.start_agent("bases-agent-2")
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_a_researchers_dockerfile_builds_unchanged"}
    # The longest first, so that neither agent is left with one of them at the end.
    order = sorted(corpus().items(), key=lambda entry: entry[0] not in LONGEST)
    jobs = {}
    with platform.api() as api:
        for name, (source, expect) in order:
            if name not in selected:
                continue
            context = tmp_path_factory.mktemp("corpus") / name
            shutil.copytree(source, context, ignore=shutil.ignore_patterns("expect.json"))
            if name in PROBED:
                with (context / "Dockerfile").open("a") as f:
                    f.write(NET_PROBE)
            spec = JobSpec.from_dict(expect.get("spec", {}))
            jobs[name] = api.submit(tar_folder(context), spec)["id"]
    return jobs


# The first entry waits for the jobs queued before it (the corpus's longest, two agents at a
# time): one run took 175 s, another passed pytest's 300 s. Its own wait (1200 s) is the bound.
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("name", list(corpus()))
def test_a_researchers_dockerfile_builds_unchanged(hubbed, corpus_jobs, name):
    """tests/corpus (its README lists the entries). Each builds as written, its RUN steps
    reaching package registries through the egress proxy and nothing else (no connection is
    refused; in PROBED ones a raw connection finds no route), and the job ends as its
    expect.json says."""
    platform, _, _ = hubbed
    _, expect = corpus()[name]
    with platform.api() as api:
        # Queued behind the entries before it: the whole corpus's time at most.
        final = api.wait(corpus_jobs[name], timeout_s=1200)
        build = "".join(c["text"] for c in api.logs(final["id"])["chunks"]
                        if c["stream"] == "build")
        run = "".join(c["text"] for c in api.logs(final["id"])["chunks"] if c["stream"] == "run")
        assert final["state"] == expect["state"], (final["reason"], run[-1500:], build[-3000:])
        if final["state"] == "failed":
            assert all(part in final["reason"] for part in expect["reason"]), final["reason"]
            return
        result = json.loads(final["result"])
        assert {k: result.get(k) for k in expect["result"]} == expect["result"], result
        assert all(result[k] >= v for k, v in expect.get("at_least", {}).items()), result
        # What RUN steps fetched, each connection in the build log: pip's and apt's through
        # the platform's caches, which `up` runs (coordinator/mirrors.py)
        egress = [line for line in build.splitlines() if line.startswith("[egress] ")]
        for wheel in expect["wheels"]:
            assert any(wheel in line and "via the platform's PyPI cache" in line
                       for line in egress), (wheel, egress)
        for deb in expect.get("debs", []):
            assert any(f"/{deb}_" in line and "via the platform's apt cache" in line
                       for line in egress), (deb, egress)
        for went in expect.get("egress", []):  # e.g. uv, which fetches the lock's https URLs
            assert any(went in line for line in egress), (went, egress)
        assert not [line for line in egress if line.startswith("[egress] refused")], egress
        if name in PROBED:
            net = [line.split()[1] for line in build.splitlines() if line.startswith("NET ")]
            assert net and net[-1] != "0", build[-2000:]  # connect_ex: an errno, never 0
        if "checkpoints" in expect:
            assert sorted(int(e["detail"].split()[1].rstrip(","))
                          for e in api.job(final["id"])["events"]
                          if e["kind"] == "checkpoint") == expect["checkpoints"]
