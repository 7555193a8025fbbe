"""The embedded SeaweedFS hands stored objects to nobody but S3 clients with keys.

Its master, volume and filer ports answer anyone who reaches them (the master even signs
read tokens for whoever asks), so they must not be reachable: the probes below try a local
attacker's whole chain — filer HTTP and gRPC, the master's lookups and assignments, the
volume server by file id — from our network namespace, and the JWT layer from inside weed's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from campugrid.cli.seaweed import EmbeddedS3, end_processes, stale_weeds
from campugrid.coordinator.objects import S3Store

pytestmark = pytest.mark.integration
TTL = dt.timedelta(minutes=5)

# Run as a separate process, so that it can run inside weed's network namespace too.
PROBE = r'''
import json, re, sys
import grpc, httpx

ports, bucket, keys, marker, fids = json.loads(sys.argv[1])
marker = marker.encode()
out = {}

def http(name, method, url, **kw):
    try:
        r = httpx.request(method, url, timeout=5, **kw)
    except httpx.HTTPError as e:
        out[name] = {"status": type(e).__name__, "leak": False}
        return None
    out[name] = {"status": r.status_code, "leak": marker in r.content, "body": r.text[:300]}
    return r

filer = f"http://127.0.0.1:{ports['filer.port']}"
master = f"http://127.0.0.1:{ports['master.port']}"
volume = f"http://127.0.0.1:{ports['volume.port']}"
for key in keys:
    http(f"filer GET {key}", "GET", f"{filer}/buckets/{bucket}/{key}")
    http(f"filer metadata {key}", "GET", f"{filer}/buckets/{bucket}/{key}?metadata=true",
         headers={"Accept": "application/json"})
r = http("filer listing", "GET", f"{filer}/buckets/{bucket}/", headers={"Accept": "application/json"})
if r is not None:
    out["filer listing"]["leak"] |= any(k.encode() in r.content for k in keys)

# The filer's gRPC ListEntries names every chunk's file id (and carries small files inline).
try:
    channel = grpc.insecure_channel(f"127.0.0.1:{ports['filer.port.grpc']}")
    call = channel.unary_stream("/filer_pb.SeaweedFiler/ListEntries",
                                request_serializer=lambda x: x, response_deserializer=lambda x: x)
    raw = b""
    for folder in sorted({f"/buckets/{bucket}/{k}".rsplit("/", 1)[0] for k in keys}):
        d = folder.encode()
        raw += b"".join(call(b"\x0a" + bytes([len(d)]) + d + b"\x28\x64", timeout=5))  # limit 100
    found = sorted({m.decode() for m in re.findall(rb"\d+,[0-9a-f]{9,}", raw)})
    out["filer gRPC ListEntries"] = {"status": "answered", "fids": found,
                                     "leak": marker in raw or any(k.encode() in raw for k in keys)}
    fids = fids or found
except grpc.RpcError as e:
    out["filer gRPC ListEntries"] = {"status": str(e.code()), "leak": False}

for fid in fids:
    http(f"volume GET {fid} (no token)", "GET", f"{volume}/{fid}")
    r = http(f"master lookup {fid}", "GET", f"{master}/dir/lookup?fileId={fid}&read=yes")
    token = r.headers.get("Authorization") if r is not None else None
    out[f"master lookup {fid}"]["token"] = bool(token)
    if token:
        http(f"volume GET {fid} (master's token)", "GET", f"{volume}/{fid}",
             headers={"Authorization": token})
    http(f"master GET {fid}", "GET", f"{master}/{fid}", follow_redirects=True)

r = http("master assign", "GET", f"{master}/dir/assign")
assigned = r.json().get("fid") if r is not None and r.status_code == 200 else None
out["master assign"]["fid"] = assigned
if assigned:
    w = http("volume write", "POST", f"{volume}/{assigned}", files={"file": ("x", b"planted")},
             headers={"Authorization": r.headers.get("Authorization", "")})
    out["volume write"]["written"] = w is not None and w.status_code < 300
print(json.dumps(out))
'''


def probe(server: EmbeddedS3, bucket: str, keys: list[str], marker: str,
          fids: list[str] | None = None, inside: bool = False) -> dict[str, dict[str, object]]:
    assert server.process is not None
    argv = [sys.executable, "-c", PROBE, json.dumps([server.ports, bucket, keys, marker, fids or []])]
    if inside:
        argv = ["nsenter", "-t", str(server.process.pid), "-n", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(done.stdout))


def leaks(report: dict[str, dict[str, object]]) -> list[str]:
    return [name for name, r in report.items() if r.get("leak") or r.get("written")
            or r.get("fid") or r.get("token")]


def stored_secret(s3: S3Store) -> tuple[list[str], str]:
    marker = f"build-context-{secrets.token_hex(8)}"
    s3.put_bytes("contexts/job-1.tar", (marker * 400).encode())  # chunked onto a volume
    s3.put_bytes("contexts/tiny", marker.encode())
    return ["contexts/job-1.tar", "contexts/tiny"], marker


def test_weed_has_a_network_and_tmp_of_its_own(s3_server: EmbeddedS3):
    assert s3_server.process is not None
    pid = s3_server.process.pid
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    # weed's gRPC unix sockets sit at fixed /tmp paths that anyone could create first.
    assert os.stat(f"/proc/{pid}/root/tmp").st_dev != os.stat("/tmp").st_dev
    assert any(n.startswith("seaweedfs-filer-grpc-") for n in os.listdir(f"/proc/{pid}/root/tmp"))
    assert os.stat(s3_server.data_dir / "s3.sock").st_mode & 0o077 == 0


def test_internal_ports_give_a_local_process_nothing(s3: S3Store, s3_server: EmbeddedS3):
    keys, marker = stored_secret(s3)
    fids: list[str] = []
    if os.geteuid() == 0:
        # From inside weed's namespace the probe can steal (so it is a real probe), which
        # also gives it the objects' real file ids to try from outside.
        inside = probe(s3_server, s3.bucket, keys, marker, inside=True)
        fids = list(inside["filer gRPC ListEntries"]["fids"])
        assert fids, inside
        assert any(r["leak"] for name, r in inside.items() if name.startswith("volume GET")), inside
    outside = probe(s3_server, s3.bucket, keys, marker, fids=fids or ["1,01637037d6"])
    assert leaks(outside) == [], json.dumps(outside, indent=1)
    # And S3 without keys gives nothing either.
    for key in keys:
        r = httpx.get(f"http://{s3_server.endpoint}/{s3.bucket}/{key}")
        assert r.status_code == 403 and marker.encode() not in r.content


@pytest.mark.skipif(os.geteuid() != 0, reason="entering weed's namespace needs root")
def test_inside_its_namespace_filer_and_volume_still_want_a_signed_token(s3: S3Store,
                                                                        s3_server: EmbeddedS3):
    keys, marker = stored_secret(s3)
    inside = probe(s3_server, s3.bucket, keys, marker, inside=True)
    fids = list(inside["filer gRPC ListEntries"]["fids"])
    unsigned = [f"filer GET {k}" for k in keys] + [f"filer metadata {k}" for k in keys] + [
        "filer listing"] + [f"volume GET {f} (no token)" for f in fids]
    for name in unsigned:
        assert inside[name]["status"] == 401 and not inside[name]["leak"], (name, inside[name])


def test_s3_keeps_working_through_the_one_door(s3: S3Store):
    big = secrets.token_bytes(12 * 1024 * 1024 + 17)
    s3.put_bytes("big.bin", big)
    assert s3.digest("big.bin") == (len(big), hashlib.sha256(big).hexdigest())
    put = s3.presign_put("out/result.tgz", TTL)
    assert httpx.put(put, content=b"result").status_code == 200
    assert httpx.get(s3.presign_get("out/result.tgz", TTL)).content == b"result"
    upload = s3.begin_multipart("ckpt/epoch-1.tar")
    parts = [secrets.token_bytes(5 * 1024 * 1024), b"tail"]
    etags = []
    for n, part in enumerate(parts, 1):
        r = httpx.put(s3.presign_part("ckpt/epoch-1.tar", upload, n, TTL), content=part, timeout=60)
        assert r.status_code == 200, r.text
        etags.append(r.headers["ETag"])
    s3.complete_multipart("ckpt/epoch-1.tar", upload, etags)
    assert s3.get_bytes("ckpt/epoch-1.tar") == b"".join(parts)


OWNER = r'''
import json, sys, time
from pathlib import Path
from campugrid.cli.seaweed import EmbeddedS3, end_processes, stale_weeds
s = EmbeddedS3(Path(sys.argv[1]), "owner", "owner-secret-0123456789abcdef").start()
print(json.dumps({"weed": s.process.pid, "guard": s._guard_proc.pid}), flush=True)
time.sleep(600)
'''


def _start_owner(data_dir: Path) -> tuple[subprocess.Popen[str], dict[str, int]]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(data_dir)], stdout=subprocess.PIPE,
                             text=True)
    assert owner.stdout is not None
    ready, _, _ = select.select([owner.stdout], [], [], 90)
    line = owner.stdout.readline() if ready else ""
    if not line:
        _kill(owner)
        pytest.fail(f"SeaweedFS did not start: {(data_dir / 'weed.log').read_text()[-2000:]}")
    return owner, json.loads(line)


def _kill(owner: subprocess.Popen[str]) -> None:
    owner.kill()  # SIGKILL: no chance to clean up
    owner.wait()
    assert owner.stdout is not None
    owner.stdout.close()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def data_dir(shared_tmp: Path) -> Iterator[Path]:
    yield shared_tmp / "s3"
    end_processes(stale_weeds(shared_tmp / "s3"), "SeaweedFS left by the test")


def test_weed_dies_with_its_owner_and_a_survivor_is_stopped_on_the_next_start(data_dir: Path):
    owner, pids = _start_owner(data_dir)
    _kill(owner)  # the guard sees its pipe close
    assert _gone_within(pids["weed"], 5), "SeaweedFS outlived its owner"

    # Now a survivor: its guard dies too (say, the whole machine's processes were shot).
    owner, pids = _start_owner(data_dir)
    os.kill(pids["guard"], signal.SIGKILL)
    _kill(owner)
    time.sleep(0.5)
    assert _alive(pids["weed"])
    before = (data_dir / "security.toml").read_text()
    server = EmbeddedS3(data_dir, "again", "again-secret-0123456789abcdef").start(timeout_s=60)
    try:
        assert not _alive(pids["weed"])  # the survivor held the filer's leveldb LOCK
        assert (data_dir / "security.toml").stat().st_mode & 0o777 == 0o600
        after = (data_dir / "security.toml").read_text()
        assert after != before and after.count('key = "') == 4
        store = S3Store(server.endpoint, "again", "again-secret-0123456789abcdef", "after-restart")
        store.ensure_bucket()
        store.put_bytes("k", b"v")
        assert store.get_bytes("k") == b"v"
    finally:
        server.stop()
    assert not (data_dir / "weed.pid").exists()
