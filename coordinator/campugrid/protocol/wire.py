"""What the agent and the coordinator agree on beside the protobuf messages: the metadata of
a signed call, and the bytes its signature covers.

Every gRPC call is signed with the machine's own Ed25519 key over the method, the SHA-256 of
the serialized request, the time and a nonce (and, for the first `Register`, the public key
it is registering, in place of a machine id). The channel itself is TLS to a coordinator
certificate the agent pinned at join.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time

from campugrid.protocol import keys

MACHINE_HEADER = "x-campugrid-machine"  # the caller's machine id
KEY_HEADER = "x-campugrid-key"  # Register only: the public key being registered (base64)
CREATED_HEADER = "x-campugrid-created"  # Unix seconds
NONCE_HEADER = "x-campugrid-nonce"
SIGNATURE_HEADER = "x-campugrid-signature"  # base64 of the Ed25519 signature
# What the coordinator's TLS certificate is issued for; the agent checks the name (and pins
# the certificate itself), whatever address it dials.
TLS_NAME = "campugrid-coordinator"
CALL_WINDOW_S = 120  # a call signed further from the coordinator's clock is refused


# A stream (AgentService.Connect) is signed once, when it opens, over the SHA-256 of no bytes:
# its messages come later, on the connection that signature opened, and are the signer's.
STREAM_BODY = b""
# Sent by the coordinator as a stream's initial metadata once it has taken the stream; the
# agent writes nothing before it. (A client that writes while the server refuses its
# stream can lose the refusal: gRPC then reports INTERNAL, "Internal error from Core".)
STREAM_TAKEN = ("x-campugrid-stream", "taken")
# In a refusal's trailing metadata: when to try again, in milliseconds (a coordinator taking
# many streams at once spaces out those it turns away; see coordinator/agent_calls.py).
RETRY_AFTER_HEADER = "x-campugrid-retry-after-ms"


def call_base(method: str, body_sha256: str, created: int, nonce: str, signer: str) -> bytes:
    """The bytes a call's signature covers. `signer` is the machine id, or `key:` and the
    public key for Register."""
    return "\n".join(("campugrid-call-v1", method, body_sha256, str(created), nonce,
                      signer)).encode()


def signed_metadata(key: keys.Ed25519PrivateKey, method: str, body: bytes,
                    signer: str) -> list[tuple[str, str]]:
    """The time, nonce and signature of one call (campugrid.protocol.wire.call_base)."""
    created, nonce = int(time.time()), secrets.token_urlsafe(18)
    digest = hashlib.sha256(body).hexdigest()
    signature = key.sign(call_base(method, digest, created, nonce, signer))
    return [(CREATED_HEADER, str(created)), (NONCE_HEADER, nonce),
            (SIGNATURE_HEADER, base64.b64encode(signature).decode())]


CHANNEL_OPTIONS = (
    ("grpc.ssl_target_name_override", TLS_NAME),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)
