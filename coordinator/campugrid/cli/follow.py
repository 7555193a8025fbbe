"""Following a job from the CLI: its logs as they come, its phase on a spinner line, and
what the provider did with its data (inputs staged, checkpoints saved) from its events."""

from __future__ import annotations

import time
from typing import Any

from campugrid.cli.output import emit_line, interactive, phase

PHASES = {"queued": "waiting for a machine", "building": "building its image",
          "running": "running"}


def log_text(chunk: dict[str, Any]) -> str:
    prefix = "build| " if chunk["stream"] == "build" else ""
    return "\n".join(f"{prefix}{line}" for line in chunk["text"].splitlines())


def follow(api: Any, job_id: str, as_json: bool = False) -> dict[str, Any]:
    """Print the job's logs as they come (JSON Lines: {"event": "state"|"log", ...}) until it
    is final, with its phase on a spinner line where a person watches; the final job."""
    seen = ""
    news = _JobNews(api, job_id)
    with phase(interactive(as_json)) as now:
        def on_state(state: str) -> None:
            nonlocal seen
            if state != seen:
                emit_line(as_json, {"event": "state", "job_id": job_id, "state": state}, "")
                seen = state
            for ev in news.new():  # the provider's transfers: inputs staged, checkpoints saved
                emit_line(as_json, {"event": "job", "job_id": job_id, **ev}, "")
            now.show(f"job {job_id[:8]}: {PHASES.get(state, state)}{news.latest}")

        for chunk in api.follow_logs(job_id, on_state=on_state):
            if as_json:
                emit_line(True, {"event": "log", "job_id": job_id, **chunk}, "")
            elif text := log_text(chunk):
                now.echo(text)
        return dict(api.wait(job_id, check=False))


class _JobNews:
    """What the provider did with the job's data, from its events (every 2 s at most): the
    inputs it staged and the checkpoints it saved, for the phase line and JSON Lines."""

    KINDS = ("inputs", "checkpoint", "drained", "lease_expired", "refused")
    EVERY_S = 2.0

    def __init__(self, api: Any, job_id: str) -> None:
        self.api, self.job_id = api, job_id
        self.seen = 0
        self.at = 0.0
        self.latest = ""

    def new(self) -> list[dict[str, Any]]:
        if time.monotonic() - self.at < self.EVERY_S:
            return []
        self.at = time.monotonic()
        events = self.api.job(self.job_id).get("events") or []
        fresh = [e for e in events[self.seen:] if e.get("kind") in self.KINDS]
        self.seen = len(events)
        for e in fresh:
            self.latest = f" · {_news_text(e)}"
        return fresh


def size_text(nbytes: int) -> str:
    """Bytes for people: '812 bytes', '10.2 KB', '120.5 MB', '3.1 GB'."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    for unit in ("KB", "MB", "GB"):
        nbytes /= 1024  # type: ignore[assignment]
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.1f} {unit}"
    return ""  # not reached


def _news_text(event: dict[str, Any]) -> str:
    detail = str(event.get("detail", ""))
    if event.get("kind") == "checkpoint":  # "epoch N, SIZE bytes"
        epoch, _, size = detail.partition(", ")
        nbytes = size.removesuffix(" bytes")
        return f"checkpoint {epoch} saved ({size_text(int(nbytes)) if nbytes.isdigit() else size})"
    if event.get("kind") == "inputs":
        return f"inputs staged: {detail[:80]}"
    return f"{event.get('kind')}: {detail[:80]}"
