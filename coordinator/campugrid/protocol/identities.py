"""An app's identity on its own computer (the file `campugrid login` writes, and that the
coordinator writes for its local admin at its first start), and what a signed REST request
covers: the contract between the SDK that signs and the coordinator that checks."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from campugrid.protocol import keys
from campugrid.protocol.errors import CampugridError

COVERED = ("@method", "@target-uri", "content-digest")  # what every request's signature covers


def default_path() -> Path:
    env = os.environ.get("CAMPUGRID_IDENTITY")
    if env:
        return Path(env)
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "campugrid" / "identity.json"


@dataclasses.dataclass(frozen=True)
class Identity:
    server: str  # the coordinator's REST address
    app_id: str  # the signatures' keyid
    name: str
    key_file: Path
    pin: str = ""  # the coordinator's certificate fingerprint (https only)
    admin: bool = False

    @classmethod
    def load(cls, path: Path | None = None) -> Identity:
        path = path or default_path()
        try:
            raw = json.loads(path.read_text())
            key_file = Path(raw["key_file"])
            return cls(str(raw["server"]), str(raw["app_id"]), str(raw["name"]),
                       key_file if key_file.is_absolute() else path.parent / key_file,
                       str(raw.get("pin") or ""), bool(raw.get("admin")))
        except FileNotFoundError as e:
            raise CampugridError(
                f"no identity at {path}: log in first (`campugrid login SERVER --invite CODE`; "
                "`campugrid up` makes an admin identity for its local user)") from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CampugridError(f"the identity {path} is damaged ({e}); log in again") from e

    def save(self, path: Path | None = None) -> Path:
        path = path or default_path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"server": self.server, "app_id": self.app_id, "name": self.name,
                       "key_file": str(self.key_file), "pin": self.pin,
                       "admin": self.admin}, f, indent=2)
        os.replace(tmp, path)
        return path

    def private_key(self) -> keys.Ed25519PrivateKey:
        return keys.load_private(self.key_file)


@dataclasses.dataclass
class HttpMessage:
    """A request as http-message-signatures reads it, on either side of the wire."""

    method: str
    url: str
    headers: Any
