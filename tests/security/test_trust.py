"""Who may call: every refusal of issue 11 against a running coordinator (real TLS on gRPC,
real signatures on REST, SQLite and SeaweedFS). Each refused call stores and runs nothing,
says why, and leaves the coordinator healthy for the next, signed, call.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from sqlalchemy import inspect, text

from campugrid.agent.client import (
    CoordinatorClient,
    Membership,
    hold_from_pb,
    pinned_channel,
    signed_metadata,
)
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, Identity, Signer, tar_folder
from campugrid.client.login import login
from campugrid.coordinator import server
from campugrid.coordinator.config import Settings
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import agent_pb2_grpc as pb_grpc
from campugrid.protocol import keys, pins
from campugrid.protocol.errors import CampugridError
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.wire import MACHINE_HEADER
from tests.support.coordinator import start

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"
LEASE = "/campugrid.v1.AgentService/Lease"


@pytest.fixture(scope="module")
def coord(s3_server: EmbeddedS3, tmp_path_factory) -> Iterator[server.Running]:
    root = tmp_path_factory.mktemp("trust")
    running, t = start(s3_server, root, "trust-tests")
    yield running
    running.stop()
    t.join(5)


@pytest.fixture(scope="module")
def admin(coord) -> Iterator[Api]:
    with Api(coord.url, Identity.load(Path(coord.admin_identity))) as api:
        yield api


def new_app(coord: server.Running, admin: Api, tmp_path: Path, name: str) -> Api:
    ident, _ = login(coord.url, admin.invite(name)["code"], identity_path=tmp_path / f"{name}.json")
    return Api(coord.url, ident)


@pytest.fixture(scope="module")
def alice(coord, admin, tmp_path_factory) -> Iterator[Api]:
    with new_app(coord, admin, tmp_path_factory.mktemp("alice"), "alice") as api:
        yield api


def signed(api: Api, method: str, path: str, **kw) -> httpx.Request:
    """A request as the SDK would send it, signed with `api`'s key, for the test to spoil."""
    request = api.http.build_request(method, path, **kw)
    assert api.identity is not None
    Signer(api.identity.app_id, api.identity.private_key()).sign(request)
    return request


def refused(resp: httpx.Response, status: int, words: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert words in resp.json()["detail"], resp.json()["detail"]


@pytest.fixture
def healthy(coord, admin) -> Iterator[None]:
    """After the refusal, nothing new is stored and a signed request still works."""
    before = {j["id"]: j["state"] for j in admin.jobs(limit=1000)}
    yield
    assert httpx.get(f"{coord.url}/v1/health").json()["status"] == "ok"
    assert {j["id"]: j["state"] for j in admin.jobs(limit=1000)} == before


# --- REST: signatures ---------------------------------------------------------------------------


def test_an_unsigned_request_is_refused(coord, healthy):
    refused(httpx.get(f"{coord.url}/v1/jobs"), 401, "not signed")
    for spelling in ("//v1/jobs", "/v1//jobs", "/%76%31/jobs", "/V1/jobs", "/v1/jobs/",
                     "/nothing-here"):
        refused(httpx.get(f"{coord.url}{spelling}"), 401, "not signed")
    assert httpx.get(f"{coord.url}/openapi.json").status_code == 200  # the docs are public
    # A browser at the address goes to the console; its icon request is answered plainly.
    home = httpx.get(f"{coord.url}/")
    assert (home.status_code, home.headers["location"]) == (307, "/console/")
    assert httpx.get(f"{coord.url}/favicon.ico").status_code == 204
    for near in ("/favicon.ico/x", "//", "/index.html"):  # only those two paths
        refused(httpx.get(f"{coord.url}{near}"), 401, "not signed")
    spec = JobSpec().to_json().encode()
    resp = httpx.post(f"{coord.url}/v1/jobs", files={"context": ("c.tar.gz", tar_folder(HELLO)),
                                                     "spec_file": ("s.json", spec)})
    refused(resp, 401, "not signed")
    assert resp.headers["www-authenticate"].startswith("Signature")


def test_an_unknown_key_is_refused(coord, tmp_path, healthy):
    key_file = tmp_path / "stranger.key"
    keys.write_private(key_file, keys.Ed25519PrivateKey.generate())
    with Api(coord.url, Identity(coord.url, "b2b6c1d8-0000-4000-8000-000000000000", "stranger",
                                 key_file)) as stranger:
        refused(stranger.http.get("/v1/jobs"), 401, "unknown key id")


def test_a_key_other_than_the_apps_own_is_refused(coord, alice, tmp_path, healthy):
    key_file = tmp_path / "other.key"
    keys.write_private(key_file, keys.Ed25519PrivateKey.generate())
    assert alice.identity is not None
    forged = Identity(coord.url, alice.identity.app_id, "alice", key_file)  # alice's id, not key
    with Api(coord.url, forged) as api:
        refused(api.http.get("/v1/jobs"), 401, "does not verify with the key of app 'alice'")


def test_a_tampered_body_is_refused(coord, alice, healthy):
    request = signed(alice, "POST", "/v1/jobs", files={
        "context": ("c.tar.gz", tar_folder(HELLO)),
        "spec_file": ("s.json", JobSpec(command=["echo", "signed"]).to_json().encode())})
    body = request.content.replace(b'"signed"', b'"forged"')
    assert body != request.content and len(body) == len(request.content)
    tampered = httpx.Request("POST", request.url, headers=request.headers, content=body)
    refused(alice.http.send(tampered, auth=None), 401, "changed after signing")


def test_a_tampered_path_or_query_is_refused(coord, alice, admin):
    mine = alice.submit(tar_folder(HELLO), JobSpec(name="alice's"))
    healthy_jobs = {j["id"] for j in admin.jobs(limit=1000)}
    assert mine["id"] in healthy_jobs
    request = signed(alice, "GET", f"/v1/jobs/{mine['id']}")
    moved = httpx.Request("POST", str(request.url) + "/cancel", headers=request.headers)
    refused(alice.http.send(moved, auth=None), 401, "does not verify")
    request = signed(alice, "GET", "/v1/jobs", params={"limit": 1})
    requery = httpx.Request("GET", str(request.url).replace("limit=1", "limit=2"),
                            headers=request.headers)
    refused(alice.http.send(requery, auth=None), 401, "does not verify")
    assert alice.job(mine["id"])["state"] == "queued"
    alice.cancel(mine["id"])  # signed, it works (and keeps the queue clear)


def test_a_replayed_request_is_refused(coord, alice, healthy):
    request = signed(alice, "GET", "/v1/jobs")
    assert alice.http.send(request, auth=None).status_code == 200
    again = httpx.Request("GET", request.url, headers=request.headers)
    refused(alice.http.send(again, auth=None), 401, "replay")


@pytest.mark.parametrize("skew", [-400, 400])
def test_a_request_signed_outside_the_window_is_refused(coord, alice, skew, healthy):
    request = alice.http.build_request("GET", "/v1/jobs")
    assert alice.identity is not None
    Signer(alice.identity.app_id, alice.identity.private_key()).sign(
        request, created=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=skew))
    refused(alice.http.send(request, auth=None), 401, "check this computer's clock")


def test_a_revoked_app_is_refused_from_then_on(coord, admin, tmp_path, healthy):
    with new_app(coord, admin, tmp_path, "bob") as bob:
        assert bob.jobs() == []
        admin.revoke_app("bob")
        refused(bob.http.get("/v1/jobs"), 401, "revoked")
    assert [a["name"] for a in admin.apps() if a["revoked_at"]] == ["bob"]


def test_invites_are_single_use(coord, admin, tmp_path, healthy):
    code = admin.invite("carol")["code"]
    login(coord.url, code, identity_path=tmp_path / "carol.json")
    with pytest.raises(CampugridError, match="already used"):
        login(coord.url, code, identity_path=tmp_path / "carol2.json")
    with pytest.raises(CampugridError, match="unknown invite"):
        login(coord.url, code + "x", identity_path=tmp_path / "carol3.json")
    assert not (tmp_path / "carol2.json").exists()


# --- REST: whose jobs ----------------------------------------------------------------------------


def test_another_apps_job_is_not_found_for_every_verb(coord, admin, alice, tmp_path):
    job = alice.submit(tar_folder(HELLO), JobSpec(name="private"))
    with new_app(coord, admin, tmp_path, "mallory") as mallory:
        for method, path in (("GET", ""), ("GET", "/logs"), ("GET", "/output"),
                             ("GET", "/shards"), ("POST", "/cancel")):
            refused(mallory.http.request(method, f"/v1/jobs/{job['id']}{path}"), 404, "no job")
        assert mallory.jobs() == []
        refused(mallory.http.get("/v1/apps"), 403, "not an admin")
        refused(mallory.http.get("/v1/machines"), 403, "not an admin")
    assert alice.job(job["id"])["state"] == "queued"  # untouched
    assert job["id"] in {j["id"] for j in admin.jobs(limit=1000)}  # an admin sees everyone's
    alice.cancel(job["id"])


def test_rate_limits_answer_429_with_retry_after(s3_server, tmp_path):
    running, t = start(s3_server, tmp_path, "trust-limits", rest_per_key_per_s=3)
    try:
        with Api(running.url, Identity.load(tmp_path / "admin.json")) as api:
            answers = [api.http.get("/v1/jobs") for _ in range(8)]
            codes = [r.status_code for r in answers]
            assert codes[:3] == [200, 200, 200] and 429 in codes
            # each refusal says when to come back (checked on the refusals themselves: on a
            # slow machine the window may have moved on by the next request)
            refused = [r for r in answers if r.status_code == 429]
            assert all(int(r.headers["retry-after"]) >= 1 for r in refused), refused
            time.sleep(1.1)
            assert api.http.get("/v1/jobs").status_code == 200  # the window moved on
    finally:
        running.stop()
        t.join(5)


def test_unsigned_access_is_refused_off_loopback_even_when_asked_for(s3_server, tmp_path):
    settings = Settings.from_env(tmp_path / "c", s3_endpoint=s3_server.endpoint,
                                 s3_access_key=s3_server.access_key,
                                 s3_secret_key=s3_server.secret_key, http_host="0.0.0.0",
                                 allow_unsigned=True)
    with pytest.raises(CampugridError, match="loopback address only"):
        server.start(settings)


def test_rest_over_tls_pins_the_certificate_for_login_and_every_request(s3_server, tmp_path):
    running, t = start(s3_server, tmp_path, "trust-tls", rest_tls=True)
    try:
        assert running.url.startswith("https://")
        admin_ident = Identity.load(tmp_path / "admin.json")
        assert admin_ident.pin == running.certificate.fingerprint
        with Api(running.url, admin_ident) as admin:
            invite = admin.invite("remote")
        assert invite["command"].endswith(f"--pin {running.certificate.fingerprint}")
        with pytest.raises(CampugridError, match="needs --pin"):
            login(running.url, invite["code"], identity_path=tmp_path / "r0.json")
        wrong = "SHA256:" + base64.b64encode(b"\1" * 32).decode().rstrip("=")
        with pytest.raises(pins.PinMismatch):
            login(running.url, invite["code"], wrong, identity_path=tmp_path / "r1.json")
        ident, _ = login(running.url, invite["code"], invite["pin"], identity_path=tmp_path / "r.json")
        with Api(running.url, ident) as remote:
            assert remote.whoami()["name"] == "remote"
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets nothing
            httpx.get(running.url.replace("https://", "http://") + "/v1/health", timeout=5)
    finally:
        running.stop()
        t.join(5)


# --- gRPC: machines -----------------------------------------------------------------------------


def machine(coord: server.Running, tmp_path: Path, name: str, approve: bool = True) -> CoordinatorClient:
    m = Membership.join(tmp_path / name, coord.grpc_address, coord.certificate.fingerprint)
    c = CoordinatorClient(m)
    c.register(name)
    if approve:
        coord.coord.machines.approve(c.machine_id)
    return c


def test_an_agent_refuses_a_coordinator_whose_certificate_is_not_the_pinned_one(coord, tmp_path):
    wrong = "SHA256:" + base64.b64encode(b"\0" * 32).decode().rstrip("=")
    with pytest.raises(pins.PinMismatch, match="not the pinned"):
        Membership.join(tmp_path / "m", coord.grpc_address, wrong)
    assert not (tmp_path / "m" / "machine.key").exists()


def test_a_channel_that_does_not_trust_the_pinned_certificate_gets_nowhere(coord, tmp_path):
    other = tmp_path / "other-tls"
    from campugrid.coordinator.tls import ensure_certificate

    fake = ensure_certificate(other)  # a certificate for the same name, made by someone else
    channel = pinned_channel(coord.grpc_address, fake.pem.decode())
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.AgentServiceStub(channel).Lease(pb.LeaseRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_unsigned_unknown_forged_tampered_and_replayed_calls_are_refused(coord, tmp_path):
    m = machine(coord, tmp_path, "m")
    stub = pb_grpc.AgentServiceStub(m.channel)
    request = pb.LeaseRequest()

    def lease(md):
        with pytest.raises(grpc.RpcError) as err:
            stub.Lease(request, metadata=md, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        return err.value.details()

    assert "not signed" in lease([(MACHINE_HEADER, m.machine_id)])
    stranger = keys.Ed25519PrivateKey.generate()
    assert "unknown machine" in lease([(MACHINE_HEADER, "6f9f2a3e-0000-4000-8000-000000000000"),
                                       *signed_metadata(stranger, LEASE, b"", "x")])
    assert "does not verify" in lease([(MACHINE_HEADER, m.machine_id),
                                       *signed_metadata(stranger, LEASE, b"", m.machine_id)])
    other_body = pb.LeaseRequest(enforced_limits=["memory"]).SerializeToString()
    assert "does not verify" in lease([(MACHINE_HEADER, m.machine_id),
                                       *signed_metadata(m.key, LEASE, other_body, m.machine_id)])
    good = [(MACHINE_HEADER, m.machine_id), *signed_metadata(m.key, LEASE, b"", m.machine_id)]
    assert stub.Lease(request, metadata=good, timeout=5).has_task is False
    assert "replay" in lease(good)
    assert m.lease().has_task is False  # and the machine's own next call is fine
    m.close()


def test_a_pending_machine_gets_no_work_and_a_job_says_why_it_waits(coord, admin, tmp_path):
    job = admin.submit(tar_folder(HELLO), JobSpec(name="for pending"))
    m = machine(coord, tmp_path, "pending-box", approve=False)
    m.heartbeat()  # a pending machine may say it is alive
    with pytest.raises(grpc.RpcError) as err:
        m.lease()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "pending" in err.value.details() and m.fingerprint in err.value.details()
    seen = admin.job(job["id"])
    assert seen["state"] == "queued" and "wait for their owner's approval" in seen["waiting_reason"]
    assert [x["status"] for x in admin.machines() if x["id"] == m.machine_id] == ["pending"]
    admin.cancel(job["id"])
    m.close()


def test_a_revoked_machine_loses_its_lease_at_once_and_is_refused_after(coord, admin, tmp_path):
    job = admin.submit(tar_folder(HELLO), JobSpec(name="for revoked"))
    m = machine(coord, tmp_path, "revoked-box")
    lease = m.lease()
    assert lease.has_task and lease.job_id == job["id"]
    admin.revoke_machine(m.machine_id)
    assert admin.job(job["id"])["state"] == "queued"  # requeued now, not at lease expiry
    with pytest.raises(grpc.RpcError) as err:
        m.renew(hold_from_pb(lease), "running", timeout_s=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "revoked" in err.value.details()
    with pytest.raises(grpc.RpcError):
        m.register("revoked-box")  # the same key cannot come back
    refused(admin.http.post(f"/v1/machines/{m.machine_id}/approve"), 403, "revoked")
    admin.cancel(job["id"])
    m.close()


def test_registration_is_rate_limited_per_address(s3_server, tmp_path):
    running, t = start(s3_server, tmp_path, "trust-register", registrations_per_minute=3)
    try:
        codes = []
        for i in range(5):
            m = Membership.join(tmp_path / f"m{i}", running.grpc_address,
                                running.certificate.fingerprint)
            c = CoordinatorClient(m)
            try:
                c.register(f"m{i}")
                codes.append("ok")
            except grpc.RpcError as e:
                codes.append(e.code().name)
            c.close()
        assert codes == ["ok"] * 3 + ["RESOURCE_EXHAUSTED"] * 2
    finally:
        running.stop()
        t.join(5)


# --- what a copy of the database opens ------------------------------------------------------


def test_the_database_holds_no_private_key_and_no_plain_secret(coord, admin, tmp_path):
    # A full run of who-may-call: an invite and its app, a machine, a job leased and run.
    invite = admin.invite("dave")
    dave_ident, _ = login(coord.url, invite["code"], identity_path=tmp_path / "dave.json")
    unused = admin.invite("erin")["code"]
    with Api(coord.url, dave_ident) as dave:
        job = dave.submit(tar_folder(HELLO), JobSpec(env={"TOKEN": "tok-not-a-secret-here"}))
        m = machine(coord, tmp_path, "scan-box")
        lease = m.lease()
        assert lease.job_id == job["id"]
        m.complete(pb.CompleteRequest(job_id=job["id"], fencing_token=lease.fencing_token,
                                      succeeded=True, result="done"))
        m.close()
    engine = coord.coord.store.engine
    dump = []
    with engine.connect() as conn:
        for table in inspect(engine).get_table_names():
            for row in conn.execute(text(f"SELECT * FROM {table}")):
                dump.extend(str(v) for v in row)
    blob = "\n".join(dump)

    def spellings(key: keys.Ed25519PrivateKey) -> list[str]:
        raw = key.private_bytes_raw()
        return [raw.hex(), base64.b64encode(raw).decode(), base64.b64encode(raw).decode().rstrip("=")]

    private = [Identity.load(Path(coord.admin_identity)).private_key(), dave_ident.private_key(),
               keys.load_private(tmp_path / "scan-box" / "machine.key")]
    for key in private:
        for spelling in spellings(key):
            assert spelling not in blob
    for pem_file in (Identity.load(Path(coord.admin_identity)).key_file, dave_ident.key_file,
                     tmp_path / "scan-box" / "machine.key"):
        for line in pem_file.read_text().splitlines()[1:-1]:
            assert line not in blob
    assert invite["code"] not in blob and unused not in blob  # invites: digests only
    assert coord.coord.settings.s3_secret_key not in blob
    tls_key = coord.certificate.key_pem.decode().splitlines()[1]
    assert tls_key not in blob


# --- files: by content, never by path -----------------------------------------------------------


def upload_ticket(api: Api, tmp_path: Path, data: bytes, name: str = "data.bin") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return api.upload(path)


def submit_with(api: Api, datasets: list[dict], **spec) -> httpx.Response:
    spec_json = JobSpec.from_dict({"datasets": datasets, **spec}).to_json().encode()
    return api.http.post("/v1/jobs", files={"context": ("c.tar.gz", tar_folder(HELLO)),
                                            "spec_file": ("s.json", spec_json)})


def test_an_upload_ticket_is_for_one_job_and_is_deleted_after_it(coord, alice, tmp_path):
    ticket = upload_ticket(alice, tmp_path, b"only here\n")
    first = submit_with(alice, [{"name": "d", "ticket": ticket}])
    assert first.status_code == 201, first.text
    job = first.json()
    again = submit_with(alice, [{"name": "d", "ticket": ticket}])
    refused(again, 422, "a ticket is for one job")
    m = machine(coord, tmp_path, "ticket-box")
    lease = m.lease()
    assert lease.job_id == job["id"]
    [ds] = lease.datasets
    assert ds.name == "d" and [(f.path, f.size) for f in ds.files] == [("data.bin", 10)]
    assert httpx.get(ds.files[0].url).content == b"only here\n"
    m.complete(pb.CompleteRequest(job_id=job["id"], fencing_token=lease.fencing_token,
                                  succeeded=True))
    m.close()
    events = [(e["kind"], e["detail"]) for e in alice.job(job["id"])["events"]]
    assert ("inputs", "d: 1 file by upload ticket, 10 bytes, checked by sha256") in events
    key = f"uploads/{ticket}"
    assert coord.coord.objects.exists(key)
    assert coord.coord.inputs.sweep_uploads() >= 1  # what the reaper runs: the job has ended
    assert not coord.coord.objects.exists(key)


def test_a_ticket_for_another_file_another_app_or_too_late_is_refused(coord, alice, admin,
                                                                      tmp_path, healthy):
    path = tmp_path / "promised.bin"
    path.write_bytes(b"the promised bytes")
    made = alice.http.post("/v1/uploads", json={"filename": "promised.bin", "size": 18,
                                                "sha256": hashlib.sha256(b"the promised bytes")
                                                .hexdigest()}).json()
    httpx.put(made["url"], content=b"other bytes, same!").raise_for_status()  # 18 bytes too
    refused(submit_with(alice, [{"name": "d", "ticket": made["ticket"]}]), 422,
            "is not the one ticket")
    ticket = upload_ticket(alice, tmp_path, b"alice's own")
    refused(submit_with(admin, [{"name": "d", "ticket": ticket}]), 422, "no upload ticket")
    late = upload_ticket(alice, tmp_path, b"too late")
    with coord.coord.store.engine.begin() as conn:  # ten minutes later
        conn.execute(text("UPDATE uploads SET expires_at = :t WHERE id = :id"),
                     {"t": dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1), "id": late})
    refused(submit_with(alice, [{"name": "d", "ticket": late}]), 422, "expired")
    assert coord.coord.inputs.sweep_uploads() >= 1 and not coord.coord.objects.exists(f"uploads/{late}")
    refused(alice.http.post("/v1/uploads", json={"filename": "../../x", "size": 1,
                                                 "sha256": "0" * 64}), 422, "filename")


def test_datasets_must_name_their_content_and_no_path_outside_the_prefix(coord, alice, healthy):
    from campugrid.coordinator.objects import S3Store

    s = coord.coord.settings
    data = S3Store(s.s3_endpoint, s.s3_access_key, s.s3_secret_key, "trust-data")
    data.ensure_bucket()
    data.put_bytes("set/a.csv", b"1,2\n")
    data.close()
    refused(submit_with(alice, [{"name": "d", "uri": "s3://trust-data/set/"}]), 422,
            "name its content")
    for bad in ("../a.csv", "/etc/passwd", "x/../../a.csv"):
        spec = json.dumps({"datasets": [{"name": "d", "uri": "s3://trust-data/set/",
                                         "sha256": {bad: "0" * 64}}]})
        resp = alice.http.post("/v1/jobs", files={"context": ("c.tar.gz", tar_folder(HELLO)),
                                                  "spec": (None, spec)})
        refused(resp, 422, "is not a path under the prefix")
    refused(submit_with(alice, [{"name": "d", "uri": "s3://trust-data/set/",
                                 "sha256": {"b.csv": "0" * 64}}]), 422, "b.csv not found")
