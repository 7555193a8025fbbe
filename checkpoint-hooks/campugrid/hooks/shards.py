"""Shards inside a campugrid job: the runner the agent starts in the warm sandbox, and
`serve_shards` for jobs that keep their state (a loaded model) from shard to shard.

A sharded job lists payloads; each becomes a task. One sandbox per machine and job stays up
while the machine works through shards, in one of two modes (the spec's "shard_mode"):

"process" (default): the job's command runs once per shard, with
    CAMPUGRID_SHARD_INDEX     the shard's number
    CAMPUGRID_SHARD_PAYLOAD   its payload as JSON (also on the command's stdin)
    CAMPUGRID_SHARD_OUTPUT    an empty folder; a result.json written there is the result
  otherwise the result is the command's last line of stdout (JSON if it parses, else text).
  A non-zero exit status fails the shard.

"serve": the job's command starts once and calls

    from campugrid import hooks
    model = load_model()                          # paid once per sandbox, not per shard
    hooks.serve_shards(lambda payload: model(payload))

  which calls the function once per shard; what it returns (JSON-able) is the result, an
  exception fails the shard.

Standard library only: it runs with the image's own python3.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

FDS_ENV = "CAMPUGRID_SHARD_FDS"
MAX_RESULT = 64 * 1024

__all__ = ["serve_shards"]


def serve_shards(fn: Callable[[Any], Any]) -> None:
    """Call `fn(payload)` for each shard this sandbox is given; its return value (anything
    json.dumps accepts) is the shard's result. Returns when there are no more shards."""
    fds = os.environ.get(FDS_ENV, "")
    if "," not in fds:
        raise RuntimeError("serve_shards() runs inside a campugrid job whose spec has "
                           '"shard_mode": "serve"')
    r, w = (int(x) for x in fds.split(",", 1))
    with os.fdopen(r, "rb") as requests, os.fdopen(w, "wb", buffering=0) as replies:
        for line in requests:
            req = json.loads(line)
            reply: dict[str, Any] = {"index": req["index"]}
            try:
                reply["result"] = json.dumps(fn(json.loads(req["payload_json"])))
                reply["ok"] = True
            except Exception as e:
                traceback.print_exc()
                reply.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            replies.write(json.dumps(reply).encode() + b"\n")
