"""What the agent reports when the provider side fails: never a presigned URL."""

import httpx

from campugrid.agent.task import _http_failure


def test_transfer_failures_are_reported_without_the_url():
    url = "http://127.0.0.1:9/b/k?X-Amz-Signature=deadbeef&X-Amz-Credential=ak"
    req = httpx.Request("GET", url)
    err = httpx.HTTPStatusError("boom " + url, request=req, response=httpx.Response(403, request=req))
    assert _http_failure(err) == "a transfer to or from object storage failed: HTTP 403"
    assert "Signature" not in _http_failure(httpx.ConnectError("failed " + url, request=req))
