"""Inside a build's network namespace (whose only interface is its loopback): listen on
127.0.0.1:PORT and carry every connection, byte for byte, to the agent's egress proxy on a
unix socket outside. The build's proxy settings name this address; anything else a RUN step
tries finds no route. Standard library only: it runs as `python3 -m` from the agent's venv.

    python -m campugrid.builders.relay PORT SOCKET
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """A new network namespace's loopback starts down: bring it up (as `ip link set lo up`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))
        flags = struct.unpack("16sH", got[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


async def _carry(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while data := await src.read(256 * 1024):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()


async def _main(port: int, socket_path: str) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            r, w = await asyncio.open_unix_connection(socket_path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_carry(reader, w), _carry(r, writer))
        w.close()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print("relay ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    loopback_up()
    asyncio.run(_main(int(sys.argv[1]), sys.argv[2]))
