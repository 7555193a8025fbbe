"""How campugrid's processes log: every line about a job carries its job id and attempt, as
human text by default or as JSON lines (one object per line) for a log system.

A job's code sets `about_job(job_id, attempt)` around the work it does for that job; threads
it starts for the job go through `thread()`, which carries the setting over. A line may also
name its job itself: `log.info(..., extra={"job_id": ..., "attempt": ...})`.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

FORMATS = ("text", "json")
_JOB: contextvars.ContextVar[tuple[str, int | None] | None] = contextvars.ContextVar(
    "campugrid_job", default=None)


@contextlib.contextmanager
def about_job(job_id: str, attempt: int | None) -> Iterator[None]:
    """Lines logged in this block (and in threads started with `thread`) name this job."""
    token = _JOB.set((job_id, attempt))
    try:
        yield
    finally:
        _JOB.reset(token)


def thread(target: Callable[..., Any], *args: Any, name: str | None = None,
           daemon: bool = True) -> threading.Thread:
    """A thread (not started) that logs about the same job as the code that starts it."""
    return _Thread(target=target, args=args, name=name, daemon=daemon)


class _Thread(threading.Thread):
    _context: contextvars.Context

    def start(self) -> None:
        self._context = contextvars.copy_context()
        super().start()

    def run(self) -> None:
        self._context.run(super().run)


class JobFields(logging.Filter):
    """Give every record `job_id` and `attempt` (None where it is about no job)."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = _JOB.get()
        if not hasattr(record, "job_id"):
            record.job_id = current[0] if current else None
        if not hasattr(record, "attempt"):
            same = current is not None and getattr(record, "job_id", None) == current[0]
            record.attempt = current[1] if current is not None and same else None
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        job_id = getattr(record, "job_id", None)
        if job_id:
            attempt = getattr(record, "attempt", None)
            where = f"job={job_id}" + (f" attempt={attempt}" if attempt is not None else "")
            first, sep, rest = line.partition("\n")  # after the message, before a traceback
            line = f"{first} [{where}]{sep}{rest}"
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "job_id": getattr(record, "job_id", None), "attempt": getattr(record, "attempt", None),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(fmt: str = "text", *, verbose: bool = False) -> None:
    """Set up the root logger of a campugrid process (`fmt`: one of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.addFilter(JobFields())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # Request lines would print presigned URLs (bearer credentials) and drown the job output.
    logging.getLogger("httpx").setLevel(logging.WARNING)
