"""The egress proxy for real, on loopback sockets: the agent's proxy for one build on a unix
socket, in front of the platform's on TCP (asked with CONNECT and a machine's token), in
front of an origin server the operator pinned. Every connection is one record; a budget stops
a build that downloads too much; a missing or wrong token is refused at the platform."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from campugrid.egress.policy import Policy, parse_pins
from campugrid.egress.proxy import EgressProxy, Record, Serving, Upstream

pytestmark = pytest.mark.integration
BIG = 2 * 1024 * 1024


class Origin(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:
        Origin.seen.append(self.path)
        body = b"x" * (BIG if self.path == "/big" else 5)
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def origin() -> Iterator[int]:
    Origin.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def client(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=30)


def get(c: httpx.Client, url: str) -> httpx.Response:
    """A proxy request (absolute URL), as pip, apt and curl send one to their http_proxy."""
    return c.send(c.build_request("GET", "http://proxy/", extensions={"target": url.encode()}))


def connect(sock: Path, target: str) -> str:
    """A CONNECT, as a client of an https URL sends it; the proxy's status line."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock))
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        return s.recv(4096).decode("latin-1").split("\r\n")[0]


def test_direct_each_connection_is_one_record_and_the_budget_holds(origin, tmp_path):
    records: list[Record] = []
    policy = Policy(hosts=(), pins=parse_pins(f"files.example.test:80=127.0.0.1:{origin}"))
    proxy = EgressProxy(policy, budget=1024 * 1024, log=records.append)
    with Serving(proxy, unix=tmp_path / "e.sock"), client(tmp_path / "e.sock") as c:
        ok = get(c, "http://files.example.test/small?q=1")
        assert ok.status_code == 200 and ok.content == b"xxxxx"
        refused = get(c, f"http://127.0.0.1:{origin}/direct")
        assert refused.status_code == 403 and "an address, not a name" in refused.text
        assert connect(tmp_path / "e.sock", "example.org:443").startswith("HTTP/1.1 403")
        with pytest.raises(httpx.HTTPError):  # cut off past the budget
            get(c, "http://files.example.test/big")
        after = get(c, "http://files.example.test/small")
        assert after.status_code == 403 and "downloaded more than 1 MB" in after.text
        with socket.socket(socket.AF_UNIX) as s:  # not HTTP at all
            s.connect(str(tmp_path / "e.sock"))
            s.sendall(b"\x16\x03\x01 hello\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 400")
    assert Origin.seen == ["/small?q=1", "/big"]  # the refused ones never reached it
    lines = [r.line() for r in records]
    assert any(line.startswith("[egress] GET files.example.test/small?q=1: ") and
               "bytes in" in line for line in lines), lines
    assert any(line.startswith("[egress] refused GET 127.0.0.1/direct: an address") for line in lines)
    assert any(line.startswith("[egress] refused CONNECT example.org:443: example.org is not")
               for line in lines)
    assert any("GET files.example.test/big" in line and "downloaded more than" in line
               for line in lines), lines
    assert any(line == "[egress] refused a connection: not an HTTP/1 proxy request"
               for line in lines), lines
    assert len(records) == 6  # every connection, refused or not


def test_the_agents_proxy_goes_through_the_platforms_with_the_machines_token(origin, tmp_path):
    """The platform's proxy decides the address and admits only a machine's token, which the
    agent's proxy adds: the build neither holds nor needs one."""
    asked: list[str] = []

    def authorize(header: str, address: str) -> str | None:
        asked.append(header)
        return None if header == Upstream("", "good").basic() else "a machine's token is needed"

    pins = parse_pins(f"files.example.test:80=127.0.0.1:{origin}")
    platform_records: list[Record] = []
    platform = EgressProxy(Policy(hosts=(), pins=pins), authorize=authorize,
                           log=platform_records.append)
    with Serving(platform, tcp=("127.0.0.1", 0)) as served:
        assert served.address is not None
        parent_url = f"http://127.0.0.1:{served.address[1]}"
        for token, status in (("good", 200), ("stolen", 403)):
            records: list[Record] = []
            # the agent's own policy lets the name through; the platform's pins it
            front = EgressProxy(Policy(hosts=("files.example.test",)), log=records.append,
                                parent=Upstream(parent_url, token))
            with Serving(front, unix=tmp_path / f"{token}.sock"), \
                    client(tmp_path / f"{token}.sock") as c:
                got = get(c, "http://files.example.test/via")
            assert got.status_code == status, got.text
            line = records[0].line()
            if status == 200:
                assert got.content == b"xxxxx"
                assert "via the platform's egress proxy" in line and "refused" not in line
            else:
                assert "the platform's egress proxy: a machine's token is needed" in line, line
        # a client that is not a machine's proxy: no token at all
        with socket.create_connection(served.address) as s:
            s.sendall(b"CONNECT files.example.test:80 HTTP/1.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 407")
    assert Origin.seen == ["/via"]
    assert asked[:2] == [Upstream("", "good").basic(), Upstream("", "stolen").basic()]
    assert "token" not in " ".join(r.line() for r in platform_records if not r.refused)
