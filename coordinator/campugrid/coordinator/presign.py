"""Presigned URLs (AWS Signature V4, query form), the way the minio SDK makes them, but with
the day's signing key kept: every lease signs an upload URL, and the SDK's general path
(URL building, four HMACs per URL) was a sixth of the coordinator's time per lease.

tests/unit/test_presign.py checks that the URLs are identical to the SDK's; the platform's
tests use them against a real S3 server.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import threading
from urllib.parse import quote, urlsplit

SIMPLE_KEY = re.compile(r"^[A-Za-z0-9._~/-]{1,900}$")  # keys this path signs; others: the SDK


class Presigner:
    def __init__(self, endpoint_url: str, access_key: str, secret_key: str, region: str) -> None:
        parts = urlsplit(endpoint_url)
        self.scheme, self.host = parts.scheme, parts.netloc
        self.access_key, self.secret_key, self.region = access_key, secret_key, region
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @staticmethod
    def handles(bucket: str, key: str) -> bool:
        return bool(SIMPLE_KEY.match(key)) and "//" not in key and bool(SIMPLE_KEY.match(bucket))

    def url(self, method: str, bucket: str, key: str, expires_s: int,
            now: dt.datetime | None = None) -> str:
        now = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
        day, stamp = now.strftime("%Y%m%d"), now.strftime("%Y%m%dT%H%M%SZ")
        scope = f"{day}/{self.region}/s3/aws4_request"
        path = f"/{bucket}/{quote(key, safe='/')}"
        # Already in canonical (sorted) order.
        query = ("X-Amz-Algorithm=AWS4-HMAC-SHA256"
                 f"&X-Amz-Credential={quote(f'{self.access_key}/{scope}', safe='')}"
                 f"&X-Amz-Date={stamp}&X-Amz-Expires={expires_s}&X-Amz-SignedHeaders=host")
        canonical = f"{method}\n{path}\n{query}\nhost:{self.host}\n\nhost\nUNSIGNED-PAYLOAD"
        to_sign = (f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n"
                   f"{hashlib.sha256(canonical.encode()).hexdigest()}")
        signature = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        return f"{self.scheme}://{self.host}{path}?{query}&X-Amz-Signature={signature}"

    def _signing_key(self, day: str) -> bytes:
        with self._lock:
            key = self._keys.get(day)
            if key is None:
                key = f"AWS4{self.secret_key}".encode()
                for part in (day, self.region, "s3", "aws4_request"):
                    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
                self._keys = {day: key}  # only today's
            return key
