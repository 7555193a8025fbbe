"""The SDK's connections to the coordinator: a request that a server closing a kept-alive
connection loses is asked again once when it is a read, never when it is a write."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from campugrid.client.api import KEEPALIVE_S, Api
from campugrid.protocol.errors import CampugridError


class ClosingServer:
    """HTTP/1.1 on loopback: on each connection it answers the first request (kept alive)
    and closes the connection as the second arrives, without an answer: what a server
    dropping an idle connection does to the request sent on it at that moment."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answered: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            first = self._request(conn)
            if first is None:
                return
            self.answered.append(first)
            body = json.dumps({"id": "j1", "state": "queued"}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            self._request(conn)  # and close, unanswered

    @staticmethod
    def _request(conn: socket.socket) -> str | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        return data.split(b" ", 2)[0].decode() + " " + data.split(b" ", 2)[1].decode()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server() -> Iterator[ClosingServer]:
    s = ClosingServer()
    yield s
    s.close()


def test_a_read_lost_on_a_closing_connection_is_asked_again_on_a_new_one(server: ClosingServer) -> None:
    with Api(f"http://127.0.0.1:{server.port}") as api:
        assert api.job("j1")["state"] == "queued"
        assert api.job("j1")["state"] == "queued"  # the kept connection closed on it
    assert server.answered == ["GET /v1/jobs/j1", "GET /v1/jobs/j1"]


def test_a_write_lost_on_a_closing_connection_is_not_sent_again(server: ClosingServer) -> None:
    with Api(f"http://127.0.0.1:{server.port}") as api:
        api.job("j1")
        with pytest.raises(CampugridError, match="cannot reach the coordinator"):
            api.cancel("j1")
    assert server.answered == ["GET /v1/jobs/j1"]


def test_idle_connections_are_dropped_before_the_coordinators_server_drops_them() -> None:
    import uvicorn

    assert uvicorn.Config(app=None).timeout_keep_alive > KEEPALIVE_S  # type: ignore[arg-type]
