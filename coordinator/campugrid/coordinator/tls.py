"""The coordinator's own TLS certificate, made on first start and kept in its state folder.

Agents and remote apps pin its fingerprint (campugrid.protocol.pins); nothing else vouches
for it, so it is a self-signed certificate for a fixed name (wire.TLS_NAME).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from campugrid.protocol import pins
from campugrid.protocol.wire import TLS_NAME


@dataclasses.dataclass(frozen=True)
class Certificate:
    cert_file: Path
    key_file: Path
    fingerprint: str

    @property
    def pem(self) -> bytes:
        return self.cert_file.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key_file.read_bytes()


def ensure_certificate(folder: Path) -> Certificate:
    cert_file, key_file = folder / "coordinator.crt", folder / "coordinator.key"
    if not (cert_file.exists() and key_file.exists()):
        write_self_signed(cert_file, key_file, TLS_NAME, [
            (x509.SubjectAlternativeName([
                x509.DNSName(TLS_NAME), x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
            (x509.BasicConstraints(ca=True, path_length=0), True)])
    return Certificate(cert_file, key_file, pins.certificate_fingerprint(cert_file.read_text()))


def write_self_signed(cert_file: Path, key_file: Path, common_name: str,
                      extensions: Sequence[tuple[x509.ExtensionType, bool]] = ()) -> None:
    """A new P-256 key (0600, written whole or not at all) and its self-signed certificate
    for ten years, with `extensions` (each with whether it is critical)."""
    cert_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=3650)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    cert = builder.sign(key, hashes.SHA256())
    fd = os.open(key_file.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    os.replace(key_file.with_suffix(".tmp"), key_file)
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
