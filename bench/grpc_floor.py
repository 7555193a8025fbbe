"""What gRPC itself costs a server per idle stream, without campugrid: the floor under
bench/fleet.py's memory and CPU per agent, measured in the same run.

    .venv/bin/python bench/grpc_floor.py [--streams 2000]

A bare grpc.aio server (one stream method that takes the stream, as Connect does, and reads
until it ends) on the coordinator's kind of certificate (coordinator/tls.py), and one client
process opening that many channels, each with one stream and one message, as many
connections as agents. Measured on the server: resident memory and CPU per stream, over TLS
and over plain TCP (what TLS adds: BoringSSL's connection and gRPC's buffers around it, which
grpcio's Python API does not let a server size).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Beside this script, as bench/fleet.py has them.
from fleet_coordinators import rss_bytes  # type: ignore[import-not-found]
from scheduler import _cpu  # type: ignore[import-not-found]

METHOD = "/floor.Floor/Connect"
BATCH = 100  # streams opened at once by the client


def _serve(port_file: Path, folder: Path, tls: bool) -> None:
    import grpc

    from campugrid.coordinator.tls import ensure_certificate

    async def connect(requests, context):  # type: ignore[no-untyped-def]
        await context.send_initial_metadata((("taken", "1"),))
        async for _ in requests:
            pass
        return
        yield  # a stream of replies, as Connect's

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", {
            "Connect": grpc.stream_stream_rpc_method_handler(connect)}),))
        if tls:
            cert = ensure_certificate(folder)
            port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
                [(cert.key_pem, cert.pem)]))
        else:
            port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_file.write_text(str(port))
        await server.wait_for_termination()

    asyncio.run(main())


def _connect(port: int, folder: Path, tls: bool, streams: int, done: Path) -> None:
    import grpc

    from campugrid.protocol.wire import TLS_NAME

    async def one() -> object:
        if tls:
            pem = (folder / "coordinator.crt").read_bytes()
            channel = grpc.aio.secure_channel(
                f"127.0.0.1:{port}", grpc.ssl_channel_credentials(pem),
                options=[("grpc.ssl_target_name_override", TLS_NAME)])
        else:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = channel.stream_stream(METHOD)()
        await call.initial_metadata()
        await call.write(b"ready")
        return channel, call

    async def main() -> None:
        held = []
        for i in range(0, streams, BATCH):
            held += await asyncio.gather(*[one() for _ in range(min(BATCH, streams - i))])
        done.write_text(str(len(held)))
        await asyncio.sleep(3600)

    asyncio.run(main())


def floor(streams: int, tls: bool) -> dict[str, float]:
    """The bare server's memory (KB) and CPU (ms) per stream, `streams` of them held."""
    with tempfile.TemporaryDirectory(prefix="campugrid-floor-") as tmp:
        port_file, done = Path(tmp) / "port", Path(tmp) / "done"
        me = [sys.executable, __file__]
        mode = "tls" if tls else "plain"
        server = subprocess.Popen([*me, "serve", str(port_file), tmp, mode])
        client = None
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the bare gRPC server did not start")
                time.sleep(0.05)
            time.sleep(0.5)  # settled
            rss0, cpu0 = rss_bytes(server.pid), _cpu(server.pid)
            client = subprocess.Popen([*me, "connect", port_file.read_text(), tmp, mode,
                                       str(streams), str(done)])
            deadline = time.monotonic() + 30 + streams / 50
            while not done.exists():
                if time.monotonic() > deadline or client.poll() is not None:
                    raise RuntimeError(f"the client did not open {streams} streams")
                time.sleep(0.2)
            time.sleep(2)  # the last ones' first messages read
            return {"kb": (rss_bytes(server.pid) - rss0) / streams / 1024,
                    "cpu_ms": (_cpu(server.pid) - cpu0) / streams * 1000}
        finally:
            for p in (client, server):
                if p is not None:
                    p.kill()
                    p.wait()


@dataclasses.dataclass
class Floor:
    """gRPC's own cost per idle stream, `streams` of them (nan: not measured)."""

    streams: int
    tls_kb: float = math.nan
    tls_cpu_ms: float = math.nan
    plain_kb: float = math.nan
    plain_cpu_ms: float = math.nan

    @classmethod
    def measure(cls, streams: int) -> Floor:
        """Over TLS and plain TCP; what could not be measured is said and left nan."""
        try:
            tls, plain = floor(streams, tls=True), floor(streams, tls=False)
        except Exception as e:  # the caller's own rows are still reported
            print(f"  gRPC's floor not measured: {type(e).__name__}: {e}", file=sys.stderr)
            return cls(streams)
        return cls(streams, tls["kb"], tls["cpu_ms"], plain["kb"], plain["cpu_ms"])

    def sentence(self) -> str:
        return (f"gRPC's own floor (bench/grpc_floor.py): a bare grpc.aio server holding "
                f"{self.streams} idle streams, one connection each, on the coordinator's kind of "
                f"certificate: {self.tls_kb:.1f} KB and {self.tls_cpu_ms:.2f} ms of CPU per "
                f"stream over TLS, {self.plain_kb:.1f} KB and {self.plain_cpu_ms:.2f} ms over "
                "plain TCP.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    args = parser.parse_args()
    print(f"\na bare grpc.aio server holding {args.streams} idle streams, one connection each\n")
    print("| transport | server KB/stream | server CPU ms/stream (opening) |")
    print("|-----------|------------------|--------------------------------|")
    for tls in (True, False):
        f = floor(args.streams, tls)
        print(f"| {'TLS' if tls else 'plain TCP':9} | {f['kb']:16.1f} | {f['cpu_ms']:30.2f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        _serve(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "tls")
    elif len(sys.argv) > 1 and sys.argv[1] == "connect":
        _connect(int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "tls", int(sys.argv[5]),
                 Path(sys.argv[6]))
    else:
        main()
