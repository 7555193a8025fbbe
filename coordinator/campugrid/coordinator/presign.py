"""Presigned URLs (AWS Signature V4, query form) exactly as the minio SDK makes them, but with
the day's signing key kept: every lease signs an upload URL, and the SDK's general path
(URL building, four HMACs per URL) was a sixth of the coordinator's time per lease.

tests/unit/test_presign.py checks that the URLs are identical to the SDK's over many endpoints;
the platform's tests use them against a real S3 server.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import threading
from collections.abc import Mapping
from urllib.parse import parse_qs, quote, urlsplit

from minio import Minio

# Signed once per bucket, by the SDK and by us: its characters exercise the key quoting, so a
# difference in quoting shows there and not in some user's URL.
PROBE_KEY = "campugrid-probe/a b+c=~ü%7E"
PROBE_DATE = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
MAX_EXPIRES = dt.timedelta(days=7)  # the SDK's (and AWS's) bounds
MAX_BUCKETS = 256  # shapes remembered (the platform's bucket and datasets' buckets)


def signed_region(url: str) -> str:
    """The region in a presigned URL's credential scope (KEY/DAY/REGION/s3/aws4_request)."""
    credential = parse_qs(urlsplit(url).query).get("X-Amz-Credential", [""])[0]
    parts = credential.rsplit("/", 4)
    if len(parts) != 5 or parts[3:] != ["s3", "aws4_request"]:
        raise ValueError(f"not a Signature V4 presigned URL: {url[:200]}")
    return parts[2]


@dataclasses.dataclass(frozen=True)
class Shape:
    """Where the SDK puts one bucket's objects: scheme and host (virtual-host style, AWS regional
    hosts and all), the path before the key ("/" or "/bucket/"), and the region it signs for."""

    scheme: str
    host: str
    prefix: str
    region: str


def object_path_ok(key: str) -> bool:
    """Keys the SDK accepts, which it quotes exactly like `quote(key, safe="/")`; the others go
    to the SDK (which refuses them in its own words)."""
    if not key.strip() or any(part in (".", "..") for part in key.split("/")):
        return False
    try:
        key.encode()
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


class Presigner:
    """Signs like `sdk.get_presigned_url`. Each bucket's shape is learned once from a URL the
    SDK signs itself, and kept only if our signature of that same URL is byte-identical; a
    bucket whose URL we cannot reproduce (a session token, say) is always handed to the SDK.

    The SDK client must know its region (S3Store settles it at start): otherwise the SDK asks
    the server for the bucket's location, which is a network call."""

    def __init__(self, sdk: Minio, access_key: str, secret_key: str) -> None:
        self.sdk = sdk
        self.access_key, self.secret_key = access_key, secret_key
        self._shapes: dict[str, Shape | None] = {}
        self._keys: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def handles(self, bucket: str, key: str) -> bool:
        """Whether `url` signs this itself (else it is the SDK's general path)."""
        return object_path_ok(key) and self._shape(bucket) is not None

    def url(self, method: str, bucket: str, key: str, expires: dt.timedelta, *,
            query: Mapping[str, str] | None = None, now: dt.datetime | None = None) -> str:
        shape = self._shape(bucket) if object_path_ok(key) else None
        if shape is None:
            return str(self.sdk.get_presigned_url(
                method, bucket, key, expires=expires, request_date=now,
                extra_query_params=dict(query) if query else None))
        if not 1 <= expires.total_seconds() <= MAX_EXPIRES.total_seconds():
            raise ValueError("expires must be between 1 second to 7 days")
        return self._sign(shape, method, key, int(expires.total_seconds()), query or {},
                          now or dt.datetime.now(dt.UTC))

    def _shape(self, bucket: str) -> Shape | None:
        try:  # one lookup: another thread may clear the cache in between
            return self._shapes[bucket]
        except KeyError:
            pass
        # Bucket names the SDK refuses raise here, as they would from the SDK.
        expected = str(self.sdk.get_presigned_url("GET", bucket, PROBE_KEY, expires=dt.timedelta(hours=1),
                                                  request_date=PROBE_DATE))
        parts, quoted = urlsplit(expected), quote(PROBE_KEY, safe="/")
        shape: Shape | None = None
        if parts.path.endswith("/" + quoted):
            shape = Shape(parts.scheme, parts.netloc, parts.path[: -len(quoted)],
                          signed_region(expected))
            if self._sign(shape, "GET", PROBE_KEY, 3600, {}, PROBE_DATE) != expected:
                shape = None
        if len(self._shapes) >= MAX_BUCKETS:
            self._shapes.clear()
        self._shapes[bucket] = shape
        return shape

    def _sign(self, shape: Shape, method: str, key: str, expires_s: int,
              query: Mapping[str, str], now: dt.datetime) -> str:
        if now.tzinfo is not None:  # a naive time is taken as UTC, as the SDK does
            now = now.astimezone(dt.UTC)
        day, stamp = now.strftime("%Y%m%d"), now.strftime("%Y%m%dT%H%M%SZ")
        scope = f"{day}/{shape.region}/s3/aws4_request"
        path = shape.prefix + quote(key, safe="/")
        extra = [(quote(k, safe=""), quote(v, safe="")) for k, v in sorted(query.items())]
        amz = [("X-Amz-Algorithm", "AWS4-HMAC-SHA256"),
               ("X-Amz-Credential", quote(f"{self.access_key}/{scope}", safe="")),
               ("X-Amz-Date", stamp), ("X-Amz-Expires", str(expires_s)),
               ("X-Amz-SignedHeaders", "host")]
        # The URL lists the extra parameters (sorted by name) before the X-Amz ones, the SDK's
        # order; the signature covers all of them sorted.
        listed = "&".join(f"{k}={v}" for k, v in extra + amz)
        canonical_query = "&".join(f"{k}={v}" for k, v in sorted(extra + amz))
        canonical = f"{method}\n{path}\n{canonical_query}\nhost:{shape.host}\n\nhost\nUNSIGNED-PAYLOAD"
        to_sign = (f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n"
                   f"{hashlib.sha256(canonical.encode()).hexdigest()}")
        signature = hmac.new(self._signing_key(day, shape.region), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        return f"{shape.scheme}://{shape.host}{path}?{listed}&X-Amz-Signature={signature}"

    def _signing_key(self, day: str, region: str) -> bytes:
        with self._lock:
            key = self._keys.get((day, region))
            if key is None:
                key = f"AWS4{self.secret_key}".encode()
                for part in (day, region, "s3", "aws4_request"):
                    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
                if any(d != day for d, _ in self._keys):
                    self._keys.clear()  # only today's
                self._keys[(day, region)] = key
            return key
