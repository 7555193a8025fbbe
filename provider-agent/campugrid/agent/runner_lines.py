"""What the shard runner says, read in a confined child (confine.Worker): every line comes
from inside a job's sandbox and is untrusted JSON. Only plain, checked values come back."""

from __future__ import annotations

import json

from campugrid.protocol.spec import MAX_SHARD_RESULT


def parse(line: bytes) -> dict[str, object]:
    """One line as a JSON object ({} if it is none). A "done" message's `result` must itself
    be bounded JSON text: if not, it is dropped and `result_error` says why."""
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(msg, dict):
        return {}
    result = msg.get("result")
    if "done" in msg and isinstance(result, str) and result:
        if len(result) > MAX_SHARD_RESULT:
            msg["result"], msg["result_error"] = "", f"the shard's result is over {MAX_SHARD_RESULT} bytes"
        else:
            try:
                json.loads(result)
            except (ValueError, RecursionError):
                msg["result"], msg["result_error"] = ("", "the shard's result is not JSON "
                                                          "(or nested too deeply)")
    return msg
