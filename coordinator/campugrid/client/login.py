"""`campugrid login`: redeem an invite with a key made on this computer."""

from __future__ import annotations

from pathlib import Path

import httpx

from campugrid.protocol import keys, pins
from campugrid.protocol.errors import CampugridError, InvalidInput
from campugrid.protocol.identities import Identity, default_path


def login(server: str, invite: str, pin: str = "",
          identity_path: Path | None = None) -> tuple[Identity, Path]:
    """Make a key, register its public half with the invite, and keep both (0600). The old
    identity at the same path, if any, is replaced only once the coordinator accepted."""
    server = server.rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise InvalidInput(f"{server!r}: give the coordinator's REST address (http(s)://HOST:PORT)")
    verify: object = True
    if server.startswith("https://"):
        if not pin:
            raise InvalidInput("an https coordinator needs --pin (the invite names it)")
        host, port = pins.split_address(server.removeprefix("https://").split("/")[0], 443)
        verify = pins.client_context(pins.fetch_pinned(host, port, pin))
    key = keys.Ed25519PrivateKey.generate()
    try:
        resp = httpx.post(f"{server}/v1/login", json={"invite": invite.strip(),
                                                      "public_key": keys.public_text(key)},
                          timeout=30, verify=verify)  # type: ignore[arg-type]
    except httpx.TransportError as e:
        raise CampugridError(f"cannot reach the coordinator at {server} ({type(e).__name__})") from e
    if resp.status_code != 201:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        raise CampugridError(f"login refused: {detail} (HTTP {resp.status_code})")
    app = resp.json()
    path = identity_path or default_path()
    key_file = path.with_name(path.stem + ".key")
    keys.write_private(key_file, key)
    identity = Identity(server, app["id"], app["name"], key_file, pin, bool(app["admin"]))
    return identity, identity.save(path)
