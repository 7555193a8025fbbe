"""/metrics for real: a coordinator (SQLite, SeaweedFS) scraped over HTTP with tokens an
admin mints and revokes, its counters moved by real gRPC leases and refused calls; and the
agent's loopback server, with the token its owner prints."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import inspect, text

from campugrid.agent import metrics as agent_metrics
from campugrid.agent.client import CoordinatorClient, Membership, hold_fields, hold_from_pb
from campugrid.agent.messages import Hold
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, tar_folder
from campugrid.client.api import ApiError
from campugrid.client.login import login
from campugrid.coordinator import server
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol.errors import CampugridError
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.wire import MACHINE_HEADER
from tests.support.coordinator import with_api

pytestmark = pytest.mark.integration
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"
CLI = [sys.executable, "-m", "campugrid.cli"]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def coordinator(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[server.Running, Api]]:
    with with_api(s3_server, tmp_path, "m") as running:
        yield running


def scrape(running: server.Running, token: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(f"{running.url}/metrics", headers=headers, timeout=10)


def parsed(resp: httpx.Response) -> Samples:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def refused(got: Samples, transport: str, reason: str) -> float:
    return got.get(("campugrid_refused_calls_total", (("reason", reason), ("transport", transport))), 0)


def test_metrics_need_a_scrape_token_an_admin_mints_and_revokes(coordinator, tmp_path):
    running, api = coordinator
    none = scrape(running)
    assert none.status_code == 401 and none.headers["www-authenticate"].startswith("Bearer")
    assert "campugrid metrics token" in none.json()["detail"]
    assert scrape(running, "cgm_not-a-token").status_code == 401
    assert httpx.get(f"{running.url}/metrics", headers={"authorization": "Basic eDp5"},
                     timeout=10).status_code == 401
    made = api.mint_scrape_token("prom")
    assert made["name"] == "prom" and made["token"].startswith("cgm_")
    got = parsed(scrape(running, made["token"]))
    assert got["campugrid_database_up", ()] == 1
    assert refused(got, "rest", "scrape_token") == 3
    assert [t["name"] for t in api.scrape_tokens()] == ["prom"]
    assert "token" not in api.scrape_tokens()[0]
    with pytest.raises(ApiError) as err:  # a name is minted once
        api.mint_scrape_token("prom")
    assert err.value.status == 409
    # The database holds the token's digest only.
    engine = running.coord.store.engine
    with engine.connect() as conn:
        blob = "\n".join(str(v) for table in inspect(engine).get_table_names()
                         for row in conn.execute(text(f"SELECT * FROM {table}")) for v in row)
    assert made["token"] not in blob
    assert hashlib.sha256(made["token"].encode()).hexdigest() in blob
    # Minting takes a signed admin: no signature, or an app that is not an admin, is refused.
    assert httpx.post(f"{running.url}/v1/metrics/tokens", json={"name": "x"},
                      timeout=10).status_code == 401
    ident, _ = login(running.url, api.invite("bob")["code"], identity_path=tmp_path / "bob.json")
    with Api(running.url, ident) as bob, pytest.raises(ApiError) as err:
        bob.mint_scrape_token("bobs")
    assert err.value.status == 403
    assert api.revoke_scrape_token("prom") == {"revoked": True}
    assert scrape(running, made["token"]).status_code == 401
    assert api.revoke_scrape_token("prom") == {"revoked": False}


def machine(running: server.Running, tmp_path: Path, name: str) -> CoordinatorClient:
    c = CoordinatorClient(Membership.join(tmp_path / name, running.grpc_address,
                                          running.certificate.fingerprint))
    c.register(name, pb.Capabilities(runtime="runsc", builder="buildah"))
    running.coord.machines.approve(c.machine_id)
    return c


def test_leases_refusals_and_checkpoints_move_the_counters_and_jobs_show_in_their_state(
        coordinator, tmp_path):
    running, api = coordinator
    token = api.mint_scrape_token()["token"]
    job = api.submit(tar_folder(HELLO), JobSpec())
    time.sleep(0.05)  # the oldest queued job's age is measured from its submit
    before = parsed(scrape(running, token))
    assert before["campugrid_jobs", (("state", "queued"),)] == 1
    assert before["campugrid_jobs", (("state", "building"),)] == 0
    assert before["campugrid_oldest_queued_job_age_seconds", ()] > 0
    m = machine(running, tmp_path, "m")
    try:
        lease = m.lease()
        assert lease.has_task and lease.job_id == job["id"]
        assert not m.lease().has_task
        stale = Hold(job["id"], "attempt", lease.fencing_token + 7)
        assert not m.renew(stale, "running", timeout_s=5).keep_going
        data = b"checkpoint bytes" * 100
        begin = m.begin_checkpoint(hold_from_pb(lease), 0, len(data))
        [url] = begin.part_urls
        put = httpx.put(url, content=data, timeout=30)
        assert put.status_code == 200
        etags = [put.headers["etag"]]
        assert m.record_checkpoint(pb.RecordCheckpointRequest(
            **hold_fields(hold_from_pb(lease)), epoch=0, key=begin.key,
            upload_id=begin.upload_id, etags=etags, size=len(data),
            sha256=hashlib.sha256(data).hexdigest())).accepted
        with pytest.raises(grpc.RpcError):  # the right channel and machine, no signature
            pb_grpc.AgentServiceStub(m.channel).Lease(
                pb.LeaseRequest(), metadata=((MACHINE_HEADER, m.machine_id),), timeout=5)
    finally:
        m.close()
    assert httpx.get(f"{running.url}/v1/jobs", timeout=10).status_code == 401  # unsigned REST
    after = parsed(scrape(running, token))

    def moved(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("campugrid_leases_total", (("outcome", "task"),)) == 1
    assert moved("campugrid_leases_total", (("outcome", "empty"),)) == 1
    assert moved("campugrid_lease_seconds_count") == 2
    assert 0 < moved("campugrid_lease_seconds_sum") < 10
    assert moved("campugrid_queue_wait_seconds_count") == 1
    assert after["campugrid_jobs", (("state", "queued"),)] == 0
    assert after["campugrid_jobs", (("state", "building"),)] == 1
    assert after["campugrid_oldest_queued_job_age_seconds", ()] == 0
    assert refused(after, "grpc", "stale") - refused(before, "grpc", "stale") == 1
    assert refused(after, "grpc", "unsigned") - refused(before, "grpc", "unsigned") == 1
    assert refused(after, "rest", "unsigned") - refused(before, "rest", "unsigned") == 1
    assert moved("campugrid_checkpoint_bytes_total") == len(data)
    assert moved("campugrid_checkpoints_total") == 1
    assert moved("campugrid_db_statements_total") > 10  # the leases' claims, at least
    assert after["process_resident_memory_bytes", ()] > 0


def test_the_cli_mints_lists_and_revokes_scrape_tokens_as_json(coordinator):
    running, _ = coordinator
    env = {**os.environ, "CAMPUGRID_SERVER": running.url,
           "CAMPUGRID_IDENTITY": str(running.admin_identity)}

    def cli(*args: str) -> str:
        out = subprocess.run([*CLI, "metrics", *args], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        return out.stdout

    token = cli("token", "--name", "cli").strip()  # the token alone: `> FILE` for Prometheus
    assert token.startswith("cgm_") and "\n" not in token
    assert scrape(running, token).status_code == 200
    assert [t["name"] for t in json.loads(cli("--json"))] == ["cli"]
    assert json.loads(cli("revoke", "cli", "--json")) == {"name": "cli", "revoked": True}
    assert scrape(running, token).status_code == 401
    assert json.loads(cli("token", "--json"))["name"] == "prometheus"


def test_the_agent_serves_metrics_on_loopback_only_to_its_owners_token(tmp_path):
    for host in ("0.0.0.0", "10.1.2.3", "localhost", "::"):  # each refused, none bound
        with pytest.raises(CampugridError, match="loopback"):
            agent_metrics.serve(tmp_path, 0, host=host)
    m = agent_metrics.AgentMetrics()
    m.checkpoint_bytes.inc(42)
    served = agent_metrics.serve(tmp_path, 0, registry=m.registry)
    url = f"http://127.0.0.1:{served.port}"
    try:
        none = httpx.get(f"{url}/metrics", timeout=5)
        assert none.status_code == 401 and "metrics-token" in none.text  # none minted yet
        out = subprocess.run([*CLI, "provider", "metrics-token", "--state-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        token = out.stdout.strip()
        ok = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=5)
        assert ok.status_code == 200
        got = {(s.name, tuple(s.labels.items())): s.value
               for f in text_string_to_metric_families(ok.text) for s in f.samples}
        assert got["campugrid_agent_checkpoint_bytes_total", ()] == 42
        assert got["process_resident_memory_bytes", ()] > 0
        assert httpx.get(f"{url}/metrics", headers={"authorization": "Bearer cga_wrong"},
                         timeout=5).status_code == 401
        assert httpx.get(f"{url}/other", headers={"authorization": f"Bearer {token}"},
                         timeout=5).status_code == 404
        again = agent_metrics.mint_token(tmp_path)  # a new one: the old stops working
        assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"},
                         timeout=5).status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {again}"},
                         timeout=5).status_code == 200
    finally:
        served.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/metrics", timeout=2)
