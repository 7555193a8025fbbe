"""The coordinator as the OCI registry's token issuer.

The registry (the embedded `docker-registry`, or any registry configured for token
authentication with our certificate) trusts bearer tokens this module signs: ES256 JWTs
naming one repository and its allowed actions, for a few minutes. A machine gets one for the
one repository its task builds or pulls, over the task's fenced gRPC call; nobody gets a
token to list the catalogue. The signing key never leaves the state folder (0600).
"""

from __future__ import annotations

import base64
import ipaddress
import secrets
import time
from pathlib import Path

import httpx
import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from campugrid.coordinator.tls import write_self_signed
from campugrid.protocol.errors import StorageError

SERVICE = "campugrid-registry"
ISSUER = "campugrid-coordinator"
MANIFEST_TYPES = ", ".join((
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
))


def ensure_signing_key(folder: Path) -> tuple[Path, Path]:
    """The token signing key and its self-signed certificate (the registry's
    `auth.token.rootcertbundle`), made at the first start."""
    key_path, cert_path = folder / "token.key", folder / "token.crt"
    if not (key_path.exists() and cert_path.exists()):
        write_self_signed(cert_path, key_path, ISSUER)
    return key_path, cert_path


def is_loopback(address: str) -> bool:
    """A registry at host:port on this host only (plain HTTP is accepted only there)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RegistryTokens:
    def __init__(self, folder: Path, address: str, ttl_s: float = 900) -> None:
        key_path, cert_path = ensure_signing_key(folder)
        self.address = address  # host:port, as machines and this process reach it
        self.ttl_s = ttl_s
        self._key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        # The registry finds the key by the certificate in the header, checked against its
        # root bundle (which is this certificate).
        self._x5c = [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()]

    def mint(self, subject: str, repository: str, actions: tuple[str, ...],
             ttl_s: float | None = None) -> str:
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": subject, "aud": SERVICE, "iat": now, "nbf": now - 5,
                  "exp": now + int(ttl_s or self.ttl_s), "jti": secrets.token_hex(16),
                  "access": [{"type": "repository", "name": repository,
                              "actions": list(actions)}]}
        return jwt.encode(claims, self._key, algorithm="ES256",  # type: ignore[arg-type]
                          headers={"x5c": self._x5c})

    @property
    def base_url(self) -> str:
        return f"{'http' if is_loopback(self.address) else 'https'}://{self.address}"

    def has_manifest(self, repository: str, digest: str) -> bool:
        """Whether the registry holds this manifest (what a machine says it pushed)."""
        token = self.mint("campugrid-coordinator", repository, ("pull",), ttl_s=60)
        try:
            resp = httpx.head(f"{self.base_url}/v2/{repository}/manifests/{digest}", timeout=30,
                              headers={"Authorization": f"Bearer {token}",
                                       "Accept": MANIFEST_TYPES})
        except httpx.HTTPError as e:
            raise StorageError(f"the image registry at {self.address} cannot be reached "
                               f"({type(e).__name__})") from e
        return resp.status_code == 200 and resp.headers.get("docker-content-digest") == digest

    def delete_manifest(self, repository: str, digest: str) -> bool:
        """Drop a manifest (its blobs go at the registry's next garbage collection)."""
        token = self.mint("campugrid-coordinator", repository, ("delete",), ttl_s=60)
        try:
            resp = httpx.delete(f"{self.base_url}/v2/{repository}/manifests/{digest}",
                                timeout=30, headers={"Authorization": f"Bearer {token}"})
        except httpx.HTTPError as e:
            raise StorageError(f"the image registry at {self.address} cannot be reached "
                               f"({type(e).__name__})") from e
        return resp.status_code in (202, 404)
