"""Ed25519 identities: key files, public halves on the wire, fingerprints a person compares.

Every app and every machine makes its own key pair on its own side and keeps the private half
in a 0600 file; the coordinator stores only the public half and its fingerprint. Fingerprints
read like OpenSSH's (`SHA256:` and unpadded base64 of the SHA-256 of the raw key or
certificate), so a person can compare them on two screens.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from campugrid.protocol.errors import CampugridError, InvalidInput

__all__ = ["Ed25519PrivateKey", "Ed25519PublicKey", "InvalidSignature"]


def fingerprint(data: bytes) -> str:
    """`SHA256:…` of a raw public key or a certificate's DER bytes."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public half as sent on the wire and stored: base64 of its 32 raw bytes."""
    return base64.b64encode(public_raw(key)).decode()


def key_fingerprint(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    return fingerprint(public_raw(key))


def parse_public(text: str) -> Ed25519PublicKey:
    """A public key as sent by a client; InvalidInput with what is wrong otherwise."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise InvalidInput("public_key: not base64") from e
    if len(raw) != 32:
        raise InvalidInput(f"public_key: an Ed25519 public key has 32 bytes, not {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def write_private(path: Path, key: Ed25519PrivateKey) -> None:
    """Write a private key as PKCS#8 PEM, 0600 from its first byte, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.replace(tmp, path)


def load_private(path: Path) -> Ed25519PrivateKey:
    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes()
    except OSError as e:
        raise CampugridError(f"cannot read the key {path}: {e.strerror}") from e
    if mode & 0o077:
        raise CampugridError(f"the key {path} is readable by others (mode {mode:o}); "
                             f"chmod 600 {path}")
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise CampugridError(f"{path} is not an Ed25519 private key")
    return key


def load_or_create(path: Path) -> tuple[Ed25519PrivateKey, bool]:
    """The key in `path`, or a new one written there (True: it was made now)."""
    if path.exists():
        return load_private(path), False
    key = Ed25519PrivateKey.generate()
    write_private(path, key)
    return key, True
