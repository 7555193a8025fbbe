"""The client never holds a whole tarball: the context is packed to a file and streamed
(signed over a digest of the same bytes, which the coordinator's own checks accept), and a
job's output is streamed to disk. Memory is measured, not assumed."""

import datetime as dt
import gzip
import hashlib
import io
import os
import tarfile
import tempfile
import tracemalloc
from pathlib import Path

import http_message_signatures as hms
import httpx
import pytest
from http_message_signatures import algorithms
from http_message_signatures.structures import CaseInsensitiveDict
from python_multipart.multipart import MultipartParser, parse_options_header

from campugrid.client import Api, Identity, Signer, pack_folder, tar_folder
from campugrid.coordinator.auth import REQUIRED, _Spooled
from campugrid.protocol import keys
from campugrid.protocol.errors import CampugridError, NotFound
from campugrid.protocol.identities import COVERED, HttpMessage
from campugrid.protocol.spec import JobSpec

MiB = 1024 * 1024
SERVER = "http://coordinator.test:8750"


@pytest.fixture
def identity(tmp_path: Path) -> Identity:
    key_file = tmp_path / "app.key"
    keys.write_private(key_file, keys.Ed25519PrivateKey.generate())
    return Identity(SERVER, "app-id", "app", key_file)


def api_over(identity: Identity | None, transport: httpx.BaseTransport) -> Api:
    """The real Api (its Signer included), its requests answered by `transport`."""
    api = Api(SERVER, identity)
    api.http.close()
    api.http = httpx.Client(base_url=SERVER, auth=api.http.auth, transport=transport)
    return api


def folder_with(tmp_path: Path, big_mib: int = 0) -> Path:
    folder = tmp_path / "ctx"
    (folder / "src").mkdir(parents=True)
    (folder / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\nCOPY . /app\n")
    (folder / "src" / "train.py").write_text("print('hi')\n")
    (folder / "src" / "link").symlink_to("train.py")
    if big_mib:
        with open(folder / "weights.bin", "wb") as f:
            for _ in range(big_mib):
                f.write(os.urandom(MiB))
    return folder


def verify_as_the_coordinator(request: httpx.Request, body: bytes, identity: Identity) -> None:
    """The coordinator's checks, with its own code: the signature over the required
    components, then the body against the signed Content-Digest."""

    class Key(hms.HTTPSignatureKeyResolver):
        def resolve_public_key(self, key_id):
            assert key_id == identity.app_id
            return identity.private_key().public_key()

    headers = CaseInsensitiveDict(request.headers.multi_items())
    verifier = hms.HTTPMessageVerifier(signature_algorithm=algorithms.ED25519, key_resolver=Key())
    [result] = verifier.verify(HttpMessage(request.method, str(request.url), headers),
                               require_components=REQUIRED)
    spooled = _Spooled()
    try:
        for i in range(0, len(body), 64 * 1024):
            spooled.write(body[i:i + 64 * 1024])
        spooled.check(result.covered_components['"content-digest"'])  # raises if it differs
    finally:
        spooled.close()


def form_parts(request: httpx.Request, body: bytes) -> dict[str, tuple[str, bytes]]:
    """The multipart form as the coordinator's parser (python-multipart) reads it."""
    _, params = parse_options_header(request.headers["content-type"])
    parts: dict[str, tuple[str, bytes]] = {}
    current: dict[str, object] = {}

    def on_header_field(data, start, end):
        current["field"] = data[start:end]

    def on_header_value(data, start, end):
        current.setdefault("headers", {})[current["field"].lower()] = data[start:end]

    def on_part_data(data, start, end):
        current["data"] = current.get("data", b"") + data[start:end]

    def on_part_end():
        disposition = current["headers"][b"content-disposition"].decode()
        name = disposition.split('name="')[1].split('"')[0]
        parts[name] = (current["headers"][b"content-type"].decode(), current.get("data", b""))
        current.clear()

    parser = MultipartParser(params[b"boundary"], callbacks={
        "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_part_data": on_part_data, "on_part_end": on_part_end})
    parser.write(body)
    parser.finalize()
    return parts


def test_a_streamed_submit_is_signed_so_the_coordinator_accepts_it(tmp_path, identity):
    context = tmp_path / "context.tar.gz"
    with open(context, "wb") as f:
        pack_folder(folder_with(tmp_path, big_mib=3), f)
    seen: list[tuple[httpx.Request, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request, request.read()))
        return httpx.Response(201, json={"id": "j1"})

    with api_over(identity, httpx.MockTransport(handler)) as api:
        assert api.submit(context, JobSpec(name="big", command=("a",))) == {"id": "j1"}
    [(request, body)] = seen
    assert request.headers["content-length"] == str(len(body))
    verify_as_the_coordinator(request, body, identity)
    parts = form_parts(request, body)
    assert parts["context"] == ("application/gzip", context.read_bytes())
    ctype, spec = parts["spec_file"]
    assert ctype == "application/json"
    assert JobSpec.from_json(spec).name == "big"
    assert JobSpec.from_json(spec).client_job_id.startswith("cli-")
    # a body changed after signing is refused by the same checks
    with pytest.raises(Exception, match="does not match its signed Content-Digest"):
        verify_as_the_coordinator(request, body[:-3] + b"x--", identity)


def test_bytes_a_file_and_a_path_send_the_same_context(tmp_path, identity):
    data = tar_folder(folder_with(tmp_path))
    (tmp_path / "c.tgz").write_bytes(data)
    got: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(form_parts(request, request.read())["context"][1])
        verify_as_the_coordinator(request, request.content, identity)
        return httpx.Response(201, json={"id": "j"})

    with api_over(identity, httpx.MockTransport(handler)) as api, open(tmp_path / "c.tgz", "rb") as f:
        f.seek(0)
        for context in (data, tmp_path / "c.tgz", f):
            api.submit(context, JobSpec())
    assert got == [data, data, data]


def test_small_bodies_are_signed_exactly_as_before(identity):
    """A JSON request's signature is byte for byte what signing the held body gives."""
    request = httpx.Request("POST", f"{SERVER}/v1/apps/invites", json={"name": "x", "admin": False})
    created, nonce = dt.datetime.now(dt.UTC).replace(microsecond=0), "fixed-nonce"
    Signer(identity.app_id, identity.private_key()).sign(request, created=created, nonce=nonce)

    before = httpx.Request("POST", f"{SERVER}/v1/apps/invites", json={"name": "x", "admin": False})
    before.read()

    class OneKey(hms.HTTPSignatureKeyResolver):
        def resolve_private_key(self, key_id):
            return identity.private_key()

    hms.HTTPMessageSigner(signature_algorithm=algorithms.ED25519, key_resolver=OneKey()).sign(
        HttpMessage(before.method, str(before.url), before.headers), key_id=identity.app_id,
        created=created, nonce=nonce, label="campugrid", covered_component_ids=COVERED,
        body=before.content)
    for name in ("content-digest", "signature-input", "signature"):
        assert request.headers[name] == before.headers[name], name
    verify_as_the_coordinator(request, request.content, identity)


class Sink(httpx.BaseTransport):
    """A server that digests what it is sent and keeps none of it."""

    def __init__(self) -> None:
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.headers: httpx.Headers | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.headers = request.headers
        for chunk in request.stream:
            self.sha256.update(chunk)
            self.size += len(chunk)
        return httpx.Response(201, json={"id": "j"})


def test_packing_and_submitting_a_big_folder_holds_no_tarball_in_memory(tmp_path, identity):
    folder = folder_with(tmp_path, big_mib=24)
    sink, ticks = Sink(), []
    with api_over(identity, sink) as api, tempfile.TemporaryFile() as context:
        tracemalloc.start()
        try:
            size = pack_folder(folder, context, lambda done, total: ticks.append((done, total)))
            context.seek(0)
            api.submit(context, JobSpec(), progress=lambda done, total: ticks.append((done, total)))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert size > 24 * MiB and peak < 6 * MiB, (size, peak)
    # what was sent is what was digested and signed (one pass each over the same file)
    import base64
    assert sink.headers["content-digest"] == f"sha-256=:{base64.b64encode(sink.sha256.digest()).decode()}:"
    assert sink.size == int(sink.headers["content-length"]) > size
    packed = 24 * MiB + len("print('hi')\n") + len((folder / "Dockerfile").read_text())
    assert (packed, packed) in ticks and (sink.size, sink.size) == ticks[-1]


def test_the_packed_context_is_the_tar_it_always_was(tmp_path):
    """Member for member and byte for byte (gzip's timestamp aside) what tar.add made."""
    folder = folder_with(tmp_path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(folder.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(folder)), recursive=False)
    assert gzip.decompress(tar_folder(folder)) == gzip.decompress(buf.getvalue())
    with tarfile.open(fileobj=io.BytesIO(tar_folder(folder))) as tar:
        assert tar.getnames() == ["Dockerfile", "src", "src/link", "src/train.py"]
        assert tar.getmember("src/link").issym()
    with pytest.raises(CampugridError, match="no Dockerfile"):
        tar_folder(folder / "src")


class Output(httpx.SyncByteStream):
    """A job's output as the coordinator streams it: `size` bytes, made as they are sent, and
    a broken connection after `break_after` bytes if asked."""

    def __init__(self, size: int, break_after: int | None = None) -> None:
        self.size, self.break_after = size, break_after

    def __iter__(self):
        sent = 0
        while sent < self.size:
            if self.break_after is not None and sent >= self.break_after:
                raise httpx.ReadError("connection reset")
            chunk = hashlib.sha256(str(sent).encode()).digest() * 2048  # 64 KiB
            chunk = chunk[: self.size - sent]
            sent += len(chunk)
            yield chunk


def expected(size: int) -> str:
    h = hashlib.sha256()
    for chunk in Output(size):
        h.update(chunk)
    return h.hexdigest()


def test_an_output_is_streamed_to_disk_not_held(tmp_path, identity):
    size = 40 * MiB + 123
    paths = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        assert "signature" in request.headers  # signed like any request
        return httpx.Response(200, stream=Output(size), headers={"content-type": "application/gzip"})

    ticks = []
    with api_over(identity, httpx.MockTransport(handler)) as api:
        tracemalloc.start()
        try:
            got = api.download_output("job-1", tmp_path / "out.tar.gz",
                                      progress=lambda done, total: ticks.append((done, total)))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert paths == ["/v1/jobs/job-1/output"]
    assert peak < 6 * MiB, peak
    assert got.path == tmp_path / "out.tar.gz" and got.size == size == got.path.stat().st_size
    assert got.sha256 == expected(size) == hashlib.sha256(got.path.read_bytes()).hexdigest()
    assert ticks[0][1] is None and ticks[-1] == (size, size)  # unknown until the end
    assert [d for d, _ in ticks] == sorted(d for d, _ in ticks)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.key", "out.tar.gz"]


def test_a_broken_download_leaves_no_half_file_and_says_to_retry(tmp_path, identity):
    (tmp_path / "out.tar.gz").write_bytes(b"yesterday's")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Output(8 * MiB, break_after=2 * MiB))

    with api_over(identity, httpx.MockTransport(handler)) as api, \
            pytest.raises(CampugridError, match=r"broke off after 2097152 bytes .*run it again"):
        api.download_output("job-1", tmp_path / "out.tar.gz")
    assert (tmp_path / "out.tar.gz").read_bytes() == b"yesterday's"
    assert not (tmp_path / "out.tar.gz.part").exists()


def test_a_job_without_output_is_not_found_and_nothing_is_written(tmp_path, identity):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "job job-1 has no output (state queued)"})

    with api_over(identity, httpx.MockTransport(handler)) as api, \
            pytest.raises(NotFound, match="has no output"):
        api.download_output("job-1", tmp_path / "out.tar.gz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.key"]
