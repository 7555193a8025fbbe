"""Pinned TLS: the coordinator's certificate is its own (made at first start), so clients
trust exactly the certificate whose fingerprint they were given, not a CA.

The fingerprint is SHA-256 over the certificate's DER bytes, written as keys.fingerprint
writes it. A client fetches the certificate once, checks the pin, keeps the PEM and from
then on verifies every connection against that PEM alone.
"""

from __future__ import annotations

import hmac
import socket
import ssl

from campugrid.protocol import keys
from campugrid.protocol.errors import CampugridError


class PinMismatch(CampugridError):
    pass


def split_address(address: str, default_port: int) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address.strip("[]"), default_port
    return host.strip("[]"), int(port)


def certificate_fingerprint(pem: str) -> str:
    return keys.fingerprint(ssl.PEM_cert_to_DER_cert(pem))


def fetch_pinned(host: str, port: int, pin: str, timeout_s: float = 10.0) -> str:
    """The server's certificate as PEM, if its fingerprint is `pin`; PinMismatch otherwise.
    The handshake itself is not trusted: only the fingerprint check makes the PEM usable."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock, \
                ctx.wrap_socket(sock, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError) as e:
        raise CampugridError(f"cannot reach {host}:{port} over TLS: {e}") from e
    if der is None:
        raise CampugridError(f"{host}:{port} showed no certificate")
    seen = keys.fingerprint(der)
    if not hmac.compare_digest(seen, pin.strip()):
        raise PinMismatch(f"{host}:{port} shows certificate {seen}, not the pinned {pin}: this "
                          "is not the coordinator you joined (or it made a new certificate); "
                          "do not go on unless its operator confirms the new fingerprint")
    return ssl.DER_cert_to_PEM_cert(der)


def client_context(pem: str) -> ssl.SSLContext:
    """An SSL context that trusts this one certificate and nothing else. The name is not
    checked: the certificate is pinned, whatever address reaches it."""
    ctx = ssl.create_default_context(cadata=pem)
    ctx.check_hostname = False
    return ctx
