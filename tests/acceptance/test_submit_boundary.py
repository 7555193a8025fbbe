"""The REST boundary refuses bad input with a reason and stores nothing; retries never
make a second job."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from campugrid.client import ApiError, tar_folder
from campugrid.protocol.spec import JobSpec

pytestmark = pytest.mark.acceptance
HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"


def post(platform, context: bytes, spec: str) -> httpx.Response:
    """A raw form post, signed as the local admin (the SDK's signing, not its checks)."""
    with platform.api() as api:
        return api.http.post("/v1/jobs", files={"context": ("c.tgz", context)},
                             data={"spec": spec}, timeout=60)


def test_twenty_concurrent_retries_make_one_job(api, platform):
    context = tar_folder(HELLO)
    spec = JobSpec.from_dict({"client_job_id": "retry-storm-1", "command": ["true"]})
    barrier = threading.Barrier(20)

    def go(_: int) -> tuple[int, str]:
        barrier.wait()
        resp = post(platform, context, spec.to_json())
        return resp.status_code, resp.json()["id"]

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(go, range(20)))
    assert len({job_id for _, job_id in answers}) == 1
    assert sorted(code for code, _ in answers) == [200] * 19 + [201]
    assert sum(j["client_job_id"] == "retry-storm-1" for j in api.jobs(limit=1000)) == 1


@pytest.mark.parametrize(("context", "spec", "status", "says"), [
    (b"not a tarball", "{}", 422, "context: not a tar"),
    (None, '{"comand": "x"}', 422, "did you mean 'command'"),
    (None, "{broken", 422, "spec: not valid JSON"),
    (None, '{"resources": {"memory_mb": 1}}', 422, "resources.memory_mb"),
    (None, '{"datasets": [{"name": "d", "uri": "s3://no-such-bucket/x", "sha256": "0000000000000000000000000000000000000000000000000000000000000000"}]}', 422, "no bucket"),
    (None, '{"datasets": [{"name": "d", "uri": "s3://datasets/x"}]}', 422, "name its content"),
    (None, '{"datasets": [{"name": "d", "uri": "s3://datasets/x/", "sha256": {"../etc/passwd": "0000000000000000000000000000000000000000000000000000000000000000"}}]}',
     422, "is not a path under the prefix"),
    (None, '{"datasets": [{"name": "d", "uri": "s3://datasets/x/", "sha256": {"/etc/passwd": "0000000000000000000000000000000000000000000000000000000000000000"}}]}',
     422, "is not a path under the prefix"),
    (None, '{"datasets": [{"name": "d", "uri": "s3://campugrid/contexts/"}]}', 422,
     "holds the platform's own data"),
    (None, '{"datasets": [{"name": "d", "uri": "s3://campugrid-ready-probe/x"}]}', 422,
     "holds the platform's own data"),
    (None, '{"resources": {"gpus": 1}}', 422, "say how much GPU memory"),
    (None, '{"resources": {"min_compute_capability": "eight"}}', 422, "min_compute_capability"),
])
def test_bad_submissions_are_refused_with_a_reason_and_store_nothing(
        api, platform, context, spec, status, says):
    before = len(api.jobs(limit=1000))
    resp = post(platform, context if context is not None else tar_folder(HELLO), spec)
    assert resp.status_code == status
    assert says in resp.json()["detail"]
    assert len(api.jobs(limit=1000)) == before


def test_a_dockerfile_that_asks_for_more_network_is_refused_at_submit(api, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                         "RUN --network=host curl https://example.org/\n")
    with pytest.raises(ApiError) as err:
        api.submit(tar_folder(tmp_path), JobSpec())
    assert err.value.status == 422 and "through the platform's egress proxy" in err.value.detail


@pytest.mark.parametrize(("fields", "says"), [
    ({"spec": b'{"name": "caf\xe9"}'}, "byte 0xe9 at offset 13"),  # Latin-1, not UTF-8
    ({"spec": b'{"name": "\xff\xfe"}'}, "not valid utf-8 text"),
    ({"spec_file": ("spec.json", b'{"name": "\xff"}')}, "spec: not valid JSON"),
])
def test_text_that_is_not_utf8_is_refused_not_stored_as_mojibake(api, platform, fields, says):
    before = len(api.jobs(limit=1000))
    files = {"context": ("c.tgz", tar_folder(HELLO))}
    data = {}
    for name, value in fields.items():
        if isinstance(value, tuple):
            files[name] = value
        else:
            files[name] = (None, value)  # a plain form field, sent as raw bytes
    resp = api.http.post("/v1/jobs", files=files, data=data, timeout=60)
    assert resp.status_code == 422, resp.text
    assert says in resp.json()["detail"]
    assert len(api.jobs(limit=1000)) == before


def test_the_dockerfile_is_read_as_the_builder_reads_it(api, tmp_path):
    # One instruction to BuildKit and Buildah (a continued line): COPY of a loopback URL.
    (tmp_path / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                         "COPY http:/\\\n/127.0.0.1:8750/v1/jobs /j\n")
    with pytest.raises(ApiError) as err:
        api.submit(tar_folder(tmp_path), JobSpec())
    assert err.value.status == 422 and "line 2" in err.value.detail and \
        "COPY takes files from the context" in err.value.detail


def test_only_allowed_base_images_are_built_on(api, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM localhost/campugrid-job/a-0/other:1\n")
    with pytest.raises(ApiError) as err:
        api.submit(tar_folder(tmp_path), JobSpec())
    assert err.value.status == 422 and "not an allowed base image" in err.value.detail
    assert "localhost/campugrid/python:bookworm" in err.value.detail


def test_unknown_and_malformed_job_ids_are_404(api, platform):
    for job_id in ("00000000-0000-0000-0000-000000000000", "x' OR 1=1"):
        resp = api.http.get(f"/v1/jobs/{job_id}", timeout=30)
        assert resp.status_code == 404 and "no job" in resp.json()["detail"]


def test_the_api_documents_itself(platform):
    schema = httpx.get(f"{platform.url}/openapi.json", timeout=30).json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
            "/v1/jobs/{job_id}/logs", "/v1/jobs/{job_id}/output"} <= set(schema["paths"])


def test_output_of_a_job_without_output_says_why(api, platform):
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict({"command": ["true"]}))
    api.wait(job["id"], timeout_s=240, poll_s=0.2, check=False)
    resp = api.http.get(f"/v1/jobs/{job['id']}/output", timeout=30)
    assert resp.status_code == 404 and "has no output" in resp.json()["detail"]


def test_env_values_are_not_served_back(api):
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict(
        {"command": ["true"], "env": {"HF_TOKEN": "hf_secret_value"}}))
    shown = api.job(job["id"])
    assert shown["spec"]["env"] == {"HF_TOKEN": "(hidden)"}
    assert "hf_secret_value" not in str(api.jobs(limit=1000))


def test_a_huge_log_cursor_is_refused_not_crashed(platform, api):
    job = api.submit(tar_folder(HELLO), JobSpec.from_dict({"command": ["true"]}))
    resp = api.http.get(f"/v1/jobs/{job['id']}/logs", params={"after": 2**70}, timeout=30)
    assert resp.status_code == 422
